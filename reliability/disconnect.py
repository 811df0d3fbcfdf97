"""Disconnect storm: streaming requests cut at random points, then the engine must be idle.

Each request streams a long completion (ignore_eos) and is cut at a random point: before the
response headers (during prefill), right after them, or after a random number of chunks. At
most `concurrency` are in flight at once. After the last cut, /health must show no running or
waiting row and zero KV bytes within `idle_within_s`, and a good request must still complete.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import httpx

from reliability.common import CheckResult, Target, engine_stats, health, still_serving, wait_idle


async def _one(client: httpx.AsyncClient, target: Target, rng: random.Random,
               i: int) -> dict[str, Any]:
    mode = rng.choice(["before_headers", "after_headers", "mid_stream", "mid_stream"])
    cut_after = rng.randint(1, 40)
    chat = rng.random() < 0.5
    body: dict[str, Any] = {"model": target.model, "max_tokens": 400, "temperature": 0.8,
                            "stream": True, "ignore_eos": True, "seed": i}
    if chat:
        body["messages"] = [{"role": "user", "content": f"Write Python function number {i}."}]
    else:
        body["prompt"] = f"def function_{i}(x):" + "\n    # " + "word " * rng.randint(1, 300)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    out: dict[str, Any] = {"mode": mode, "status": None, "chunks": 0, "error": None}

    async def go() -> None:
        async with client.stream("POST", target.url + path, json=body) as resp:
            out["status"] = resp.status_code
            if resp.status_code != 200 or mode == "after_headers":
                return
            async for line in resp.aiter_lines():
                if line.startswith("data:"):
                    out["chunks"] += 1
                    if out["chunks"] >= cut_after:
                        return  # leaving the context closes the connection mid-stream

    try:
        if mode == "before_headers":
            await asyncio.wait_for(go(), timeout=rng.uniform(0.0, 0.3))
        else:
            await asyncio.wait_for(go(), timeout=120.0)
    except TimeoutError:
        if mode != "before_headers":
            out["error"] = "timeout"
    except httpx.HTTPError as exc:
        out["error"] = type(exc).__name__
    return out


async def run(target: Target, *, num_requests: int = 200, concurrency: int = 32,
              idle_within_s: float = 2.0, seed: int = 0, time_limit_s: float = 600.0) -> CheckResult:
    t0 = time.monotonic()
    rng = random.Random(seed)
    sem = asyncio.Semaphore(concurrency)
    # no keep-alive: every cut really closes its TCP connection
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=0)
    problems: list[str] = []
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(120.0, connect=10.0)) as client:
        peak: dict[str, Any] = {"num_running": 0, "num_waiting": 0, "kv_bytes": 0}
        stop_sampling = asyncio.Event()

        async def sample_peak() -> None:
            while not stop_sampling.is_set():
                st = engine_stats(await health(client, target))
                for k in peak:
                    peak[k] = max(peak[k], int(st.get(k) or 0))
                await asyncio.sleep(0.2)

        async def guarded(i: int) -> dict[str, Any]:
            async with sem:
                if time.monotonic() - t0 > time_limit_s:
                    return {"mode": "skipped", "status": None, "chunks": 0, "error": "time limit"}
                return await _one(client, target, random.Random(rng.random()), i)

        sampler = asyncio.create_task(sample_peak())
        results = await asyncio.gather(*(guarded(i) for i in range(num_requests)))
        stop_sampling.set()
        await sampler
        idle, took, stats = await wait_idle(client, target, within_s=idle_within_s)
        if not idle:
            # how long it takes after all (bounded), to make the report useful
            late, late_took, late_stats = await wait_idle(client, target, within_s=30.0)
            problems.append(
                f"engine not idle {idle_within_s:.1f}s after the last disconnect: "
                f"num_running={stats.get('num_running')} num_waiting={stats.get('num_waiting')} "
                f"kv_bytes={stats.get('kv_bytes')}"
                + (f"; idle after {idle_within_s + late_took:.1f}s" if late else
                   f"; still not idle after {idle_within_s + late_took:.0f}s: {late_stats}"))
        problems.extend(await still_serving(client, target))
    modes: dict[str, int] = {}
    statuses: dict[str, int] = {}
    errors: dict[str, int] = {}
    for r in results:
        modes[r["mode"]] = modes.get(r["mode"], 0) + 1
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
        if r["error"]:
            errors[r["error"]] = errors.get(r["error"], 0) + 1
    # 429/503 (the queue was full) are allowed: those requests never ran, nothing to free
    bad_status = {s: n for s, n in statuses.items() if s not in ("200", "429", "503", "None")}
    rejected = statuses.get("429", 0) + statuses.get("503", 0)
    if bad_status:
        problems.append(f"unexpected statuses during the storm: {bad_status}")
    if rejected and target.max_queue is not None and concurrency <= target.max_queue:
        problems.append(f"{rejected} request(s) turned away although at most {concurrency} were "
                        f"in flight and --max-queue is {target.max_queue}: do cut requests "
                        "linger in the queue?")
    if errors:
        problems.append(f"client-side errors during the storm: {errors}")
    return CheckResult(
        name="disconnect storm",
        ok=not problems,
        summary=(f"{num_requests} streams cut ({', '.join(f'{k} {v}' for k, v in sorted(modes.items()))}"
                 + (f"; {rejected} turned away 429/503" if rejected else "") + "); "
                 f"peak {peak['num_running']} running, {peak['num_waiting']} waiting, "
                 f"{peak['kv_bytes'] / 2**20:.1f} MiB KV; "
                 + (f"idle {took:.2f}s after the last cut" if idle else "NOT idle in time")),
        problems=problems,
        details={"modes": modes, "statuses": statuses, "errors": errors, "peak": peak,
                 "idle_after_s": took if idle else None, "final_stats": stats},
        seconds=time.monotonic() - t0,
    )
