"""Soak: minutes of mixed load; resident memory must level off and nothing may 5xx.

When the server has a prefix cache, the soak first fills it to its budget (distinct long
prompts, one token each; bounded in time): a cache filling up is memory held on purpose, and a
server that runs for long holds a full cache, so growth is judged from that steady state on —
with eviction churning under the mixed load, where a leak would hide.

`concurrency` workers send a mix (streaming and not, chat and completions, short and long
prompts, n=2 with logprobs, stop strings, streams cut mid-way, and a few bad requests that must
get a 4xx) until `minutes` have passed (and at most `max_requests`). The server's RSS is read
from /proc/<pid>/status every `sample_s`. Growth is measured from the end of the warm-up
(`warmup_frac` of the run) to the end: mean RSS over the last `window_s` vs mean RSS over the
first `window_s` after warm-up, and it must stay under `max_growth` (5 %).
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import httpx

from reliability.common import (
    CheckResult,
    Target,
    engine_stats,
    health,
    rss_bytes,
    still_serving,
    wait_idle,
)

WORDS = ("value", "result", "index", "buffer", "config", "token", "stream", "cache", "row", "step")


def _long_prompt(rng: random.Random, n_words: int) -> str:
    lines = [f"def helper_{i}({rng.choice(WORDS)}, {rng.choice(WORDS)}):\n"
             f"    return {rng.choice(WORDS)} + {i}" for i in range(n_words // 8)]
    return "\n".join(lines) + "\ndef main():"


def _request(rng: random.Random, model: str, i: int) -> tuple[str, str, dict[str, Any]]:
    """(kind, path, body) for request number i."""
    roll = rng.random()
    short = f"def task_{i}(x):"
    if roll < 0.25:
        return "stream", "/v1/completions", {"model": model, "prompt": short, "stream": True,
                                              "max_tokens": rng.randint(8, 96)}
    if roll < 0.45:
        return "chat", "/v1/chat/completions", {
            "model": model, "max_tokens": rng.randint(8, 64),
            "messages": [{"role": "user", "content": f"Write a Python function `f{i}(x)`."}]}
    if roll < 0.60:
        return "long", "/v1/completions", {"model": model, "stream": True, "max_tokens": 24,
                                           "prompt": _long_prompt(rng, rng.randint(100, 600))}
    if roll < 0.72:
        return "cancel", "/v1/chat/completions", {
            "model": model, "stream": True, "max_tokens": 256, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"Write a long module number {i}."}]}
    if roll < 0.82:
        return "n2_logprobs", "/v1/completions", {"model": model, "prompt": short, "n": 2,
                                                  "max_tokens": 16, "logprobs": 3, "seed": i}
    if roll < 0.94:
        return "stop", "/v1/completions", {"model": model, "prompt": short, "max_tokens": 64,
                                           "stop": ["\n\n", "return"], "stream": rng.random() < .5}
    return "bad", "/v1/completions", {"model": model, "prompt": short, "max_tokens": -5}


def _fill_prompt(rng: random.Random, i: int) -> str:
    """About 3,000 tokens that share no 16-token block with any other prompt."""
    return f"# fill {i} {rng.random():.12f}\n" + _long_prompt(rng, 1200)


async def _fill_prefix_cache(client: httpx.AsyncClient, target: Target, rng: random.Random, *,
                             concurrency: int, max_s: float, target_frac: float = 0.95,
                             ) -> dict[str, Any]:
    """Send distinct long prompts until the prefix cache holds `target_frac` of its budget."""
    pc = engine_stats(await health(client, target)).get("prefix_cache")
    budget = int((pc or {}).get("max_bytes") or 0)
    info: dict[str, Any] = {"budget": budget, "requests": 0, "statuses": {}}
    if not budget:
        info["skipped"] = "the server reports no prefix cache"
        return info
    t0 = time.monotonic()
    full = asyncio.Event()
    counter = iter(range(100_000))

    async def worker() -> None:
        while not full.is_set() and time.monotonic() - t0 < max_s:
            i = next(counter)
            body = {"model": target.model, "prompt": _fill_prompt(rng, i), "max_tokens": 1}
            try:
                r = await client.post(target.url + "/v1/completions", json=body)
                st = str(r.status_code)
            except httpx.HTTPError as exc:
                st = type(exc).__name__
            info["requests"] += 1
            info["statuses"][st] = info["statuses"].get(st, 0) + 1

    async def watch() -> None:
        while not full.is_set() and time.monotonic() - t0 < max_s:
            st = engine_stats(await health(client, target))
            info["bytes"] = int(st.get("prefix_cache_bytes") or 0)
            if info["bytes"] >= target_frac * budget:
                full.set()
            await asyncio.sleep(1.0)

    await asyncio.gather(watch(), *[worker() for _ in range(concurrency)])
    info.update(full=full.is_set(), seconds=round(time.monotonic() - t0, 1))
    return info


async def _send(client: httpx.AsyncClient, target: Target, rng: random.Random, i: int,
                tally: dict[str, Any]) -> None:
    kind, path, body = _request(rng, target.model, i)
    cut_after = rng.randint(1, 20) if kind == "cancel" else None
    try:
        async with client.stream("POST", target.url + path, json=body) as resp:
            st = resp.status_code
            if body.get("stream") and st == 200:
                n = 0
                async for line in resp.aiter_lines():
                    if line.startswith("data:"):
                        n += 1
                        if cut_after is not None and n >= cut_after:
                            break
                        if '"error"' in line and line.startswith('data: {"error"'):
                            tally["stream_errors"] += 1
            else:
                await resp.aread()
    except httpx.HTTPError as exc:
        tally["transport_errors"][type(exc).__name__] = \
            tally["transport_errors"].get(type(exc).__name__, 0) + 1
        return
    tally["statuses"][str(st)] = tally["statuses"].get(str(st), 0) + 1
    tally["kinds"][kind] = tally["kinds"].get(kind, 0) + 1
    if kind == "bad" and not 400 <= st < 500:
        tally["bad_not_4xx"] += 1
    if kind != "bad" and st != 200:
        tally["good_not_200"][str(st)] = tally["good_not_200"].get(str(st), 0) + 1


def _growth_by_owner(memory: list[dict[str, Any]], warm_end: float,
                     window_s: float) -> dict[str, list[float]]:
    """Per reading of the server's memory (MLX arrays, MLX cache, malloc in use / free, ...):
    [mean MiB in the first window after warm-up, mean MiB in the last window]."""
    if not memory:
        return {}
    base = [m for m in memory if warm_end <= m["t"] < warm_end + window_s]
    last = [m for m in memory if m["t"] >= memory[-1]["t"] - window_s]
    out: dict[str, list[float]] = {}
    for key in memory[-1]:
        if key in ("t", "python_blocks", "num_releases", "release_seconds") or not base or not last:
            continue
        out[key] = [round(sum(m.get(key, 0) for m in ms) / len(ms) / 2**20, 1) for ms in (base, last)]
    return out


async def run(target: Target, *, minutes: float = 10.0, concurrency: int = 8,
              warmup_frac: float = 0.3, window_s: float = 30.0, sample_s: float = 2.0,
              max_growth: float = 0.05, max_requests: int = 1_000_000, seed: int = 0,
              fill_prefix_cache: bool = True, fill_max_s: float = 600.0) -> CheckResult:
    rng = random.Random(seed)
    fill: dict[str, Any] = {"skipped": "not asked"}
    problems: list[str] = []
    if fill_prefix_cache:
        async with httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=10.0)) as client:
            fill = await _fill_prefix_cache(client, target, random.Random(seed + 1),
                                            concurrency=concurrency, max_s=fill_max_s)
        bad = {s: n for s, n in fill["statuses"].items() if s != "200"} if "statuses" in fill else {}
        if bad:
            problems.append(f"prefix-cache fill requests not answered 200: {bad}")
    t0 = time.monotonic()
    duration = minutes * 60.0
    end = t0 + duration
    tally: dict[str, Any] = {"statuses": {}, "kinds": {}, "transport_errors": {},
                             "good_not_200": {}, "bad_not_4xx": 0, "stream_errors": 0}
    samples: list[tuple[float, int]] = []
    # engine memory next to RSS, to tell a leak from a cache filling up to its budget
    engine_mem: list[tuple[float, int, int]] = []  # (t, kv_bytes, prefix_cache_bytes)
    # the server's own memory readings by owner (MLX arrays and buffer cache, malloc), when given
    memory: list[dict[str, Any]] = []
    counter = iter(range(max_requests))
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(120.0, connect=10.0)) as client:

        async def worker(w: int) -> None:
            wrng = random.Random(rng.random())
            while time.monotonic() < end:
                i = next(counter, None)
                if i is None:
                    return
                await _send(client, target, wrng, i, tally)

        async def sampler() -> None:
            while time.monotonic() < end:
                rss = rss_bytes(target.pid)
                if rss is not None:
                    samples.append((time.monotonic() - t0, rss))
                st = engine_stats(await health(client, target))
                if st:
                    engine_mem.append((round(time.monotonic() - t0, 1), int(st.get("kv_bytes") or 0),
                                       int((st.get("prefix_cache") or {}).get("bytes") or 0)))
                    mem = st.get("memory")
                    if isinstance(mem, dict):
                        memory.append({"t": round(time.monotonic() - t0, 1), **mem})
                await asyncio.sleep(sample_s)

        tasks = [asyncio.create_task(worker(w)) for w in range(concurrency)]
        tasks.append(asyncio.create_task(sampler()))
        _, pending = await asyncio.wait(tasks, timeout=duration + 180)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        if pending:
            problems.append(f"{len(pending)} worker(s) still busy 180 s after the soak ended")
        idle, _, stats = await wait_idle(client, target, within_s=10.0)
        if not idle:
            problems.append(f"engine not idle 10 s after the soak: {stats}")
        problems.extend(await still_serving(client, target))

    n5xx = sum(n for s, n in tally["statuses"].items() if s.startswith("5"))
    if n5xx:
        problems.append(f"{n5xx} 5xx response(s): {tally['statuses']}")
    if tally["good_not_200"]:
        problems.append(f"valid requests answered with non-200: {tally['good_not_200']}")
    if tally["bad_not_4xx"]:
        problems.append(f"{tally['bad_not_4xx']} invalid request(s) not answered 4xx")
    if tally["transport_errors"]:
        problems.append(f"transport errors: {tally['transport_errors']}")
    if tally["stream_errors"]:
        problems.append(f"{tally['stream_errors']} error event(s) inside streams")
    growth = None
    rss_info: dict[str, Any] = {"samples": len(samples)}
    if target.pid is None:
        rss_info["note"] = "no server pid: RSS not measured"
    elif samples:
        warm_end = warmup_frac * duration
        base = [r for t, r in samples if warm_end <= t < warm_end + window_s]
        last = [r for t, r in samples if t >= samples[-1][0] - window_s]
        if base and last:
            b, e = sum(base) / len(base), sum(last) / len(last)
            growth = (e - b) / b
            rss_info.update(start_mib=samples[0][1] / 2**20, after_warmup_mib=b / 2**20,
                            end_mib=e / 2**20, max_mib=max(r for _, r in samples) / 2**20,
                            growth=growth)
            rss_info["by_owner_mib"] = _growth_by_owner(memory, warm_end, window_s)
            if growth > max_growth:
                problems.append(f"RSS grew {growth * 100:.1f}% after warm-up "
                                f"({b / 2**20:.0f} → {e / 2**20:.0f} MiB), limit "
                                f"{max_growth * 100:.0f}%")
        else:
            problems.append("too few RSS samples after the warm-up to judge growth")
    total = sum(tally["statuses"].values())
    elapsed = time.monotonic() - t0
    return CheckResult(
        name="soak",
        ok=not problems,
        summary=((f"prefix cache filled to {fill.get('bytes', 0) / 2**20:.0f} of "
                  f"{fill['budget'] / 2**20:.0f} MiB in "
                  f"{fill.get('seconds', 0):.0f} s ({fill['requests']} requests), then "
                  if "skipped" not in fill else "")
                 + f"{minutes:g} min, {total} requests ({total / max(elapsed, 1e-9):.1f}/s), "
                 + (f"prefix cache {engine_mem[-1][2] / 2**20:.0f} MiB at the end, "
                    if engine_mem else "")
                 + f"{n5xx} 5xx, RSS "
                 + (f"{rss_info['after_warmup_mib']:.0f} → {rss_info['end_mib']:.0f} MiB "
                    f"({growth * 100:+.1f}% after warm-up)" if growth is not None
                    else "not measured")),
        problems=problems,
        details={"tally": tally, "rss": rss_info, "prefix_cache_fill": fill,
                 "rss_samples": [(round(t, 1), r) for t, r in samples],
                 "engine_memory_samples": engine_mem, "memory_samples": memory},
        seconds=elapsed,
    )
