"""Where a decode step's time goes: host graph building vs device work, per model and width,
and what one raw speculative round costs against a plain step.

    python -m bench.step_costs --model DIR [--draft-model DIR] [--dtype bfloat16] [--out FILE]

Rows, each the median of `--steps` samples after a warm-up (MLX-CUDA JIT, cuDNN graphs):
  * `step` (per model, batch, width): with the engine's own KV layouts (`--cache engine`, the
    default: the keys of a multi-token forward widened as the engine does on CUDA) or mlx-lm's
    KVCache (`--cache mlx-lm`): a synchronous step (build + eval), the host time to build the
    graph alone, and a pipelined step (async_eval of step t+1 before reading step t);
  * `round` (with a draft model, per batch and draft length k): k greedy draft steps chained on
    the device (argmax, no host sync; `async_eval` after each so the device starts while the
    next is built) and the target's verify forward over the k + 1 columns, read once: the raw
    cost of a speculative round with no engine bookkeeping. `tokens_to_pay` = round / plain
    pipelined step: the tokens a round must yield to break even (acceptance alpha yields
    (1 - alpha^(k+1)) / (1 - alpha)); `alpha_for_1x` / `alpha_for_1.5x` solve for alpha.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from mlxd import blas

blas.load()  # OpenBLAS before mlx on Linux (a no-op elsewhere)

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402


def _load(path, dtype):
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(path))
    if dtype != "auto":
        model.set_dtype(getattr(mx, dtype))
    mx.eval(model.parameters())
    return model


EVAL_EVERY = [0]  # --eval-every: evaluation points in multi-token forwards (0: none)


class _Cache:
    """A batch of rows with `prompt_len` tokens, and a per-step rollback to that length."""

    def __init__(self, model, batch, prompt_len, kind):
        self.kind = kind
        prompt = mx.random.randint(0, 1000, (batch, prompt_len))
        if kind == "mlx-lm":
            from mlx_lm.models.cache import make_prompt_cache

            self.layers = make_prompt_cache(model)
            mx.eval(model(prompt, cache=self.layers))
        else:
            from engine.kv import batch as kvb
            from engine.models import make_batch_layouts, prepare_model

            prepare_model(model)
            self.layers = make_batch_layouts(model, batch, max_draft=8)
            kvb.prepare(self.layers, lengths=[prompt_len] * batch)
            model(prompt, cache=self.layers)
            kvb.finalize(self.layers)
            kvb.eval_state(self.layers)
        self.batch = batch

    def view(self, width):
        """What to pass as `cache=` for a forward of `width` tokens per row (with
        `EVAL_EVERY[0]`, the verify forward's evaluation points: engine/spec/evalpoints.py)."""
        if self.kind == "engine" and width > 1:
            from engine.spec.evalpoints import eval_points
            from engine.spec.widekv import wide

            return eval_points(wide(self.layers), EVAL_EVERY[0])
        return self.layers

    def begin(self):
        if self.kind == "engine":
            from engine.kv import batch as kvb

            kvb.checkpoint(self.layers)

    def end(self, width):
        """Back to the length before the step (a round that accepted nothing keeps its input
        column; here the lengths stay put so every sample sees the same shapes)."""
        if self.kind == "engine":
            from engine.kv import batch as kvb

            kvb.rollback(self.layers, np.zeros(self.batch, np.int64))
        else:
            for c in self.layers:
                c.trim(width)


def graph_nodes(model, batch, width, kind, prompt_len=64):
    """Primitive counts of one step's graph (mx.export_to_dot): what MLX encodes per step.
    The host cost of evaluating a graph grows with its node count (a few µs a node on CUDA)."""
    import collections
    import re
    import tempfile

    cache = _Cache(model, batch, prompt_len, kind)
    cache.begin()
    out = model(mx.zeros((batch, width), dtype=mx.int32), cache=cache.view(width))
    nxt = mx.argmax(out[:, -1, :], axis=-1)
    state = [a for layer in cache.layers for a in (getattr(layer, "state", None) or [])
             if isinstance(a, mx.array)]
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as fh:
        mx.export_to_dot(fh.name, nxt, *state)
        ops = re.findall(r'label ="?([A-Za-z]+)', fh.read())
    mx.eval(nxt, *state)
    return collections.Counter(ops)


def measure(model, batch, width, steps, kind, prompt_len=64):
    cache = _Cache(model, batch, prompt_len, kind)
    tok = mx.zeros((batch, width), dtype=mx.int32)

    def one():
        cache.begin()
        out = model(tok, cache=cache.view(width))
        return mx.argmax(out[:, -1, :], axis=-1)

    for _ in range(5):  # warm-up (JIT, graph caches)
        mx.eval(one())
        cache.end(width)
    sync, build = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        nxt = one()
        t1 = time.perf_counter()
        mx.eval(nxt)
        t2 = time.perf_counter()
        build.append(t1 - t0)
        sync.append(t2 - t0)
        cache.end(width)
    t0 = time.perf_counter()
    prev = None
    for _ in range(steps):  # pipelined: step t+1 queued before step t is read
        nxt = one()
        mx.async_eval(nxt)
        if prev is not None:
            prev.tolist()
        prev = nxt
        cache.end(width)
    mx.eval(prev)
    piped = (time.perf_counter() - t0) / steps
    return {"kind": "step", "batch": batch, "width": width, "sync_ms": _ms(sync),
            "build_ms": _ms(build), "pipelined_ms": round(piped * 1e3, 3)}


def measure_ab(model, batch, width, steps, kind, chunks=3, what="guard", eval_every=2):
    """`measure` with `what` (engine.cuda_guard, engine.fewrow on `model`, or "eval": evaluation
    points every `eval_every` layers) off and on, alternating in `chunks` chunks of
    steps // chunks samples each; the medians of the chunks' medians."""
    from engine import cuda_guard, fewrow

    def switch(on: bool) -> None:
        if what == "eval":
            EVAL_EVERY[0] = eval_every if on else 0
        elif what == "guard":
            cuda_guard.uninstall()
            if on:
                cuda_guard.install(force=True)
        else:
            fewrow.uninstall(model)
            if on:
                fewrow.install(model, force=True)

    out = {"off": [], "on": []}
    for _ in range(chunks):
        for mode in ("off", "on"):
            switch(mode == "on")
            try:
                out[mode].append(measure(model, batch, width, max(steps // chunks, 3), kind))
            finally:
                switch(False)
    r = {"kind": f"step_ab_{what}", "batch": batch, "width": width}
    for mode, rows in out.items():
        for key in ("sync_ms", "build_ms", "pipelined_ms"):
            vals = sorted(x[key] for x in rows)
            r[f"{key}_{mode}"] = vals[len(vals) // 2]
    r["sync_on_over_off"] = round(r["sync_ms_on"] / r["sync_ms_off"], 3)
    r["pipelined_on_over_off"] = round(r["pipelined_ms_on"] / r["pipelined_ms_off"], 3)
    return r


def measure_round(target, draft, batch, k, steps, kind, prompt_len=64):
    """k chained greedy draft steps + one verify forward, one host read per round."""
    tc = _Cache(target, batch, prompt_len, kind)
    dc = _Cache(draft, batch, prompt_len, kind)
    tok = mx.zeros((batch, 1), dtype=mx.int32)

    def one():
        dc.begin()
        x, drafts = tok, []
        for _ in range(k):
            x = mx.argmax(draft(x, cache=dc.view(1))[:, -1, :], axis=-1)[:, None].astype(mx.int32)
            mx.async_eval(x)
            drafts.append(x)
        tc.begin()
        out = target(mx.concatenate([tok, *drafts], axis=1), cache=tc.view(k + 1))
        verdict = mx.argmax(out, axis=-1)
        verdict.tolist()
        tc.end(k + 1)
        dc.end(k)

    for _ in range(5):
        one()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        one()
        times.append(time.perf_counter() - t0)
    return {"kind": "round", "batch": batch, "k": k, "round_ms": _ms(times)}


def _ms(xs):
    return round(sorted(xs)[len(xs) // 2] * 1e3, 3)


def _alpha_for(tokens, k):
    """The acceptance at which (1 - a^(k+1)) / (1 - a) reaches `tokens` (None: beyond k + 1)."""
    if tokens > k + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(50):
        a = (lo + hi) / 2
        e = sum(a**i for i in range(k + 1))
        lo, hi = (a, hi) if e < tokens else (lo, a)
    return round(lo, 3)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--draft-model")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--cache", choices=("engine", "mlx-lm"), default="engine")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--widths", default="1,2,3,5")
    p.add_argument("--skinny", choices=("auto", "on", "off"), default="auto",
                   help="engine.skinny few-row kernel dispatch (auto: MLXD_SKINNY=1 on CUDA; on: forced; off: never)")
    p.add_argument("--guard", choices=("auto", "on", "off", "ab"), default="auto",
                   help="engine.cuda_guard (RoPE over many rows, plain attention over 2..16 queries) "
                        "as the engine installs it (auto: MLX-CUDA only; on: forced; off: never; "
                        "ab: each step row measured with the guard off and forced on, alternating "
                        "in 3 chunks each, so machine drift hits both alike)")
    p.add_argument("--fewrow", choices=("auto", "on", "off", "ab"), default="off",
                   help="engine.fewrow (3..16-row matmuls as one gathered gemv) on the models: auto as the "
                        "engine's loader installs it (CUDA), on: forced, off: never (default, the raw "
                        "models), ab: each step row with it off and on, alternating in one process")
    p.add_argument("--eval-every", default="0",
                   help="evaluation points in the multi-token (verify) forwards every N layers "
                        "(engine/spec/evalpoints.py): N, or abN to alternate off and N in one process")
    p.add_argument("--nodes", action="store_true",
                   help="also count the primitives of one step's graph per (model, batch, width)")
    p.add_argument("--out")
    a = p.parse_args(argv)
    eval_ab = a.eval_every.startswith("ab")
    eval_n = int(a.eval_every[2:] or 2) if eval_ab else int(a.eval_every)
    EVAL_EVERY[0] = 0 if eval_ab else eval_n
    res = {"device": str(mx.default_device()), "cache": a.cache, "skinny": a.skinny,
           "eval_every": a.eval_every, "rows": []}
    if a.guard not in ("off", "ab"):
        from engine import cuda_guard

        res["guard"] = cuda_guard.install(force=a.guard == "on")
        res["sdpa_plain_max"] = cuda_guard.PLAIN_MAX
    batches = [int(x) for x in a.batches.split(",")]
    widths = [int(x) for x in a.widths.split(",")]
    models = {}
    for name, path in (("target", a.model), ("draft", a.draft_model)):
        if not path:
            continue
        m = models[name] = _load(path, a.dtype)
        if a.fewrow in ("auto", "on"):
            from engine import fewrow

            res.setdefault("fewrow_modules", {})[name] = fewrow.install(m, force=a.fewrow == "on")
        if a.skinny != "off":
            from engine import skinny

            res.setdefault("skinny_modules", {})[name] = skinny.install(m, force=a.skinny == "on")
        for b in batches:
            for w in widths:
                if a.guard == "ab" or a.fewrow == "ab" or (eval_ab and w > 1):
                    what = "guard" if a.guard == "ab" else "fewrow" if a.fewrow == "ab" else "eval"
                    r = dict(measure_ab(m, b, w, a.steps, a.cache, what=what, eval_every=eval_n),
                             model=name)
                    print(json.dumps(r), flush=True)
                    res["rows"].append(r)
                    continue
                r = dict(measure(m, b, w, a.steps, a.cache), model=name)
                if a.nodes:
                    cnt = graph_nodes(m, b, w, a.cache)
                    r["nodes"] = sum(cnt.values())
                    r["top_nodes"] = dict(cnt.most_common(12))
                print(json.dumps(r), flush=True)
                res["rows"].append(r)
    if "draft" in models:
        plain = {r["batch"]: r["pipelined_ms"] for r in res["rows"]
                 if r["model"] == "target" and r["width"] == 1}
        for b in batches:
            for w in widths:
                if w < 2:
                    continue
                r = measure_round(models["target"], models["draft"], b, w - 1, a.steps, a.cache)
                if b in plain:
                    need = r["round_ms"] / plain[b]
                    r.update(tokens_to_pay=round(need, 3), alpha_for_1x=_alpha_for(need, w - 1))
                    r["alpha_for_1.5x"] = _alpha_for(1.5 * need, w - 1)
                print(json.dumps(r), flush=True)
                res["rows"].append(r)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
