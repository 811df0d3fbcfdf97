"""Overload: a burst far beyond what the server admits, against a bounded queue.

`num_requests` short requests (half streaming) at `concurrency`. Every answer must be one of:
a completed 200 (a streamed one ends in `data: [DONE]`), or a 429/503 that carries Retry-After.
No other status, no dropped connection, the server still serves afterwards and drains to idle.
When the server's limits are known (we started it) and the burst exceeds running + queued
capacity, at least one request must have been turned away (the queue is really bounded).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx

from reliability.common import CheckResult, Target, engine_stats, health, still_serving, wait_idle


async def _one(client: httpx.AsyncClient, target: Target, i: int, max_tokens: int) -> dict[str, Any]:
    stream = i % 2 == 0
    body: dict[str, Any] = {"model": target.model, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True, "stream": stream,
                            "prompt": f"def overload_{i}(x):"}
    out: dict[str, Any] = {"status": None, "retry_after": None, "complete": False, "error": None,
                           "stream": stream}
    try:
        async with client.stream("POST", target.url + "/v1/completions", json=body) as resp:
            out["status"] = resp.status_code
            out["retry_after"] = resp.headers.get("retry-after")
            if resp.status_code != 200:
                await resp.aread()
                return out
            if stream:
                async for line in resp.aiter_lines():
                    if line.strip() == "data: [DONE]":
                        out["complete"] = True
                    elif line.startswith("data:") and '"error"' in line:
                        out["error"] = "error event in stream"
            else:
                data = json.loads(await resp.aread())
                out["complete"] = bool(data.get("choices")) and \
                    data["choices"][0].get("finish_reason") is not None
    except httpx.HTTPError as exc:
        out["error"] = f"{type(exc).__name__}"
    except ValueError:
        out["error"] = "bad JSON body"
    return out


async def run(target: Target, *, num_requests: int = 1000, concurrency: int = 256,
              max_tokens: int = 16, time_limit_s: float = 600.0) -> CheckResult:
    t0 = time.monotonic()
    problems: list[str] = []
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(300.0, connect=30.0)) as client:
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(num_requests):
            queue.put_nowait(i)
        results: list[dict[str, Any]] = []
        peak_waiting = 0

        async def worker() -> None:
            while time.monotonic() - t0 < time_limit_s:
                try:
                    i = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                results.append(await _one(client, target, i, max_tokens))

        async def watch() -> None:
            nonlocal peak_waiting
            while True:
                st = engine_stats(await health(client, target))
                peak_waiting = max(peak_waiting, int(st.get("num_waiting") or 0))
                await asyncio.sleep(0.1)

        watcher = asyncio.create_task(watch())
        workers = [asyncio.create_task(worker()) for _ in range(concurrency)]
        done, pending = await asyncio.wait(workers, timeout=time_limit_s + 60)
        for task in pending:
            task.cancel()
        watcher.cancel()
        await asyncio.gather(*pending, watcher, return_exceptions=True)
        if pending or len(results) < num_requests:
            problems.append(f"time limit: {len(results)}/{num_requests} requests answered")
        idle, took, stats = await wait_idle(client, target, within_s=30.0)
        if not idle:
            problems.append(f"engine not idle 30 s after the burst: {stats}")
        problems.extend(await still_serving(client, target))

    statuses: dict[str, int] = {}
    for r in results:
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    admitted = [r for r in results if r["status"] == 200]
    rejected = [r for r in results if r["status"] in (429, 503)]
    incomplete = [r for r in admitted if not r["complete"] or r["error"]]
    no_retry = [r for r in rejected if not r["retry_after"]]
    other = {s: n for s, n in statuses.items() if s not in ("200", "429", "503")}
    errors = [r["error"] for r in results if r["error"]]
    if other:
        problems.append(f"statuses other than 200/429/503: {other}")
    if incomplete:
        problems.append(f"{len(incomplete)} admitted request(s) did not complete "
                        f"(e.g. {incomplete[0]})")
    if no_retry:
        problems.append(f"{len(no_retry)} 429/503 answer(s) without Retry-After")
    if errors:
        problems.append(f"{len(errors)} connection-level error(s): "
                        f"{sorted(set(errors))[:5]}")
    capacity = None
    if target.max_queue is not None and target.max_num_seqs is not None:
        capacity = target.max_queue + target.max_num_seqs
        if concurrency > capacity and not rejected:
            problems.append(f"no request was turned away although concurrency {concurrency} > "
                            f"running + queued capacity {capacity}: is the queue bounded?")
        if target.max_queue is not None and peak_waiting > target.max_queue:
            problems.append(f"num_waiting reached {peak_waiting} > --max-queue {target.max_queue}")
    return CheckResult(
        name="overload",
        ok=not problems,
        summary=(f"{num_requests} requests at concurrency {concurrency}: {len(admitted)} admitted "
                 f"and {len(admitted) - len(incomplete)} completed, {len(rejected)} turned away "
                 f"(429/503), peak waiting {peak_waiting}"
                 + (f" (max-queue {target.max_queue})" if target.max_queue is not None else "")),
        problems=problems,
        details={"statuses": statuses, "admitted": len(admitted), "rejected": len(rejected),
                 "incomplete": len(incomplete), "peak_waiting": peak_waiting,
                 "capacity": capacity,
                 "retry_after_values": sorted({r["retry_after"] for r in rejected
                                               if r["retry_after"]})[:5]},
        seconds=time.monotonic() - t0,
    )
