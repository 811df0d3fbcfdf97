"""Where a decode step's time goes: host graph building vs device work, per model and width.

    python -m bench.step_costs --model DIR [--draft-model DIR] [--dtype bfloat16] [--out FILE]

For each model and (batch, width) it times, with mlx-lm's plain KV cache: a synchronous step
(build + eval), the host time to build the graph alone, and a pipelined step (async_eval of
step t+1 before reading step t). Speculative decoding pays only where the draft's steps are
cheap relative to the target's verify step; this says whether they are on a given machine.
"""

from __future__ import annotations

import argparse
import json
import time

from mlxd import blas

blas.load()  # OpenBLAS before mlx on Linux (a no-op elsewhere)

import mlx.core as mx  # noqa: E402


def _load(path, dtype):
    from mlx_lm.utils import load_model

    model, _ = load_model(__import__("pathlib").Path(path))
    if dtype != "auto":
        model.set_dtype(getattr(mx, dtype))
    mx.eval(model.parameters())
    return model


def _cache(model):
    from mlx_lm.models.cache import make_prompt_cache

    return make_prompt_cache(model)


def measure(model, batch, width, steps, prompt_len=64):
    cache = _cache(model)
    prompt = mx.random.randint(0, 1000, (batch, prompt_len))
    mx.eval(model(prompt, cache=cache))
    tok = mx.zeros((batch, width), dtype=mx.int32)
    # warm-up (JIT, graph caches)
    for _ in range(5):
        out = model(tok, cache=cache)
        mx.eval(out)
        for c in cache:
            if width > 1:
                c.trim(width - 1)
    sync, build = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = model(tok, cache=cache)
        nxt = mx.argmax(out[:, -1, :], axis=-1)
        t1 = time.perf_counter()
        mx.eval(nxt)
        t2 = time.perf_counter()
        build.append(t1 - t0)
        sync.append(t2 - t0)
        if width > 1:
            for c in cache:
                c.trim(width - 1)
    # pipelined (width 1 only makes sense; run for every width as a lower bound)
    t0 = time.perf_counter()
    prev = None
    for _ in range(steps):
        out = model(tok, cache=cache)
        nxt = mx.argmax(out[:, -1, :], axis=-1)
        mx.async_eval(nxt)
        if prev is not None:
            prev.item() if batch == 1 else prev.tolist()
        prev = nxt
        if width > 1:
            for c in cache:
                c.trim(width - 1)
    mx.eval(prev)
    piped = (time.perf_counter() - t0) / steps
    med = lambda xs: sorted(xs)[len(xs) // 2] * 1e3
    return {"batch": batch, "width": width, "sync_ms": round(med(sync), 3),
            "build_ms": round(med(build), 3), "pipelined_ms": round(piped * 1e3, 3)}


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--draft-model")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--widths", default="1,2,3,5")
    p.add_argument("--out")
    a = p.parse_args(argv)
    res = {"device": str(mx.default_device()), "rows": []}
    for name, path in (("target", a.model), ("draft", a.draft_model)):
        if not path:
            continue
        m = _load(path, a.dtype)
        for b in map(int, a.batches.split(",")):
            for w in map(int, a.widths.split(",")):
                r = measure(m, b, w, a.steps)
                r["model"] = name
                print(json.dumps(r), flush=True)
                res["rows"].append(r)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
