"""`python -m bench switch`: the cost of serving several models from one process (engine.pool).

    python -m bench switch                      # the bundled model and a tiny random llama
    python -m bench switch --model coder=DIR --model big=/models/llama-1b-random

Two measurements, in-process on the engine (no HTTP):

- **switch**: a memory budget that holds the largest model but not two, and requests that
  alternate between the models, so every request unloads the other model and loads its own.
  Per model: the switch request's time to first token (unload + load + prefill + one step),
  the pool's `load_seconds`, and a warm request's time to first token for comparison.
- **stall**: the first model decodes a long request while the second loads on the same thread
  (room for both); the largest gap between the first model's tokens during the load, against
  its median gap (a load runs a slice between two decode steps, never all at once).

A 1B-shape model to switch to: `python -m bench random-model /tmp/llama-1b --bits 4`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

from bench import common

PROMPT = [1, 17, 300, 42, 9, 77, 5, 6]


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("switch", help="time to switch between models served by name",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", dest="models", action="append", default=[], metavar="NAME=DIR",
                   help="two models (default: the bundled model and a random llama of "
                        "random-model's 'tiny' shape)")
    p.add_argument("--rounds", type=int, default=4, help="switches to each model")
    p.add_argument("--stall-tokens", type=int, default=256,
                   help="tokens the first model decodes while the second loads")
    p.add_argument("--slice-bytes", type=int, default=64 << 20,
                   help="weights evaluated per engine turn while loading (PoolConfig)")
    p.add_argument("--dtype", default="auto")
    common.add_out_arg(p)
    p.set_defaults(func=cmd_switch)


def _models(args: argparse.Namespace, out: Path) -> list[tuple[str, str]]:
    pairs = []
    for text in args.models:
        name, _, path = text.partition("=")
        pairs.append((name, path))
    if not pairs:
        from bench.modelprep import random_model

        pairs = [("coder", str(common.default_model())),
                 ("tiny", str(random_model("tiny", out / "tiny-model", bits=None)))]
    if len(pairs) != 2:
        raise SystemExit("switch: give two models (--model NAME=DIR twice)")
    return pairs


def _pool(pairs: list[tuple[str, str]], budget: int | None, args: argparse.Namespace) -> Any:
    from engine.core import EngineConfig
    from engine.pool import EnginePool, ModelSpec, PoolConfig
    from engine.pool_client import AsyncPool
    from engine.scheduler import SchedulerConfig

    config = PoolConfig(EngineConfig(SchedulerConfig(), memory_budget=budget), dtype=args.dtype,
                        load_slice_bytes=args.slice_bytes)
    client = AsyncPool(EnginePool([ModelSpec(n, p) for n, p in pairs], config))
    client.start()
    return client


async def _timed(client: Any, model: str, max_tokens: int, req_id: str) -> list[float]:
    """Seconds from submit to each token event (the first: time to first token)."""
    from engine.api import Request, SamplingParams

    t0 = time.perf_counter()
    stamps: list[float] = []
    stream = await client.submit(Request(req_id, list(PROMPT), SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True), model=model))
    async for ev in stream:
        if ev.token_ids:
            stamps.append(time.perf_counter() - t0)
    return stamps


def _status(client: Any, name: str) -> Any:
    return next(s for s in client.list_models() if s.name == name)


def measure_switch(pairs: list[tuple[str, str]], args: argparse.Namespace) -> dict[str, Any]:
    names = [n for n, _ in pairs]
    probe = _pool(pairs, None, args)
    try:
        asyncio.run(_timed(probe, names[1], 1, "probe"))
        weights = {s.name: s.weights_bytes for s in probe.list_models()}
    finally:
        probe.stop()
    budget = max(weights.values()) + min(weights.values()) // 2
    client = _pool(pairs, budget, args)
    rows: dict[str, dict[str, list[float]]] = {n: {"switch_ttft_s": [], "load_s": [],
                                                   "warm_ttft_s": []} for n in names}
    try:
        async def go() -> None:
            for i in range(args.rounds):
                for name in (names[1], names[0]):
                    rows[name]["switch_ttft_s"].append((await _timed(client, name, 1, f"s{i}{name}"))[0])
                    rows[name]["load_s"].append(float(_status(client, name).load_seconds or 0.0))
                    rows[name]["warm_ttft_s"].append((await _timed(client, name, 1, f"w{i}{name}"))[0])

        asyncio.run(go())
    finally:
        client.stop()
    summary = {n: {k: statistics.median(v) for k, v in r.items()} for n, r in rows.items()}
    return {"budget_bytes": budget, "weights_bytes": weights, "runs": rows, "median": summary}


def measure_stall(pairs: list[tuple[str, str]], args: argparse.Namespace) -> dict[str, Any]:
    names = [n for n, _ in pairs]
    client = _pool(pairs, None, args)
    try:
        async def go() -> tuple[list[float], float, float]:
            await client.model_info(names[1])
            decoding = asyncio.ensure_future(_timed(client, names[0], args.stall_tokens, "long"))
            await asyncio.sleep(0.2)
            t0 = time.perf_counter()
            await _timed(client, names[1], 1, "load")
            return await decoding, t0, time.perf_counter()

        t_submit = time.perf_counter()
        stamps, load_start, load_end = asyncio.run(go())
    finally:
        client.stop()
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    start, end = load_start - t_submit, load_end - t_submit
    during = [g for (a, _), g in zip(zip(stamps, stamps[1:], strict=False), gaps, strict=True)
              if start <= a <= end]
    return {"median_gap_ms": statistics.median(gaps) * 1e3 if gaps else 0.0,
            "max_gap_during_load_ms": max(during, default=0.0) * 1e3,
            "gaps_during_load": len(during), "load_wall_s": end - start}


def cmd_switch(args: argparse.Namespace) -> int:
    out = common.out_dir(args, "switch")
    pairs = _models(args, out)
    result: dict[str, Any] = {"models": dict(pairs), "machine": common.machine_info(),
                              "switch": measure_switch(pairs, args),
                              "stall": measure_stall(pairs, args)}
    common.write_json(out / "switch.json", "switch", result, args)
    plot(result, out / "switch.png")
    for name, m in result["switch"]["median"].items():
        print(f"{name}: switch TTFT {m['switch_ttft_s']:.3f} s (load {m['load_s']:.3f} s), "
              f"warm TTFT {m['warm_ttft_s'] * 1e3:.1f} ms")
    stall = result["stall"]
    print(f"decode gap while loading: max {stall['max_gap_during_load_ms']:.1f} ms, median gap "
          f"{stall['median_gap_ms']:.1f} ms")
    print(f"wrote {out / 'switch.json'}, {out / 'switch.png'}")
    return 0


def plot(result: dict[str, Any], path: Path) -> None:
    plt = common.pyplot()
    med = result["switch"]["median"]
    names = list(med)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    x = range(len(names))
    a.bar([i - 0.2 for i in x], [med[n]["switch_ttft_s"] for n in names], 0.4, label="switch")
    a.bar([i + 0.2 for i in x], [med[n]["warm_ttft_s"] for n in names], 0.4, label="warm")
    a.set_xticks(list(x), names)
    a.set_ylabel("time to first token (s, median)")
    a.set_title("switching models (unload + load) vs loaded")
    a.legend()
    stall = result["stall"]
    b.bar(["median gap", "max gap while loading"],
          [stall["median_gap_ms"], stall["max_gap_during_load_ms"]], color=["C0", "C1"])
    b.set_ylabel("ms between tokens of the decoding model")
    b.set_title("a load next to a decoding model")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
