"""Cost of constrained decoding in the engine: per-token time at batch 1 and 16, constrained vs
free, and aggregate throughput with half the rows constrained and with every row under strict
tools.

Every row decodes exactly `--tokens` tokens (ignore_eos; the JSON grammar is an array of at least
1,000 records, so it never completes early; the strict-tools rows are asked for prose and stay in
the free text before a call), from the same chat prompt, at temperature 1 with
fixed seeds. Per-token time = (last token time - first token time) / (tokens - 1), averaged over
the rows; aggregate throughput = all tokens / (last token - first token of the batch). Each case
is measured `--repeats` times; each ratio comes from pairs (constrained, free) run back to back
in random order, so both sides of a pair see the same load on a shared machine, and the median of
the paired ratios is reported (with min and max).

    python -m bench constrained [--tokens 96] [--repeats 3]     # DIR/constrained.{json,png}
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench import common
from server.tools import HERMES

if TYPE_CHECKING:
    from engine.api import TokenEvent
    from engine.core import Engine

RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "id": {"type": "integer", "minimum": 0},
        "language": {"enum": ["python", "rust", "go", "c"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "id", "language", "tags", "ok"],
    "additionalProperties": False,
}
SCHEMA = {"type": "array", "items": RECORD, "minItems": 1000}
PROMPT = "<|im_start|>user\nList the functions of this project as JSON records.<|im_end|>\n<|im_start|>assistant\n"


GRAMMAR_S = [0.0]  # time spent in the grammar engine (mask fill + consume), summed


@contextmanager
def timed_grammar() -> Iterator[None]:
    """Time the two grammar calls the engine makes per step (into GRAMMAR_S), restoring them
    on exit."""
    from engine import constrain
    from engine.constrain import llg

    def timed(fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                GRAMMAR_S[0] += time.perf_counter() - t0
        return wrapper

    fill, consume = constrain.fill_masks, llg.LLGConstraint.consume
    constrain.fill_masks = timed(fill)
    llg.LLGConstraint.consume = timed(consume)  # type: ignore[method-assign]
    try:
        yield
    finally:
        constrain.fill_masks = fill
        llg.LLGConstraint.consume = consume  # type: ignore[method-assign]


def run_batch(eng: Engine, prompt: list[int], batch: int, constrained: list[dict[str, Any] | None],
              tokens: int, no_eos: dict[int, float] | None = None) -> dict[str, Any]:
    """One batch; rows under a grammar get `constraint` from `constrained`, and strict-tools rows
    the `no_eos` logit bias (with ignore_eos a grammar still ends where the model draws the end of
    sequence, which prose allows anywhere)."""
    from engine.api import Request, SamplingParams

    GRAMMAR_S[0] = 0.0
    times: dict[str, list[float]] = {}
    done = threading.Event()
    remaining = [batch]
    lock = threading.Lock()

    ends: dict[str, tuple[str, str | None]] = {}

    def sink(events: list[TokenEvent]) -> None:
        now = time.perf_counter()
        for ev in events:
            if ev.token_ids:
                times.setdefault(ev.req_id, []).extend([now] * len(ev.token_ids))
            if ev.finish_reason is not None:
                ends[ev.req_id] = (ev.finish_reason, ev.error)
                with lock:
                    remaining[0] -= 1
                    if remaining[0] == 0:
                        done.set()

    for i in range(batch):
        params = SamplingParams(temperature=1.0, seed=1000 + i, max_tokens=tokens, ignore_eos=True,
                                constraint=constrained[i],
                                logit_bias=(no_eos or {}) if constrained[i] is TOOLS else {})
        eng.add(Request(f"b{batch}-{i}-{time.monotonic_ns()}", list(prompt), params), sink)
    assert done.wait(600), "batch did not finish"
    per_token = {k: (v[-1] - v[0]) / (len(v) - 1) for k, v in times.items()}
    short = {k: (len(v), ends.get(k)) for k, v in times.items() if len(v) != tokens}
    assert not short, f"rows stopped early (tokens, finish, error): {short}"
    keys = sorted(times)
    first = min(times[k][0] for k in keys)
    last = max(times[k][-1] for k in keys)
    con_keys = [k for k in keys if constrained[int(k.split("-")[1])] is not None]
    free_keys = [k for k in keys if constrained[int(k.split("-")[1])] is None]
    return {
        "per_token_ms": statistics.fmean(per_token.values()) * 1e3,
        "per_token_ms_constrained_rows": statistics.fmean(per_token[k] for k in con_keys) * 1e3 if con_keys else None,
        "per_token_ms_free_rows": statistics.fmean(per_token[k] for k in free_keys) * 1e3 if free_keys else None,
        "aggregate_tok_s": batch * (tokens - 1) / (last - first),
        "grammar_ms_per_step": GRAMMAR_S[0] * 1e3 / tokens,  # mask fill + consume, all rows
    }


JSON = {"type": "json_schema", "schema": SCHEMA}
# strict tools (`strict: true`): free text unless the answer opens a call. The calls open with a
# marker the model never writes here, so every row stays in the free text (where the mask holds
# still) for all its tokens, as an answer in prose does
TOOLS = dataclasses.replace(HERMES, start_markers=("[[calls]]",), call_open="[[calls]]\n").constraint(
    [{"name": "list_functions", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}],
    parallel=True, lazy=True)
CASES: dict[str, tuple[int, list[dict[str, Any] | None]]] = {
    "b1_free": (1, [None]),
    "b1_constrained": (1, [JSON]),
    "b16_free": (16, [None] * 16),
    "b16_constrained": (16, [JSON] * 16),
    "b16_half": (16, [JSON if i % 2 == 0 else None for i in range(16)]),
    "b16_tools": (16, [TOOLS] * 16),
}
# each ratio is measured in pairs run back to back (in random order), so that both sides of a
# pair see the same load on a shared machine; the median of the paired ratios is reported
PAIRS = {
    "b1_constrained_over_free_per_token": ("b1_constrained", "b1_free", "per_token_ms"),
    "b16_constrained_over_free_per_token": ("b16_constrained", "b16_free", "per_token_ms"),
    "b16_half_over_free_throughput": ("b16_half", "b16_free", "aggregate_tok_s"),
    "b16_tools_over_free_throughput": ("b16_tools", "b16_free", "aggregate_tok_s"),
}


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("constrained", help="the cost of grammar-constrained decoding",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="default: the bundled tinycoder-16m")
    p.add_argument("--tokens", type=int, default=96, help="tokens each row decodes")
    p.add_argument("--repeats", type=int, default=3, help="pairs per ratio")
    p.add_argument("--dtype", default="auto")
    common.add_out_arg(p)
    p.set_defaults(func=cmd_constrained)


def cmd_constrained(args: argparse.Namespace) -> int:
    import engine  # noqa: F401  (BLAS before mlx)
    from engine.core import Engine, EngineConfig
    from engine.loader import load_model
    from engine.scheduler import SchedulerConfig

    out = common.out_dir(args, "constrained")
    lm = load_model(str(args.model or common.default_model()), dtype=args.dtype)
    eng = Engine.spawn(lm, EngineConfig(SchedulerConfig()))  # built on its loop's thread
    prompt = lm.tokenizer.encode(PROMPT, add_special_tokens=False)
    try:
        with timed_grammar():
            no_eos = {int(t): -100.0 for t in lm.eos_token_ids}
            raw, paired = _measure(eng, prompt, args.repeats, args.tokens, no_eos)
    finally:
        eng.stop()
    result = {"model": lm.model_id, "dtype": lm.dtype, "tokens_per_row": args.tokens,
              "repeats": args.repeats, "schema": SCHEMA, "summary_median": _medians(raw),
              "ratios_paired_median": {k: statistics.median(v) for k, v in paired.items()},
              "ratios_paired_min_max": {k: [min(v), max(v)] for k, v in paired.items()},
              "ratios_paired_all": paired, "raw": raw}
    path = common.write_json(out / "constrained.json", "constrained", result, args)
    for name, s in result["summary_median"].items():
        print(f"{name:16s} per-token {s['per_token_ms']:7.2f} ms   aggregate "
              f"{s['aggregate_tok_s']:8.1f} tok/s   grammar {s['grammar_ms_per_step']:.2f} ms/step")
    for k, v in result["ratios_paired_median"].items():
        lo, hi = result["ratios_paired_min_max"][k]
        print(f"{k}: paired median {v:.3f}  (min {lo:.3f}, max {hi:.3f})")
    plot(result, path.with_suffix(".png"))
    print(f"wrote {path}")
    return 0


def _measure(eng: Engine, prompt: list[int], repeats: int, tokens: int,
             no_eos: dict[int, float]) -> tuple[dict[str, list[dict[str, Any]]], dict[str, list[float]]]:
    """Every case's runs, and each ratio's paired values."""
    rng = random.Random(0)
    raw: dict[str, list[dict[str, Any]]] = {name: [] for name in CASES}
    paired: dict[str, list[float]] = {name: [] for name in PAIRS}
    run_batch(eng, prompt, 4, [JSON, None, TOOLS, None], 16, no_eos)  # warm-up: compile, tables
    for _ in range(repeats):
        for ratio, (a, b, key) in PAIRS.items():
            order = [a, b] if rng.random() < 0.5 else [b, a]
            got = {name: run_batch(eng, prompt, *CASES[name], tokens, no_eos) for name in order}
            for name, r in got.items():
                raw[name].append(r)
            paired[ratio].append(got[a][key] / got[b][key])
    return raw, paired


def _medians(raw: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float | None]]:
    """Per case, the median of each figure over the repeats (None where no run had it)."""
    out: dict[str, dict[str, float | None]] = {}
    for name, runs in raw.items():
        out[name] = {}
        for k in runs[0]:
            vals = [r[k] for r in runs if r[k] is not None]
            out[name][k] = statistics.median(vals) if vals else None
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    summary, ratios = result["summary_median"], result["ratios_paired_median"]
    plt = common.pyplot()

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    names = ["b1_free", "b1_constrained", "b16_free", "b16_constrained", "b16_half", "b16_tools"]
    colors = ["C0", "C1", "C0", "C1", "C2", "C3"]
    bars = a.bar(names, [summary[n]["per_token_ms"] for n in names], color=colors)
    for bar, n in zip(bars, names, strict=True):
        g = summary[n]["grammar_ms_per_step"]
        if g:
            a.annotate(f"grammar {g:.1f} ms", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                       ha="center", va="bottom", fontsize=8)
    a.set_ylabel("ms per token (per row)")
    a.set_title("per-token decode time (medians; shared machine)")
    a.tick_params(axis="x", rotation=20)
    b16 = ("b16_free", "b16_half", "b16_constrained", "b16_tools")
    b.bar(b16, [summary[n]["aggregate_tok_s"] for n in b16], color=["C0", "C2", "C1", "C3"])
    b.set_ylabel("aggregate tok/s")
    b.set_title("batch 16 throughput (half: 8 of 16 rows JSON; tools: strict tools, prose)")
    fig.suptitle("constrained / free (paired medians): b1 x{:.2f}, b16 x{:.2f} per token; throughput "
                 "half x{:.2f}, tools x{:.2f}".format(
                     ratios["b1_constrained_over_free_per_token"],
                     ratios["b16_constrained_over_free_per_token"],
                     ratios["b16_half_over_free_throughput"], ratios["b16_tools_over_free_throughput"]))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
