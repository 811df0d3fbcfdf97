"""Where the engine thread's time goes with speculation on (a script, not a test).

    python -m bench.spec_profile [--workload edit|dev] [--concurrency 1] [--modes plain,ngram-k]
                                 [--requests 4] [--out FILE.json]

The bench.spec workloads (same prompts, greedy) through one fresh engine per mode: an untimed
warm-up pass, a timed pass (tokens/s, engine steps, the speculation stats), then a pass with
`Engine._step` under cProfile. Printed and written per mode: ms per engine step, the functions
with the most own time, and the cumulative time of the step's parts (verify forward graph,
device wait, ring commit, drafter, controller, scheduler). On a GPU, where a small model's step
is bound by host work and launches, this says what a speculative round pays beyond its forward.
"""

from __future__ import annotations

import engine  # noqa: F401  (BLAS before mlx)

# isort: split

import argparse
import cProfile
import io
import json
import pstats
from pathlib import Path
from typing import Any

import mlx.core as mx

from bench.spec import MODES, SHARED, _rows, dev_prompts, edit_prompts, run_workload, spec_config
from bench.workload import load_tokenizer
from engine.core import Engine
from engine.loader import load_model
from mlxd import DEFAULT_MODEL_DIR

# the step's parts: (label, file suffix, function name) as cProfile names them
PARTS = [
    ("engine step", "engine/core.py", "_step"),
    ("spec decide", "engine/spec/decoder.py", "decide"),
    ("spec round", "engine/spec/decoder.py", "step"),
    ("drafter propose", "engine/spec/decoder.py", "_propose"),
    ("drafter observe", "engine/spec/ngram.py", "observe"),
    ("ring commit", "engine/spec/ringcommit.py", "finish"),
    ("verdict on host", "engine/spec/accept.py", "greedy_verdict_host"),
    ("record_ragged", "engine/spec/accept.py", "record_ragged"),
    ("controller record", "engine/spec/decoder.py", "record"),
    ("plain launch", "engine/runner.py", "launch_decode"),
    ("plain collect", "engine/runner.py", "collect"),
    ("sample", "engine/sampling.py", "sample"),
    ("scheduler finish", "engine/scheduler.py", "finish_decode_step"),
    ("emit", "engine/core.py", "_emit"),
    ("model forward (graph)", "", "__call__"),
    ("mx.eval (device wait)", "bench/spec_profile.py", "_eval"),
    ("mx.async_eval", "bench/spec_profile.py", "_async_eval"),
    ("np.array (reads)", "", "<built-in method numpy.array>"),
]
# MLX's functions are invisible to cProfile (nanobind): Python wrappers make the waits show
_MX_EVAL, _MX_ASYNC_EVAL = mx.eval, mx.async_eval


def _eval(*a: Any) -> None:
    _MX_EVAL(*a)


def _async_eval(*a: Any) -> None:
    _MX_ASYNC_EVAL(*a)


def _parts(stats: pstats.Stats, steps: int) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for label, suffix, name in PARTS:
        tot = cum = calls = 0.0
        for (fname, _line, fn), (_cc, nc, tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
            if fn != name or (suffix and not fname.endswith(suffix)):
                continue
            if name == "__call__" and "models" not in fname:  # mlx-lm model classes only
                continue
            tot, cum, calls = tot + tt, cum + ct, calls + nc
        if name == "__call__":  # nested module calls: the outermost (Model.__call__) is the max
            cum = max(
                (ct for (fname, _l, fn), (_c, _n, _t, ct, _cl) in stats.stats.items()  # type: ignore[attr-defined]
                 if fn == name and "models" in fname),
                default=0.0,
            )
        if calls:
            out[label] = {
                "ms_per_step_cum": round(cum / steps * 1e3, 4),
                "calls_per_step": round(calls / steps, 3),
            }
    return out


def profile_mode(lm: Any, mode: str, args: argparse.Namespace, draft: Any,
                 prompts: list[tuple[list[int], int]]) -> dict[str, Any]:
    spec = spec_config(mode, args, draft)
    run_workload(lm, spec, prompts[: args.concurrency], args.concurrency, 0.0)  # warm-up
    timed = run_workload(lm, spec_config(mode, args, draft), prompts, args.concurrency, 0.0)
    prof = cProfile.Profile()
    orig = Engine._step

    def step(self: Engine) -> None:
        prof.enable()
        try:
            orig(self)
        finally:
            prof.disable()

    Engine._step = step  # type: ignore[method-assign]
    mx.eval, mx.async_eval = _eval, _async_eval
    try:
        profiled = run_workload(lm, spec_config(mode, args, draft), prompts, args.concurrency, 0.0)
    finally:
        Engine._step = orig  # type: ignore[method-assign]
        mx.eval, mx.async_eval = _MX_EVAL, _MX_ASYNC_EVAL
    steps = max(profiled["engine_steps"], 1)
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    st.sort_stats("tottime").print_stats(args.top)
    top = s.getvalue()
    out = {
        "timed": timed,
        "profiled_tokens_per_s": profiled["tokens_per_s"],
        "steps": steps,
        "wall_ms_per_step": round(timed["wall_s"] / max(timed["engine_steps"], 1) * 1e3, 4),
        "parts": _parts(st, steps),
        "top_tottime": top,
    }
    print(f"== {mode}: {timed['tokens_per_s']:.1f} tok/s ({timed['engine_steps']} steps, "
          f"{out['wall_ms_per_step']:.3f} ms/step unprofiled); profiled {profiled['tokens_per_s']:.1f} tok/s")
    if "spec" in timed:
        sp = timed["spec"]
        print("   spec:", {k: sp.get(k) for k in ("spec_steps", "plain_steps", "acceptance_rate",
                                                   "mean_verify_width", "tokens_per_row_round",
                                                   "step_ms")})
    for label, v in out["parts"].items():
        print(f"   {label:24s} {v['ms_per_step_cum']:8.3f} ms/step  {v['calls_per_step']:7.2f} calls/step")
    print(top[: 6000])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    p.add_argument("--draft-model", default=str(SHARED / "models" / "tinycoder-draft-4m"))
    p.add_argument("--data", default=str(SHARED / "data" / "tinycoder-dev.jsonl"))
    p.add_argument("--dtype", default="auto")
    p.add_argument("--workload", choices=("edit", "dev"), default="edit")
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=256, help="dev workload only")
    p.add_argument("--modes", default="plain,ngram-k,ngram")
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--ngram-draft-tokens", type=int, default=8)
    p.add_argument("--top", type=int, default=35)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    lm = load_model(args.model, dtype=args.dtype)
    modes = args.modes.split(",")
    draft = None
    if any(MODES[m] is not None and MODES[m][0] == "draft" for m in modes):
        draft = load_model(args.draft_model, dtype=args.dtype)
    tok = load_tokenizer(args.model)
    rows = _rows(Path(args.data))
    if args.workload == "edit":
        prompts = edit_prompts(rows, tok, args.requests)
    else:
        prompts = [(ids, args.max_tokens) for ids in dev_prompts(rows, tok, args.requests)]
    result = {"args": vars(args), "modes": {m: profile_mode(lm, m, args, draft, prompts) for m in modes}}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
