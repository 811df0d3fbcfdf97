"""Where the engine thread's time goes during decode (cProfile of `Engine._step`).

    python -m bench.engine_profile [--model DIR] [--dtype bfloat16] [--rows 1] [--tokens 300]

Runs `rows` greedy requests of `tokens` tokens at library level after a warm-up request, with
the engine's step method profiled, and prints ms per step, the raw model's pipelined step for
comparison (mlx-lm cache, same batch) and the functions with the most own time. On a GPU, the
gap between the two is the engine's host work per step (scheduler, sampler, bookkeeping).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import threading
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


def _run(eng: Engine, rows: int, tokens: int, tag: str) -> float:
    done = [threading.Event() for _ in range(rows)]
    t0 = time.perf_counter()
    for i in range(rows):
        def sink(events, ev_done=done[i]):
            if any(e.finish_reason is not None for e in events):
                ev_done.set()

        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        eng.add(Request(f"{tag}{i}", [1, 2, 3, 4 + i], params), sink)
    for d in done:
        assert d.wait(600)
    return time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=str(REPO / "mlxd" / "models" / "tinycoder-16m"))
    p.add_argument("--dtype", default="auto")
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--tokens", type=int, default=300)
    p.add_argument("--top", type=int, default=30)
    a = p.parse_args(argv)
    lm = load_model(a.model, dtype=a.dtype)
    eng = Engine(lm, EngineConfig(SchedulerConfig(), prefix_cache_bytes=0))
    prof = cProfile.Profile()
    orig = Engine._step

    def step(self):
        prof.enable()
        try:
            return orig(self)
        finally:
            prof.disable()

    eng.start()
    try:
        _run(eng, a.rows, 32, "warm")
        steps0 = eng.stats().num_steps
        prof = cProfile.Profile()
        Engine._step = step
        dt = _run(eng, a.rows, a.tokens, "r")
        Engine._step = orig
        steps = eng.stats().num_steps - steps0
    finally:
        eng.stop()
    print(f"engine: {a.rows} rows x {a.tokens} tokens in {dt:.3f} s, {steps} steps, "
          f"{dt / max(steps, 1) * 1e3:.3f} ms/step (profiled), {a.rows * a.tokens / dt:.0f} tok/s")
    from mlx_lm.models.cache import make_prompt_cache

    model = lm.model
    cache = make_prompt_cache(model)
    mx.eval(model(mx.zeros((a.rows, 4), dtype=mx.int32), cache=cache))
    tok = mx.zeros((a.rows, 1), dtype=mx.int32)
    for n, label in ((20, None), (a.tokens, "raw model")):
        t0 = time.perf_counter()
        prev = None
        for _ in range(n):
            tok = mx.argmax(model(tok, cache=cache)[:, -1:, :], axis=-1).astype(mx.int32)
            mx.async_eval(tok)
            if prev is not None:
                prev.tolist()
            prev = tok
        mx.eval(tok)
        if label:
            print(f"{label}: {(time.perf_counter() - t0) / n * 1e3:.3f} ms/step pipelined (mlx-lm cache)")
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(a.top)
    print(s.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
