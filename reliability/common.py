"""What every reliability check shares: results, /health readings, a known-good request.

Every network call goes to the server under test on loopback, with a timeout; every loop is
bounded in count and in time.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import httpx

LOOPBACK = {"127.0.0.1", "localhost", "::1", "[::1]"}


def check_loopback(url: str) -> None:
    host = urlparse(url).hostname or ""
    if host not in LOOPBACK and not host.startswith("127."):
        raise SystemExit(f"refusing to target {host!r}: the reliability suite runs on loopback only")


@dataclass(slots=True)
class CheckResult:
    name: str
    ok: bool
    summary: str
    problems: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


@dataclass(slots=True)
class Target:
    """The server under test: its base URL, the model id to ask for, and its pid when known."""

    url: str
    model: str
    pid: int | None = None
    max_queue: int | None = None  # when we started it ourselves
    max_num_seqs: int | None = None


async def health(client: httpx.AsyncClient, target: Target) -> dict[str, Any] | None:
    try:
        r = await client.get(target.url + "/health", timeout=5.0)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def engine_stats(h: dict[str, Any] | None) -> dict[str, Any]:
    return (h or {}).get("engine") or {}


async def wait_idle(client: httpx.AsyncClient, target: Target, within_s: float,
                    poll_s: float = 0.05) -> tuple[bool, float, dict[str, Any]]:
    """Poll /health until no row runs, none waits and no KV bytes are held (bounded by time)."""
    t0 = time.monotonic()
    stats: dict[str, Any] = {}
    while True:
        stats = engine_stats(await health(client, target))
        if stats and stats.get("num_running", 1) == 0 and stats.get("num_waiting", 1) == 0 \
                and stats.get("kv_bytes", 1) == 0:
            return True, time.monotonic() - t0, stats
        if time.monotonic() - t0 > within_s:
            return False, time.monotonic() - t0, stats
        await asyncio.sleep(poll_s)


async def good_request(client: httpx.AsyncClient, target: Target) -> str | None:
    """A small valid chat request; None when it succeeded, else what went wrong."""
    body = {"model": target.model, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "Write a Python function `add(a, b)`."}]}
    try:
        r = await client.post(target.url + "/v1/chat/completions", json=body, timeout=60.0)
    except httpx.HTTPError as exc:
        return f"good request failed: {type(exc).__name__}: {exc}"
    if r.status_code != 200:
        return f"good request got HTTP {r.status_code}: {r.text[:200]}"
    try:
        msg = r.json()["choices"][0]["message"]
    except (ValueError, KeyError, IndexError):
        return f"good request got a malformed body: {r.text[:200]}"
    if not isinstance(msg.get("content"), str):
        return f"good request got no content: {r.text[:200]}"
    return None


async def still_serving(client: httpx.AsyncClient, target: Target) -> list[str]:
    """/health answers and a good request completes; the problems found, if any."""
    problems = []
    if await health(client, target) is None:
        problems.append("/health did not answer 200")
    err = await good_request(client, target)
    if err:
        problems.append(err)
    return problems


def rss_bytes(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
