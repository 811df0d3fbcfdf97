"""Host work of a speculative round vs a plain step (a script, not a test).

    python -m bench.spec_round_host [--skeleton] [--rows 1,4] [--tokens 160] [--out FILE]

The engine is driven synchronously on this thread (no engine thread, no sinks' latency): the
same greedy requests through a plain engine and through engines with speculation forced on
(`adaptive=False`, so every step is a round at the ceiling): `oracle-k8` (the n-gram drafter's
host path with drafts from the plain run's output, one wrong draft at index 3: width-9 rounds
emitting 4 tokens, the edit workload's ~3.9), `ngram-k8` (real lookups; a random skeleton
model copies little, so mostly width 2), `draft-k1`, `draft-k2`, `draft-k4`.
Per mode: the median wall time of a plain step / a speculative round (with `--skeleton` the
models' architectures at tiny widths, so wall time ~ host work, what a GPU sees for a
launch-bound model), and Python calls per step / round (cProfile, a separate pass: the
profiler's own cost is not in the wall times).
"""

from __future__ import annotations

import engine  # noqa: F401  (BLAS before mlx)

# isort: split

import argparse
import cProfile
import json
import statistics
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from engine.api import Request, SamplingParams
from engine.core import Engine, EngineConfig
from engine.loader import load_model
from engine.scheduler import SchedulerConfig
from engine.spec import SpecConfig
from engine.spec.base import Proposal, ProposeContext, register_drafter
from engine.spec.ngram import NGramDrafter
from mlxd import DEFAULT_MODEL_DIR

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"


@register_drafter("oracle")
class OracleDrafter(NGramDrafter):
    """n-gram's host path with proposals from a reference greedy output (`refs`: prompt +
    output per row): every draft right except the one at index `miss` (a round then accepts
    `miss` drafts and emits miss + 1 tokens: 4 at miss = 3, the edit workload's ~3.9), so the
    widths and acceptance of a copy-heavy workload are reproduced on models that copy nothing."""

    name = "oracle"

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.refs: list[list[int]] = []
        self.miss = 3

    def _find(self, ctx: list[int], k: int) -> list[int]:
        n = len(ctx)
        for ref in self.refs:
            if len(ref) > n and ref[:n] == ctx:
                out = ref[n : n + k]
                if len(out) > self.miss:
                    out[self.miss] = (out[self.miss] + 1) % 7
                return out
        return []

    def propose(self, ctx: ProposeContext) -> Proposal:
        K, B = ctx.max_drafts, len(ctx.contexts)
        drafts = np.zeros((B, K), np.int32)
        num = np.zeros(B, np.int64)
        for b in np.flatnonzero(ctx.num_drafts > 0):
            found = self._find(ctx.contexts[b], int(ctx.num_drafts[b]))
            drafts[b, : len(found)] = found
            num[b] = len(found)
        return Proposal(tokens=mx.array(drafts), num_drafts=num, host_tokens=drafts)

    def available(self, ctx: ProposeContext) -> np.ndarray:
        num = np.zeros(len(ctx.contexts), np.int64)
        for b in np.flatnonzero(ctx.num_drafts > 0):
            num[b] = len(self._find(ctx.contexts[b], int(ctx.num_drafts[b])))
        return num


WARMUP: bool | None = None  # SpecConfig.warmup (--warmup: auto = on a GPU only)


def _engine(lm: Any, draft: Any, mode: str, rows: int, refs: Any = None) -> Engine:
    spec = None
    if mode != "plain":
        method, k = mode.split("-k")
        kw = {} if WARMUP is None else {"warmup": WARMUP}  # (a tree before session 4: none)
        spec = SpecConfig(method=method, draft_model=draft if method == "draft" else None,
                          num_draft_tokens=int(k), adaptive=False, **kw)
    eng = Engine(lm, EngineConfig(SchedulerConfig(max_num_seqs=max(rows, 1)),
                                  prefix_cache_bytes=0, spec=spec))
    if eng.spec is not None and isinstance(eng.spec.drafter, OracleDrafter):
        eng.spec.drafter.refs = refs or []
    return eng


def _variant(new: bool) -> None:
    """Session 4's ring commit and host verdict on (new) or off (the previous paths)."""
    from engine.spec import decoder, ringcommit

    ringcommit.APPEND = decoder.HOST_VERDICT = new


def run(lm: Any, draft: Any, mode: str, prompts: list[list[int]], tokens: int,
        profile: bool = False, refs: Any = None, ab: bool = False) -> dict[str, Any]:
    """Decode every prompt to `tokens` tokens together; per-step wall time (or calls). With
    `ab`, the rounds alternate between session 4's paths and the previous ones (`_variant`),
    so both see the same machine load: `us_per_round_ab` = [new, old]."""
    eng = _engine(lm, draft, mode, len(prompts), refs)
    ab_us: dict[bool, list[float]] = {True: [], False: []}
    ab_calls: dict[bool, list[float]] = {True: [], False: []}
    flip, block = False, -1
    out: dict[str, list[int]] = {}

    def sink(events: list[Any]) -> None:
        for ev in events:
            out.setdefault(ev.req_id, []).extend(ev.token_ids)

    for i, p in enumerate(prompts):
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        eng.add(Request(f"r{i}", list(p), params), sink)
    plain: list[float] = []
    spec: list[float] = []
    plain_cpu: list[float] = []  # this thread's CPU time (less sensitive to other processes)
    spec_cpu: list[float] = []
    widths: list[int] = []
    eng._drain_inbox()
    while eng._has_work():
        n0 = len(eng.scheduler.running)
        prefill = eng.scheduler.prefill is not None or len(eng.scheduler.waiting) > 0
        spec_steps = eng.spec.totals.spec_steps if eng.spec is not None else 0
        if ab:  # blocks of two rounds per variant; the second of each is timed (the first
            block += 1  # may still wait for the other variant's ring commit)
            flip = (block // 2) % 2 == 0
            _variant(flip)
        if profile:
            prof = cProfile.Profile()
            prof.enable()
            eng._step()
            prof.disable()
            value = float(sum(e.callcount for e in prof.getstats()))
        else:
            c0, t0 = time.thread_time(), time.perf_counter()
            eng._step()
            value = time.perf_counter() - t0
            cpu = time.thread_time() - c0
        if prefill or n0 != len(prompts):
            continue  # only steady steps of the full batch
        is_spec = eng.spec is not None and eng.spec.totals.spec_steps > spec_steps
        (spec if is_spec else plain).append(value)
        if ab and is_spec and block % 2 == 1:
            (ab_calls if profile else ab_us)[flip].append(value)
        if not profile:
            (spec_cpu if is_spec else plain_cpu).append(cpu)
        if is_spec:
            widths.append(eng.spec.controller._last_width)
    _variant(True)
    stats = eng.stats().spec
    res: dict[str, Any] = {"mode": mode, "rows": len(prompts), "plain_steps": len(plain),
                           "spec_rounds": len(spec)}
    key = "calls" if profile else "us"
    scale = 1.0 if profile else 1e6
    for name, xs in (("plain", plain[2:]), ("round", spec[2:])):
        if xs:
            res[f"{key}_per_{name}"] = round(statistics.median(xs) * scale, 1)
    for name, xs in (("plain", plain_cpu[2:]), ("round", spec_cpu[2:])):
        if xs:
            res[f"cpu_us_per_{name}"] = round(statistics.median(xs) * 1e6, 1)
    if ab and ab_us[True] and ab_us[False]:
        res["us_per_round_ab"] = [round(statistics.median(ab_us[v][1:]) * 1e6, 1)
                                  for v in (True, False)]
    if ab and ab_calls[True] and ab_calls[False]:
        res["calls_per_round_ab"] = [statistics.median(ab_calls[v][1:]) for v in (True, False)]
    if widths:
        res["mean_width"] = round(statistics.mean(widths), 2)
    if spec and not profile:  # an engine's first rounds (MLX-CUDA: per-engine set-up)
        res["first_rounds_ms"] = [round(x * 1e3, 2) for x in spec[:6]]
    if stats:
        ((_, st),) = stats.items()
        res["tokens_per_row_round"] = st.get("tokens_per_row_round")
        res["acceptance"] = st.get("acceptance_rate")
        res["warmup_s"] = st.get("warmup_s")
    res["tokens"] = {k: len(v) for k, v in out.items()}
    res["_out"] = out
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    p.add_argument("--draft-model", default=str(SHARED / "models" / "tinycoder-draft-4m"))
    p.add_argument("--rows", default="1,4")
    p.add_argument("--tokens", type=int, default=160)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", default="plain,oracle-k8,ngram-k8,draft-k1,draft-k2,draft-k4")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--skeleton", action="store_true")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--ab", action="store_true",
                   help="alternate session 4's round paths with the previous ones round by "
                        "round in each speculative run (us_per_round_ab: [new, old])")
    p.add_argument("--warmup", choices=("auto", "on", "off"), default="auto",
                   help="the engines' speculative warm-up (auto: on a GPU only)")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    global WARMUP
    WARMUP = {"auto": None, "on": True, "off": False}[a.warmup]
    if a.skeleton:
        from bench.spec_idle import skeleton

        lm, draft = skeleton(a.model), skeleton(a.draft_model)
    else:
        lm, draft = load_model(a.model, dtype=a.dtype), load_model(a.draft_model, dtype=a.dtype)
    tok = lm.tokenizer
    body = "def add(a, b):\n    return a + b\n\n"
    base = [tok.encode(f"# {i}\n" + body * 4) for i in range(8)]
    modes = [m for m in a.modes.split(",") if m]
    results: list[dict[str, Any]] = []
    for rows in [int(r) for r in a.rows.split(",")]:
        prompts = base[:rows]
        plain = run(lm, draft, "plain", prompts, a.tokens)["_out"]
        refs = [list(p) + plain[f"r{i}"] for i, p in enumerate(prompts)]
        for mode in modes:  # warm-up
            run(lm, draft, mode, prompts, 24, refs=refs)
        ref = None
        for mode in modes:
            walls = [run(lm, draft, mode, prompts, a.tokens, refs=refs, ab=a.ab)
                     for _ in range(a.repeats)]
            res = dict(walls[0])
            if a.ab and all("us_per_round_ab" in w for w in walls):
                res["us_per_round_ab"] = [
                    round(statistics.median(w["us_per_round_ab"][i] for w in walls), 1)
                    for i in (0, 1)]
                res["ab_new_over_old"] = round(statistics.median(
                    w["us_per_round_ab"][0] / w["us_per_round_ab"][1] for w in walls), 3)
            for key in ("us_per_plain", "us_per_round", "cpu_us_per_plain", "cpu_us_per_round"):
                vals = [w[key] for w in walls if key in w]
                if vals:
                    res[key] = round(statistics.median(vals), 1)
            res["first_rounds_ms"] = [w.get("first_rounds_ms") for w in walls]
            if not a.no_profile:
                prof = run(lm, draft, mode, prompts, a.tokens, profile=True, refs=refs,
                           ab=a.ab)
                for key in ("calls_per_plain", "calls_per_round", "calls_per_round_ab"):
                    if key in prof:
                        res[key] = prof[key]
            out = res.pop("_out")
            if ref is None:
                ref = out
            res["exact_vs_first"] = out == ref
            results.append(res)
            print(json.dumps(res), flush=True)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"args": vars(a), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
