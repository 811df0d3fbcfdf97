"""Time to first token for prompts of many different lengths, with and without stable shapes.

    python -m bench.prefill_shapes [--model DIR] [--dtype bfloat16] [--requests 24] [--out DIR]

On CUDA, MLX builds a cuDNN graph for every new attention shape (rows, queries, keys); a server
that prefills each prompt at its own length pays that on every new length. The engine's stable
shapes (engine/runner.py: last chunk padded to a power of two, keys widened, warm-up at
start-up) bound the set of shapes. This runs the engine at library level, one request at a time
(greedy, 4 output tokens), alternating rounds of the two modes with fresh random lengths each
round (lengths that are never a bucket, so the modes never share a shape), and writes JSON + PNG.
On a CPU stable shapes never turn on (they are CUDA-only), so both modes are the same there.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from mlxd import blas

blas.load()

import mlx.core as mx  # noqa: E402

from engine.api import Request, SamplingParams  # noqa: E402
from engine.core import Engine, EngineConfig  # noqa: E402
from engine.loader import load_model  # noqa: E402
from engine.scheduler import SchedulerConfig  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _engine(lm, stable: bool) -> tuple[Engine, float]:
    import os

    os.environ["MLXD_STABLE_SHAPES"] = "1" if stable else "0"  # opt-in (CUDA only)
    t0 = time.perf_counter()
    eng = Engine(lm, EngineConfig(SchedulerConfig(), prefix_cache_bytes=0))
    build = time.perf_counter() - t0
    eng.start()
    return eng, build


def _ttft(eng: Engine, prompt: list[int]) -> float:
    import threading

    first: list[float] = []
    done = threading.Event()
    t0 = time.perf_counter()

    def sink(events):
        for ev in events:
            if ev.token_ids and not first:
                first.append(time.perf_counter() - t0)
            if ev.finish_reason is not None:
                done.set()

    eng.add(Request(f"p{random.random()}", prompt, SamplingParams(temperature=0.0, max_tokens=4,
                                                                  ignore_eos=True)), sink)
    assert done.wait(600)
    return first[0]


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=str(REPO / "mlxd" / "models" / "tinycoder-16m"))
    p.add_argument("--dtype", default="auto")
    p.add_argument("--requests", type=int, default=24, help="per mode and round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-len", type=int, default=1500)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "prefill-shapes"))
    a = p.parse_args(argv)
    lm = load_model(a.model, dtype=a.dtype)
    rng = random.Random(0)
    buckets = {1 << i for i in range(4, 16)}
    vocab = lm.vocab_size
    result = {"model": Path(a.model).name, "device": str(mx.default_device()), "dtype": lm.dtype,
              "modes": {"plain": {"ttft_s": [], "lengths": [], "startup_s": []},
                        "stable": {"ttft_s": [], "lengths": [], "startup_s": []}}}
    for rnd in range(a.rounds):
        for mode in ("plain", "stable") if rnd % 2 == 0 else ("stable", "plain"):
            eng, build = _engine(lm, mode == "stable")
            rec = result["modes"][mode]
            rec["startup_s"].append(round(build, 3))
            try:
                for _ in range(a.requests):
                    n = rng.randrange(8, a.max_len)
                    while n - 1 in buckets:
                        n += 1
                    prompt = [rng.randrange(3, vocab) for _ in range(n)]
                    rec["ttft_s"].append(round(_ttft(eng, prompt), 5))
                    rec["lengths"].append(n)
            finally:
                eng.stop()
            print(f"round {rnd} {mode:6s} median TTFT {statistics.median(rec['ttft_s'][-a.requests:]) * 1e3:8.1f} ms"
                  f"  engine start {build:.2f} s", flush=True)
    for mode, rec in result["modes"].items():
        t = sorted(rec["ttft_s"])
        rec["median_ms"] = round(statistics.median(t) * 1e3, 2)
        rec["p90_ms"] = round(t[int(0.9 * (len(t) - 1))] * 1e3, 2)
    result["ratio_median_stable_vs_plain"] = round(
        result["modes"]["stable"]["median_ms"] / result["modes"]["plain"]["median_ms"], 3)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefill_shapes.json").write_text(json.dumps(result, indent=1))
    _plot(result, out / "prefill_shapes.png")
    print(json.dumps({m: {k: r[k] for k in ("median_ms", "p90_ms", "startup_s")}
                      for m, r in result["modes"].items()}))
    print(f"wrote {out}/prefill_shapes.json and .png")
    return 0


def _plot(result, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, color in (("plain", "#d62728"), ("stable", "#1f77b4")):
        rec = result["modes"][mode]
        ax.scatter(rec["lengths"], [t * 1e3 for t in rec["ttft_s"]], s=12, color=color,
                   label=f"{mode} (median {rec['median_ms']} ms)")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT (ms)")
    ax.set_yscale("log")
    ax.set_title(f"TTFT, one request at a time, new prompt lengths ({result['device']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
