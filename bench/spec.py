"""Speculative decoding benchmark (a script, not a test): the engine with and without
speculation, side by side in one run, on the same prompts.

    python -m bench spec                                    # CPU defaults
    python -m bench spec --out .bench/spec-gpu --max-tokens 256 --requests-per-stream 4

Workloads (prompts from ../shared/data/tinycoder-dev.jsonl):
  * chat  — chat requests ("Write a Python function ...", ChatML), at each concurrency (closed
            loop: that many requests in flight, `--requests-per-stream` each);
  * code  — code completions (a file's first lines), likewise;
  * json  — a list of five JSON records and "person k of the list again", the answer held to
            a JSON schema (grammar-constrained rows speculating), likewise (`--workloads`
            picks among these three; tinycoder-16m target, tinycoder-draft-4m draft by default);
  * edit  — "Rewrite this function with the name `f_v2`" with the function in the prompt: the
            answer mostly repeats the prompt, which is what n-gram prompt lookup is for.

Modes: `plain` (no speculation, the peer), `draft` / `ngram` (adaptive: the engine decides per
step whether and how far to speculate), `draft-k` / `ngram-k` (always the full
`--num-draft-tokens`, to show what speculation costs or gains unguarded), `prediction` (the
server's default: drafts only from predicted outputs; the edit workload's requests carry the
function renamed as their prediction, the others none). Each mode runs in a
fresh engine on the same loaded weights after a warm-up, every engine on the one thread they all
share (as a server's engine keeps its thread: what MLX builds per thread and shape on a GPU is
built once, not in every timed run). `--repeats` runs rounds of every mode
in alternating order; tokens/s is each mode's median round and the ratio to plain the median of
per-round ratios (a mode against the plain run of its own round, since a shared machine's load
drifts between rounds). Tokens/s = generated tokens / wall time of the whole workload (prefill
included). Also reported: acceptance rates, verify widths, the share of speculative steps.
Greedy by default (`--temperature`), so every mode emits the same tokens.

Warm-up and length (`--warmup`, `--seconds`): MLX-CUDA JIT-compiles every new kernel shape
and cuDNN builds a graph per attention shape, tens of ms each, so before a group is timed every
mode runs once untimed on its prompts, plus forced runs at every draft length 1..k (each verify
width and batch size compiled once). `--seconds S` sizes each group's request list from the
warm-up's plain rate so that a plain round lasts about S seconds (the same prompts for every
mode: with greedy decoding every mode emits the same tokens). `--budget-s` stops starting new
rounds past that many seconds (the JSON is rewritten after every group, so a cut run keeps what
it measured).

Writes DIR/spec.json and DIR/spec.png (and with --log, a copy of stdout as DIR/spec.log).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from bench import common

if TYPE_CHECKING:
    from engine.loader import LoadedModel
    from engine.spec import SpecConfig


class Prompt(NamedTuple):
    ids: list[int]
    max_tokens: int
    # the answer expected (OpenAI's predicted outputs), sent in the `prediction` mode only
    prediction: list[int] | None = None
    constraint: dict[str, Any] | None = None  # the answer's grammar (SamplingParams.constraint)


MODES = {
    "plain": None,
    "prediction": ("prediction", True),
    "draft": ("draft", True),
    "draft-k": ("draft", False),
    "ngram": ("ngram", True),
    "ngram-k": ("ngram", False),
}


class _Loop(threading.Thread):
    """What `EngineThread.stop` joins for an engine run by `_Host`: the end of its loop."""

    def __init__(self, ended: threading.Event) -> None:
        super().__init__(daemon=True)
        self._ended = ended

    def join(self, timeout: float | None = None) -> None:
        self._ended.wait(timeout)


class _Host:
    """One thread that builds and runs the benchmark's engines one after another, as a server
    builds its engine and runs it on one thread for its life. MLX keeps per thread what a GPU
    builds on a shape's first use (cuDNN attention graphs, command encoders, compiled
    functions): a fresh thread per run would build them again inside every timed run (a short
    prompt of a new length waited 92-120 ms for its first token on an H100 beside 16 decoding
    rows), and modes that meet more shapes would pay more of it. `run` is what
    `EngineThread.spawn_on` takes."""

    def __init__(self) -> None:
        self._jobs: list[Callable[[threading.Thread], None]] = []
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None

    def run(self, main: Callable[[threading.Thread], None]) -> None:
        """Queue `main` (an engine's build and loop) on the host thread."""
        with self._wake:
            if self._thread is None:
                self._thread = threading.Thread(target=self._main, name="mlxd-engine", daemon=True)
                self._thread.start()
            self._jobs.append(main)
            self._wake.notify()

    def _main(self) -> None:
        while True:
            with self._wake:
                while not self._jobs:
                    self._wake.wait()
                main = self._jobs.pop(0)
            ended = threading.Event()
            try:
                main(_Loop(ended))
            except Exception:  # noqa: BLE001 - the run reports its failed requests; go on
                traceback.print_exc()
            finally:
                ended.set()


_HOST = _Host()


# -- workloads ----------------------------------------------------------------------------------
def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _spread(items: list[Any], n: int) -> list[Any]:
    """n items evenly spaced through the list (deterministic)."""
    if not items:
        return []
    return [items[(i * len(items)) // n % len(items)] for i in range(n)]


def _code_prompt(text: str, tok: Any, max_tokens: int = 160) -> list[int]:
    """A file's first lines, ending on a line's content (the tokenizer merges a newline with the
    next line's indentation, so a prompt ending on a bare newline derails the model)."""
    lines, out = text.splitlines(), list[str]()
    for line in lines:
        cand = "\n".join([*out, line])
        if len(tok.encode(cand)) > max_tokens and out:
            break
        out.append(line)
    while out and not out[-1].strip():
        out.pop()
    return tok.encode("\n".join(out))


def chat_prompts(rows: list[dict[str, Any]], tok: Any, n: int) -> list[list[int]]:
    """The first user message of n dev-set chats, in the model's chat template."""
    chats = [r for r in rows if r["kind"] == "chat"]
    out = []
    for i in range(n):
        msgs = [chats[(i * 37) % len(chats)]["messages"][0]]
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        out.append(tok.encode(text))
    return out


def code_prompts(rows: list[dict[str, Any]], tok: Any, n: int) -> list[list[int]]:
    """The first lines of n dev-set files, to be completed."""
    codes = [r for r in rows if r["kind"] == "code"]
    return [_code_prompt(codes[(i * 13) % len(codes)]["text"], tok) for i in range(n)]


RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "language": {"enum": ["python", "rust", "go"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "language", "tags", "active"],
    "additionalProperties": False,
}


def json_prompts(rows: list[dict[str, Any]], tok: Any, n: int) -> list[list[int]]:
    """n lists of five JSON records, each asking for one of them again; the answer is held to
    `RECORD`'s schema (`CONSTRAINTS`). Deterministic (a fixed seed)."""
    import random

    del rows
    rng = random.Random(0)
    names = ["Ada", "Linus", "Grace", "Guido", "Barbara", "Ken", "Dennis", "Margaret"]
    tags = ["db", "web", "ml", "ops", "ui"]
    out = []
    for _ in range(n):
        records = [json.dumps({"name": rng.choice(names), "age": rng.randint(20, 80),
                               "language": rng.choice(["python", "rust", "go"]),
                               "tags": rng.sample(tags, 2), "active": rng.random() < 0.5})
                   for _ in range(5)]
        k = rng.randrange(5)
        text = ("people = [\n" + ",\n".join(records) + ",\n]\n"
                f"# person {k + 1} of the list again:\nperson = ")
        out.append(tok.encode(text, add_special_tokens=False))
    return out


WORKLOADS = {"chat": chat_prompts, "code": code_prompts, "json": json_prompts}
CONSTRAINTS = {"json": {"type": "json_schema", "schema": RECORD}}


def edit_prompts(rows: list[dict[str, Any]], tok: Any, n: int) -> list[Prompt]:
    """A function from the dev chats, asked back under a new name; its prediction is the
    function renamed."""
    funcs = []
    for r in rows:
        if r["kind"] != "chat":
            continue
        m = re.search(r"```python\n(.*?)```", r["messages"][1]["content"], re.S)
        if m and 8 <= m.group(1).count("\n") <= 40:
            funcs.append(m.group(1))
    out = []
    for f in _spread(funcs, n):
        name = re.match(r"\s*(?:async\s+)?def (\w+)", f)
        new = f"{name.group(1)}_v2" if name else "f_v2"
        msg = f"Rewrite this function with the name `{new}`:\n```python\n{f}```"
        text = tok.apply_chat_template(
            [{"role": "user", "content": msg}], add_generation_prompt=True, tokenize=False
        )
        renamed = f.replace(name.group(1), new, 1) if name else f
        out.append(Prompt(tok.encode(text), min(len(tok.encode(f)) + 24, 512),
                          tok.encode(renamed, add_special_tokens=False)))
    return out


# -- one measured run ---------------------------------------------------------------------------
def run_workload(
    lm: LoadedModel,
    spec: SpecConfig | None,
    prompts: list[Prompt],
    concurrency: int,
    temperature: float,
    trace: Path | None = None,
) -> dict[str, Any]:
    """Closed loop: keep `concurrency` requests in flight until all prompts are served
    (`trace`: the engine's step trace, engine/steptrace.py)."""
    from engine.api import Request, SamplingParams, TokenEvent
    from engine.core import Engine, EngineConfig
    from engine.kv.geometry import clear_plans
    from engine.scheduler import SchedulerConfig

    clear_plans()  # no run finds the plans of an identical run before it
    sched = SchedulerConfig(max_num_seqs=max(concurrency, 1), prefill_chunk=512)
    eng = Engine.spawn_on(_HOST.run, lm, EngineConfig(
        sched, prefix_cache_bytes=0, spec=spec, trace_steps=str(trace) if trace else None))
    lock = threading.Condition()
    state = {"next": 0, "done": 0, "tokens": 0}
    outputs: dict[str, list[int]] = {}  # request id -> its tokens (the lookup replay's input)
    first_token: dict[str, float] = {}
    submitted: dict[str, float] = {}

    def submit_next() -> None:
        i = state["next"]
        if i >= len(prompts):
            return
        state["next"] += 1
        ids, max_tokens, prediction, constraint = prompts[i]
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=1000 + i,
                                constraint=constraint)
        predicted = spec is not None and spec.method == "prediction"
        req = Request(f"r{i}", list(ids), params, prediction_ids=prediction if predicted else None)
        submitted[req.req_id] = time.perf_counter()
        eng.add(req, sink)

    def sink(events: list[TokenEvent]) -> None:  # engine thread
        with lock:
            for ev in events:
                state["tokens"] += len(ev.token_ids)
                outputs.setdefault(ev.req_id, []).extend(ev.token_ids)
                if ev.token_ids and ev.req_id not in first_token:
                    first_token[ev.req_id] = time.perf_counter()
                if ev.finish_reason is not None:
                    if ev.error:  # raised on the bench's thread (the engine's must go on)
                        errors.append(ev.error)
                    state["done"] += 1
                    submit_next()
            lock.notify_all()

    errors: list[str] = []
    try:
        start = time.perf_counter()
        with lock:
            for _ in range(min(concurrency, len(prompts))):
                submit_next()
            while state["done"] < len(prompts) and not errors:
                lock.wait(1.0)
        if errors:
            raise RuntimeError(f"a request failed: {errors[0]}")
        wall = time.perf_counter() - start
        stats = eng.stats()
    finally:
        eng.stop()
    ttft = [first_token[k] - submitted[k] for k in first_token]
    out: dict[str, Any] = {
        "tokens": state["tokens"],
        "wall_s": round(wall, 4),
        "tokens_per_s": round(state["tokens"] / wall, 3),
        "mean_ttft_s": round(statistics.mean(ttft), 4) if ttft else None,
        "engine_steps": stats.num_steps,
        "outputs": [outputs.get(f"r{i}", []) for i in range(len(prompts))],
    }
    if stats.spec is not None:
        out["spec"] = dataclasses.asdict(stats.spec)
    return out


def spec_config(
    mode: str, args: argparse.Namespace, draft: LoadedModel | None, k: int = 0
) -> SpecConfig | None:
    """The mode's speculation config (`k`: this ceiling instead of the mode's own)."""
    from engine.spec import SpecConfig

    choice = MODES[mode]
    if choice is None:
        return None
    method, adaptive = choice
    return SpecConfig(
        method=method,
        draft_model=draft if method == "draft" else None,
        num_draft_tokens=k or _ceiling(method, args),
        adaptive=adaptive,
    )


def _ceiling(method: str, args: argparse.Namespace) -> int:
    """--num-draft-tokens, or for n-gram --ngram-draft-tokens when given (its drafts cost
    nothing to make, so where verification is flat in width a higher ceiling pays), else the
    engine's default for the method."""
    from engine.spec import CEILINGS, DEFAULT_CEILING

    if method == "ngram" and args.ngram_draft_tokens:
        return int(args.ngram_draft_tokens)
    return int(args.num_draft_tokens or CEILINGS.get(method, DEFAULT_CEILING))


def warm_up(
    lm: LoadedModel,
    draft: LoadedModel | None,
    args: argparse.Namespace,
    prompts: list[Prompt],
    concurrency: int,
    modes: list[str],
) -> float:
    """Every mode once on one request per stream, then forced draft lengths 1..k (every verify
    width at every batch size); untimed. Returns a last plain run's seconds per request."""
    sub = prompts[: max(concurrency, 1)]
    for mode in modes:
        run_workload(lm, spec_config(mode, args, draft), sub, concurrency, args.temperature)
    # forced lengths build every verify width; a prediction's rows verify the shapes n-gram's
    # do, and n-gram (unlike a prediction, which these prompts may lack) drafts on every prompt
    widths: dict[str, int] = {}
    for m in modes:
        if (choice := MODES[m]) is not None:
            forced = "ngram" if choice[0] == "prediction" else choice[0]
            widths[forced] = max(widths.get(forced, 0), _ceiling(choice[0], args))
    for method, ceiling in sorted(widths.items()):
        for k in range(1, ceiling + 1):
            cfg = spec_config(f"{method}-k", args, draft, k)
            run_workload(lm, cfg, sub, concurrency, args.temperature)
    # the rate that sizes the rounds, measured once everything above is compiled (the first
    # plain run of a fresh process carries MLX-CUDA's JIT: 7.8 s for a 0.6 s request once)
    plain_s = run_workload(lm, None, sub, concurrency, args.temperature)["wall_s"] / len(sub)
    return plain_s


def sized(
    prompts: list[Prompt], concurrency: int, seconds: float, per_request: float
) -> list[Prompt]:
    """The prompt list repeated or cut so that a plain run lasts about `seconds` (a multiple of
    the concurrency, at least one request per stream)."""
    n = max(concurrency, int(seconds / max(per_request, 1e-6) + 0.5))
    n = -(-n // concurrency) * concurrency
    return [prompts[i % len(prompts)] for i in range(n)]


def compare(
    lm: LoadedModel,
    draft: LoadedModel | None,
    args: argparse.Namespace,
    prompts: list[Prompt],
    concurrency: int,
    modes: list[str],
    label: str,
) -> dict[str, Any]:
    if args.warmup:
        t0 = time.perf_counter()
        per_request = warm_up(lm, draft, args, prompts, concurrency, modes)
        if args.seconds > 0:
            prompts = sized(prompts, concurrency, args.seconds, per_request)
        print(
            f"[{label} c={concurrency}] warm-up {time.perf_counter() - t0:.1f} s, plain "
            f"{per_request:.2f} s/request -> {len(prompts)} requests per round",
            flush=True,
        )
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    repeats = dict(
        (int(k), int(v)) for k, v in (x.split("=") for x in args.repeats_at.split(",") if x)
    ).get(concurrency, args.repeats)
    for rep in range(repeats):
        if rep and time.perf_counter() - args.start > args.budget_s:
            print(f"[{label} c={concurrency}] time budget spent: {rep} rounds", flush=True)
            break
        order = modes if rep % 2 == 0 else list(reversed(modes))
        for mode in order:
            trace = (args.trace_steps / f"{label}-c{concurrency}-{mode}-{rep}.jsonl"
                     if args.trace_steps else None)
            res = run_workload(
                lm, spec_config(mode, args, draft), prompts, concurrency, args.temperature, trace
            )
            runs[mode].append(res)
            print(
                f"[{label} c={concurrency}] {mode:8s} {res['tokens_per_s']:8.1f} tok/s "
                f"({res['tokens']} tokens, {res['wall_s']:.1f} s)"
                + (
                    f", acceptance {res['spec'].get('acceptance_rate')}, "
                    f"spec steps {res['spec'].get('spec_steps')}/{res['engine_steps']}"
                    if "spec" in res
                    else ""
                ),
                flush=True,
            )
    summary: dict[str, dict[str, Any]] = {}
    for mode, rs in runs.items():
        # ratios are paired with the plain run of the same round (load drifts between rounds)
        if not rs:
            continue
        ratios = (
            [r["tokens_per_s"] / p["tokens_per_s"] for r, p in zip(rs, runs["plain"], strict=True)]
            if "plain" in runs
            else []
        )
        ranked = sorted(range(len(rs)), key=lambda i: rs[i]["tokens_per_s"])
        summary[mode] = dict(rs[ranked[len(rs) // 2]], repeats=[r["tokens_per_s"] for r in rs])
        summary[mode].pop("outputs", None)
        if ratios:
            summary[mode]["ratio_vs_plain"] = round(float(statistics.median(ratios)), 3)
            summary[mode]["ratios_by_round"] = [round(x, 3) for x in ratios]
    if concurrency == 1 and args.temperature == 0 and runs.get("plain"):
        for mode in (m for m in summary if (MODES[m] or ("",))[0] == "ngram"):
            cells = summary[mode].get("spec", {}).get("step_ms", {})
            replay = summary[mode]["lookup_replay"] = lookup_replay(
                prompts, runs["plain"][0]["outputs"], _ceiling("ngram", args), cells)
            print(f"[{label} c={concurrency}] {mode} lookup replay: {replay['plain_steps']} "
                  f"plain steps, {replay['rounds']} rounds of {replay['tokens_per_round']} tokens"
                  + (f", always speculating {bound}x" if (bound := replay.get("decode_bound_ratio"))
                     else " (too few measured widths for the always-speculating bound)"),
                  flush=True)
    return {
        "workload": label,
        "concurrency": concurrency,
        "num_requests": len(prompts),
        "rounds": len(runs[modes[0]]),
        "modes": summary,
    }


def lookup_replay(prompts: list[Prompt], outputs: list[list[int]], ceiling: int,
                  step_ms: dict[str, float]) -> dict[str, Any]:
    """What n-gram prompt lookup can give on these requests, whatever decides when to use it.

    Each request's greedy output (the plain run's) is replayed token by token through the
    engine's n-gram index, from the step after the one a row joins in (a plain step): every
    lookup that finds something is verified at once (up to `ceiling` drafts; the longest prefix
    equal to the output is accepted), every other position is decoded plainly. With the
    one-row step costs the speculative run measured (`step_ms` cells "1xW", linear between
    measured widths) this gives the decode-time ratio to plain decoding of that
    always-speculating engine (`decode_bound_ratio`, prefill left out): the drafter's own
    ceiling on the workload, against which the measured ratio shows what the engine's choices
    leave."""
    import numpy as np

    from engine.spec import SpecConfig
    from engine.spec.ngram import NGramIndex

    cfg = SpecConfig()
    tokens = plain = rounds = accepted = drafted = 0
    widths: list[int] = []
    for (prompt, max_tokens, *_), out in zip(prompts, outputs, strict=True):
        index = NGramIndex(cfg.ngram_min, cfg.ngram_max)
        # the first token comes from the prefill, the second from the plain step the row joins in
        context = list(prompt) + out[:2]
        plain += len(out) > 1
        t = 2
        while t < len(out):
            room = max(0, min(ceiling, max_tokens - t - 1))
            found = index.lookup(context, room) if room else []
            n = 0
            while n < len(found) and t + n < len(out) and found[n] == out[t + n]:
                n += 1
            if found:
                rounds += 1
                drafted += len(found)
                accepted += n
                widths.append(len(found) + 1)
            else:
                plain += 1
            context.extend(out[t : t + n + 1])
            t += n + 1
        tokens += max(0, len(out) - 1)
    report: dict[str, Any] = {
        "tokens": tokens, "plain_steps": plain, "rounds": rounds,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
        "tokens_per_round": round((tokens - plain) / rounds, 3) if rounds else None,
        "mean_verify_width": round(float(np.mean(widths)), 3) if widths else None,
    }
    one_row = sorted((int(k.split("x")[1]), v) for k, v in step_ms.items() if k.startswith("1x"))
    if tokens and len(one_row) >= 2 and one_row[0][0] == 1:
        xs, ys = [w for w, _ in one_row], [v for _, v in one_row]
        cost = plain * ys[0] + float(np.interp(widths, xs, ys).sum())  # no rounds: 0
        report["decode_bound_ratio"] = round(tokens * ys[0] / cost, 3)
    return report


# -- output -------------------------------------------------------------------------------------
def plot(result: dict[str, Any], path: Path) -> None:
    plt = common.pyplot()

    groups = result["results"]
    modes = [m for m in MODES if any(m in g["modes"] for g in groups)]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    width = 0.8 / max(len(modes), 1)
    labels = [f"{g['workload']}\nc={g['concurrency']}" for g in groups]
    for j, mode in enumerate(modes):
        xs = [i + (j - (len(modes) - 1) / 2) * width for i in range(len(groups))]
        tps = [g["modes"].get(mode, {}).get("tokens_per_s", 0) for g in groups]
        ratio = [g["modes"].get(mode, {}).get("ratio_vs_plain", 0) for g in groups]
        axes[0].bar(xs, tps, width, label=mode)
        bars = axes[1].bar(xs, ratio, width, label=mode)
        for b, g in zip(bars, groups, strict=True):
            acc = g["modes"].get(mode, {}).get("spec", {}).get("acceptance_rate")
            if acc is not None:
                axes[1].annotate(
                    f"{acc:.0%}",
                    (b.get_x() + b.get_width() / 2, b.get_height()),
                    ha="center",
                    va="bottom",
                    fontsize=6,
                )
    for ax in axes:
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels(labels, fontsize=8)
    axes[0].set_ylabel("generated tokens / s")
    axes[0].set_title("throughput")
    axes[1].axhline(1.0, color="black", lw=0.8)
    axes[1].axhline(0.95, color="red", lw=0.8, ls="--")
    axes[1].set_ylabel("ratio to plain decoding (labels: draft acceptance)")
    axes[1].set_title("speculative / plain")
    axes[0].legend(fontsize=8)
    env = result["environment"]
    fig.suptitle(
        f"mlxd speculative decoding — {env['device']}, {result['config']['target']} + "
        f"{result['config']['draft']}, k<={result['config']['num_draft_tokens']}"
        + (f" (n-gram {result['config']['ngram_draft_tokens']})"
           if result["config"].get("ngram_draft_tokens") else "")
        + ", "
        f"T={result['config']['temperature']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("spec", help="the engine with and without speculative decoding",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="target (default: tinycoder-16m)")
    p.add_argument("--draft-model", type=Path, default=common.DRAFT_MODEL)
    p.add_argument("--data", type=Path, default=common.DEV_DATA)
    common.add_out_arg(p)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--requests-per-stream", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-draft-tokens", type=int, default=None,
                   help="the ceiling of the draft length (default: the engine's, per method)")
    p.add_argument("--ngram-draft-tokens", type=int, default=0,
                   help="the n-gram drafter's ceiling (default: --num-draft-tokens, else the "
                        "engine's)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--workloads", default="chat,code",
                   help=f"prompt workloads run at each --concurrency, of {', '.join(WORKLOADS)}")
    p.add_argument("--modes", default="plain,draft,draft-k,ngram",
                   help=f"chat and code workload modes, of {', '.join(MODES)}")
    p.add_argument("--edit-modes", default="plain,ngram,ngram-k,draft")
    p.add_argument("--edit-requests", type=int, default=4)
    p.add_argument("--edit-concurrency", default="1,4", help="empty: no edit workload")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--repeats-at", default="",
                   help="rounds at some concurrencies, e.g. 16=3 (the others: --repeats)")
    p.add_argument("--warmup", action="store_true",
                   help="before each group, every mode and every forced draft length untimed")
    p.add_argument("--seconds", type=float, default=0.0,
                   help="with --warmup: size each group so that a plain round lasts ~this long")
    p.add_argument("--budget-s", type=float, default=float("inf"),
                   help="start no new round after this many seconds (results so far are kept)")
    p.add_argument("--log", action="store_true", help="also write stdout to DIR/spec.log")
    p.add_argument("--trace-steps", type=Path, default=None, metavar="DIR",
                   help="each timed run's engine step trace as DIR/<workload>-c<c>-<mode>-<round>"
                        ".jsonl (python -m bench steps summarises one)")
    p.set_defaults(func=cmd_spec)


def _uses_draft(args: argparse.Namespace) -> bool:
    """Whether a mode that runs needs the draft model: `--modes` run only with prompt
    workloads at some `--concurrency`, `--edit-modes` only at some `--edit-concurrency`."""
    prompts = any(w for w in args.workloads.split(",")) and common.int_list(args.concurrency)
    modes = f"{args.modes if prompts else ''},{args.edit_modes if args.edit_concurrency else ''}"
    return any(m.startswith("draft") for m in modes.split(","))


def cmd_spec(args: argparse.Namespace) -> int:
    import engine  # noqa: F401  (BLAS before mlx)
    from engine.loader import load_model

    args.start = time.perf_counter()
    unknown = {m for m in f"{args.modes},{args.edit_modes}".split(",") if m} - set(MODES)
    if unknown:
        raise SystemExit(f"unknown modes {sorted(unknown)} (known: {', '.join(MODES)})")
    out = common.out_dir(args, "spec")
    if args.log:
        _tee(out / "spec.log")
    if args.trace_steps:
        args.trace_steps.mkdir(parents=True, exist_ok=True)
    lm = load_model(str(args.model or common.default_model()), dtype=args.dtype)
    draft = load_model(str(args.draft_model), dtype=args.dtype) if _uses_draft(args) else None
    tok = lm.tokenizer
    rows = _rows(Path(args.data))
    modes = [m for m in args.modes.split(",") if m]
    results: list[dict[str, Any]] = []

    workloads = [w for w in args.workloads.split(",") if w]
    if set(workloads) - set(WORKLOADS):
        raise SystemExit(f"unknown workloads {sorted(set(workloads) - set(WORKLOADS))} "
                         f"(known: {', '.join(WORKLOADS)})")
    if not args.warmup:  # every kernel shape once, briefly (not measured)
        warm = [Prompt(ids, 16) for ids in chat_prompts(rows, tok, 2) + code_prompts(rows, tok, 2)]
        for mode in ("plain", "draft-k" if draft else "", "ngram-k"):
            if mode:
                run_workload(lm, spec_config(mode, args, draft), warm, 4, args.temperature)

    groups = []
    for workload in workloads:
        for c in common.int_list(args.concurrency):
            n = c * args.requests_per_stream
            prompts = [Prompt(ids, args.max_tokens, constraint=CONSTRAINTS.get(workload))
                       for ids in WORKLOADS[workload](rows, tok, n)]
            groups.append((workload, c, modes, prompts))
    edit_modes = [m for m in args.edit_modes.split(",") if m]
    for c in [int(x) for x in args.edit_concurrency.split(",") if x and edit_modes]:
        groups.append(("edit", c, edit_modes, edit_prompts(rows, tok, max(args.edit_requests, c))))
    for label, c, group_modes, prompts in groups:
        if time.perf_counter() - args.start > args.budget_s:
            print(f"[{label} c={c}] skipped: time budget spent", flush=True)
            continue
        results.append(compare(lm, draft, args, prompts, c, group_modes, label))
        write(args, lm, results, out)
    print(f"wrote {out / 'spec.json'} and {out / 'spec.png'} "
          f"({time.perf_counter() - args.start:.0f} s)")
    return 0


def write(args: argparse.Namespace, lm: LoadedModel, results: list[Any], out: Path) -> None:
    import mlx.core as mx

    from kernels import device as blas

    result = {
        "config": {
            "target": lm.path.name,
            "draft": Path(args.draft_model).name if _uses_draft(args) else None,
            "dtype": lm.dtype,
            "num_draft_tokens": _ceiling("draft", args),
            "ngram_draft_tokens": _ceiling("ngram", args),
            "temperature": args.temperature,
            "workloads": args.workloads,
            "max_tokens": args.max_tokens,
            "requests_per_stream": args.requests_per_stream,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "seconds": args.seconds,
        },
        "environment": {
            "device": str(mx.default_device()),
            "mlx": getattr(mx, "__version__", "?"),
            "blas": {"path": blas.info().path, "status": blas.info().reason},
        },
        "results": results,
    }
    common.write_json(out / "spec.json", "spec", result, args)
    plot(result, out / "spec.png")


def _tee(path: Path) -> None:
    """Copy everything printed to stdout into `path` as well."""
    import sys

    log = path.open("w")
    console = sys.stdout

    class Tee:
        def write(self, text: str) -> int:
            log.write(text)
            log.flush()
            return console.write(text)

        def flush(self) -> None:
            console.flush()

    sys.stdout = Tee()  # type: ignore[assignment]
