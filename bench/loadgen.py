"""Closed-loop streaming load: `concurrency` workers send a fixed list of requests.

Every request is a streaming POST to /v1/completions (or /v1/chat/completions) over httpx; the
client records when each content chunk arrives, and the usage block the server sends at the end
(`stream_options.include_usage`). The level stops by itself: no new request starts after
`deadline_s`, and requests still running at `deadline_s + grace` are cancelled ("timeout").
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

from bench.metrics import RequestRecord


@dataclass(slots=True)
class LoadSpec:
    url: str  # base URL, e.g. http://127.0.0.1:8080
    model: str
    prompts: list[str]
    concurrency: int
    max_tokens: int
    endpoint: str = "completions"  # or "chat"
    temperature: float = 0.0
    ignore_eos: bool = True
    eos_bias: dict[str, float] | None = None  # logit_bias to forbid EOS where ignore_eos is absent
    request_timeout_s: float = 300.0
    deadline_s: float = 600.0
    extra_body: dict[str, Any] | None = None


def _body(spec: LoadSpec, prompt: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": spec.model,
        "max_tokens": spec.max_tokens,
        "temperature": spec.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if spec.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if spec.ignore_eos:
        body["ignore_eos"] = True
    if spec.eos_bias:
        body["logit_bias"] = dict(spec.eos_bias)
    if spec.extra_body:
        body.update(spec.extra_body)
    return body


def _chunk_text(obj: dict[str, Any]) -> str:
    choices = obj.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    if "text" in c and c["text"]:
        return str(c["text"])
    delta = c.get("delta") or {}
    return str(delta.get("content") or delta.get("reasoning_content") or "")


def _error_kind(exc: BaseException) -> str:
    if isinstance(exc, httpx.RemoteProtocolError):
        return "connection_reset" if "closed" in str(exc).lower() else "protocol_error"
    if isinstance(exc, httpx.ConnectError):
        return "connect_error"
    if isinstance(exc, httpx.ReadError | httpx.WriteError):
        return "connection_reset"
    if isinstance(exc, httpx.TimeoutException | asyncio.TimeoutError | TimeoutError):
        return "timeout"
    if isinstance(exc, asyncio.CancelledError):
        return "cancelled"
    return type(exc).__name__


def spread_tokens(num_chunks: int, num_tokens: int) -> list[int]:
    """Tokens per chunk when a stream of `num_chunks` content chunks carried `num_tokens` tokens.

    The first chunk counts as one token (it defines TTFT); the rest are spread evenly over the
    remaining chunks (a server that skips chunks whose text is empty merges tokens into the next).
    """
    if num_chunks <= 0:
        return []
    if num_tokens <= num_chunks or num_chunks == 1:
        return [1] * num_chunks
    rest, n = num_tokens - 1, num_chunks - 1
    base, extra = divmod(rest, n)
    return [1] + [base + (1 if i < extra else 0) for i in range(n)]


async def one_request(client: httpx.AsyncClient, spec: LoadSpec, prompt: str) -> RequestRecord:
    path = "/v1/chat/completions" if spec.endpoint == "chat" else "/v1/completions"
    rec = RequestRecord(start=time.monotonic())
    usage: dict[str, Any] | None = None
    saw_done = False
    try:
        async with client.stream("POST", spec.url + path, json=_body(spec, prompt)) as resp:
            rec.status = resp.status_code
            if resp.status_code != 200:
                await resp.aread()
                rec.error = f"http_{resp.status_code}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    saw_done = True
                    break
                now = time.monotonic()
                try:
                    obj = json.loads(data)
                except json.JSONDecodeError:
                    rec.error = "bad_sse"
                    return rec
                if "error" in obj:
                    rec.error = "stream_error"
                    return rec
                if _chunk_text(obj):
                    if rec.ttft is None:
                        rec.ttft = now - rec.start
                    rec.chunk_times.append(now)
                choices = obj.get("choices") or []
                if choices and choices[0].get("finish_reason"):
                    rec.finish_reason = choices[0]["finish_reason"]
                if obj.get("usage"):
                    usage = obj["usage"]
        if not saw_done:
            rec.error = "truncated_stream"
            return rec
        rec.ok = True
    except BaseException as exc:  # noqa: BLE001 (every failure is recorded by kind)
        rec.error = _error_kind(exc)
        if isinstance(exc, asyncio.CancelledError):
            raise
    finally:
        rec.end = time.monotonic()
        if usage:
            rec.output_tokens = int(usage.get("completion_tokens") or 0)
            rec.prompt_tokens = usage.get("prompt_tokens")
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            rec.cached_tokens = int(cached) if cached is not None else None
        if not rec.output_tokens:
            rec.output_tokens = len(rec.chunk_times)
        rec.chunk_tokens = spread_tokens(len(rec.chunk_times), rec.output_tokens)
    return rec


async def run_level(spec: LoadSpec) -> tuple[list[RequestRecord], float]:
    """Run every prompt once at `spec.concurrency`; returns (records, wall seconds)."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(spec.prompts)):
        queue.put_nowait(i)
    records: list[RequestRecord | None] = [None] * len(spec.prompts)
    limits = httpx.Limits(max_connections=spec.concurrency + 4,
                          max_keepalive_connections=spec.concurrency + 4)
    timeout = httpx.Timeout(spec.request_timeout_s, connect=30.0)
    t0 = time.monotonic()
    stop_at = t0 + spec.deadline_s

    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:

        async def worker() -> None:
            while time.monotonic() < stop_at:
                try:
                    i = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                records[i] = await one_request(client, spec, spec.prompts[i])

        tasks = [asyncio.create_task(worker()) for _ in range(spec.concurrency)]
        grace = min(spec.request_timeout_s, 60.0)
        _, pending = await asyncio.wait(tasks, timeout=spec.deadline_s + grace)
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.wait(pending, timeout=10.0)
    wall = time.monotonic() - t0
    out: list[RequestRecord] = []
    for r in records:
        if r is None:  # never started (deadline) or cancelled mid-flight
            r = RequestRecord(start=t0, end=t0 + wall, error="deadline")
        out.append(r)
    return out, wall
