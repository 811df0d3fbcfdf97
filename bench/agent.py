"""agent and prefill: agent-shaped workloads (long, growing prompts) and single long prompts.

    python -m bench agent   [--sessions 4] [--turns 4] [--agents 2] [--peers mlx_lm_blas]
    python -m bench prefill [--sizes 1024,8192,32768] [--repeats 3]

`agent` runs S concurrent sessions against each server in turn (mlxd, then each peer; one server
up at a time). A session belongs to one of `--agents` agents; the sessions of an agent share its
system prompt (tool definitions as JSON, then project notes). Each turn streams a chat completion
(tools on, `--max-tokens` per answer, temperature 0), appends the answer as returned (content and
tool calls), then a tool result of 200–4,000 tokens of real text (the checkout's own sources and
docs), and sends the whole history again. A session ends after `--turns` turns or when the next
turn would not fit the model's context. The workload (system prompts, tasks, tool results) is a
pure function of `--seed` and the checkout. The sessions start together and send each next turn
as soon as the answer is in, unless `--stagger S` spreads their starts over S seconds and
`--tool-seconds MIN,MAX` waits that long (seeded, uniform) between an answer and the next turn.

Per turn: TTFT, prompt tokens, `usage.prompt_tokens_details.cached_tokens`, output tokens, wall
time, and the tokens the server could have reused (the previous turn's prompt and answer; for
a first turn, its agent's system prompt). Per server: turns per minute, output tok/s, TTFT p50/p99
by turn index, the prefix-cache hit ratio (cached / prompt tokens), and the ideal TTFT of each
turn: the server's own TTFT, alone, for the turn's new tokens after its reusable tokens (cached),
interpolated from calibrations run on the same server before the sessions start, one request
at a time, fastest of `--calib-repeats`: fresh random prompts of `--calib-sizes` tokens (prefix
0), and the same sizes after a cached fresh prefix of 1/4, 1/2 and 3/4 of the context (the new
tokens attend over the prefix, which no cache saves). `--no-in-context` skips the second (the
ideal is then a fresh prompt of the new tokens, reported as `ideal_fresh` either way). The
ideal is a single-stream figure: under S concurrent sessions a turn also waits for the others.

`prefill` is that calibration alone at the long sizes: prefill tok/s of one prompt at concurrency
1 (tokens / TTFT) for each size (sizes past the model's context are clipped to it), per server,
and for mlxd's engine alone, in-process (loaded and warmed up as `mlxd serve` does, stepped on the
bench's thread until the first token): the server's figure against it is the HTTP side's cost.

Both also time raw mlx-lm in-process on the same token ids (the model's forward in 2,048-token
chunks into mlx-lm's own KV cache, as mlx-lm's generate prefills; float32 weights and the
optimised BLAS on a CPU, as mlxd computes there): the physical reference, measured before any
server starts so that nothing else competes for the cores.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from bench import common
from bench.loadgen import LoadSpec, one_request
from bench.metrics import percentile, ratio
from bench.servers import OPENBLAS, ServerProcess, ServerSpec, cpu_seconds

CORPUS_GLOBS = ("docs/*.md", "README.md", "engine/**/*.py", "server/**/*.py", "kernels/**/*.py",
                "bench/*.py", "reliability/**/*.py")
TURN_OVERHEAD = 32  # template tokens around an answer and a tool result (headroom)
RAW_CHUNK = 2048  # mlx-lm generate's prefill step

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file of the repository.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "path relative to the repository root"},
            "start_line": {"type": "integer"}, "end_line": {"type": "integer"}},
            "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the repository for a regular expression.",
        "parameters": {"type": "object", "properties": {
            "pattern": {"type": "string"}, "glob": {"type": "string"}},
            "required": ["pattern"]}}},
    {"type": "function", "function": {
        "name": "run_tests", "description": "Run the test suite, or one test file.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}},
    {"type": "function", "function": {
        "name": "edit_file", "description": "Replace a unique string in a file.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string"}, "old": {"type": "string"}, "new": {"type": "string"}},
            "required": ["path", "old", "new"]}}},
    {"type": "function", "function": {
        "name": "list_dir", "description": "List a directory.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                       "required": ["path"]}}},
]
PERSONAS = ("You are a coding agent working in a Python repository. Read before you edit, "
            "keep changes small, run the tests after each change.",
            "You are a code reviewer. Find bugs, missing tests and unclear names; cite the "
            "file and line of each finding.")
TASKS = ("Find where {name} is defined and explain what it does.",
         "The tests around {name} fail intermittently. Find out why.",
         "Add type hints to {name} and keep the behaviour unchanged.",
         "Write a short summary of {name} for the docs.")


# -- the workload: a pure function of the seed, the checkout and the tokenizer -----------------
@dataclass(slots=True)
class ToolResult:
    path: str
    text: str
    num_tokens: int


@dataclass(slots=True)
class SessionPlan:
    index: int
    agent: int
    task: str
    tool_results: list[ToolResult]  # one after each turn but the last
    start_s: float  # when the session sends its first turn, after the run's start
    tool_s: list[float]  # each tool's run (seconds) before the next turn


@dataclass(slots=True)
class Workload:
    system_prompts: list[str]  # one per agent
    system_tokens: list[int]  # each rendered alone through the chat template
    sessions: list[SessionPlan]


def corpus_files(root: Path = common.REPO) -> list[Path]:
    """The checkout's own sources and docs, sorted (the tool results' text)."""
    files = {p for g in CORPUS_GLOBS for p in root.glob(g) if p.is_file()}
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


class _Corpus:
    def __init__(self, tok: Any, files: list[Path], root: Path) -> None:
        self.tok, self.files, self.root = tok, files, root
        self._ids: dict[int, list[int]] = {}

    def ids(self, i: int) -> list[int]:
        if i not in self._ids:
            self._ids[i] = list(self.tok.encode(self.files[i].read_text(errors="replace"),
                                                add_special_tokens=False))
        return self._ids[i]

    def excerpt(self, start: int, num_tokens: int) -> ToolResult:
        """About `num_tokens` tokens (a header line naming the file, then the text from the start
        of file `start` on, running into the next files)."""
        rel = self.files[start].relative_to(self.root).as_posix()
        header = f"==> {rel} <==\n"
        body = max(1, num_tokens - len(self.tok.encode(header, add_special_tokens=False)))
        ids: list[int] = []
        i = start
        while len(ids) < body and i < start + len(self.files):
            ids += self.ids(i % len(self.files))
            i += 1
        text = header + self.tok.decode(ids[:body])
        return ToolResult(rel, text, len(self.tok.encode(text, add_special_tokens=False)))


def make_workload(tok: Any, *, sessions: int, turns: int, agents: int, seed: int,
                  tool_tokens: tuple[int, int], system_tokens: int,
                  root: Path = common.REPO, stagger_s: float = 0.0,
                  tool_seconds: tuple[float, float] = (0.0, 0.0)) -> Workload:
    """System prompts, tasks and tool results for every session; the same for the same seed.
    Session i starts at i * `stagger_s` / sessions seconds; after each turn its tool runs for
    a time drawn uniformly from `tool_seconds` (from a generator of its own, so that the texts
    of a seed do not depend on the timing)."""
    rng = random.Random(seed)
    files = corpus_files(root)
    if not files:
        raise SystemExit(f"no source or doc files under {root} for the tool results")
    corpus = _Corpus(tok, files, root)
    prompts: list[str] = []
    for a in range(agents):
        head = (f"{PERSONAS[a % len(PERSONAS)]}\n\nYou can call these tools:\n"
                f"{json.dumps(TOOLS, indent=1)}\n\nProject notes:\n")
        room = max(0, system_tokens - len(tok.encode(head, add_special_tokens=False)))
        prompts.append(head + corpus.excerpt(rng.randrange(len(files)), room).text)
    lo, hi = tool_tokens
    timing = random.Random(f"timing-{seed}")
    plans = []
    for s in range(sessions):
        name = files[rng.randrange(len(files))].stem
        task = TASKS[rng.randrange(len(TASKS))].format(name=name)
        results = [corpus.excerpt(rng.randrange(len(files)), rng.randint(lo, hi))
                   for _ in range(turns - 1)]
        plans.append(SessionPlan(s, s % agents, task, results, s * stagger_s / sessions,
                                 [timing.uniform(*tool_seconds) for _ in results]))
    sys_tokens = [len(tok.encode(tok.apply_chat_template([{"role": "system", "content": p}],
                                                         tokenize=False), add_special_tokens=False))
                  for p in prompts]
    return Workload(prompts, sys_tokens, plans)


# -- one turn over HTTP --------------------------------------------------------------------------
@dataclass(slots=True)
class TurnRecord:
    session: int
    agent: int
    turn: int  # 1-based
    start: float = 0.0
    end: float = 0.0
    ttft: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # None: the server did not report it
    output_tokens: int = 0
    tool_calls: int = 0
    reusable_tokens: int = 0  # what a cache could hold: last prompt + answer (turn 1: system)
    new_tokens: int | None = None  # prompt_tokens - reusable_tokens
    ideal_ttft: float | None = None  # the new tokens after the reusable ones, cached
    ideal_fresh_ttft: float | None = None  # the new tokens as a fresh prompt
    finish_reason: str | None = None
    ok: bool = False
    error: str | None = None
    message: dict[str, Any] = field(default_factory=dict)  # the answer as returned

    @property
    def e2e(self) -> float:
        return self.end - self.start


def _merge_delta(msg: dict[str, Any], calls: dict[int, dict[str, Any]],
                 delta: dict[str, Any]) -> bool:
    """Fold one streamed delta into the answer; True when it carried generated output."""
    got = False
    if delta.get("content"):
        msg["content"] = msg.get("content", "") + delta["content"]
        got = True
    if delta.get("reasoning_content"):
        got = True
    for tc in delta.get("tool_calls") or []:
        call = calls.setdefault(int(tc.get("index", 0)),
                                {"id": "", "type": "function",
                                 "function": {"name": "", "arguments": ""}})
        call["id"] = tc.get("id") or call["id"]
        fn = tc.get("function") or {}
        call["function"]["name"] += fn.get("name") or ""
        call["function"]["arguments"] += fn.get("arguments") or ""
        got = True
    return got


def _apply_usage(rec: TurnRecord, usage: dict[str, Any]) -> None:
    rec.prompt_tokens = usage.get("prompt_tokens")
    rec.output_tokens = int(usage.get("completion_tokens") or 0)
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        rec.cached_tokens = int(details["cached_tokens"])


async def chat_turn(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                    rec: TurnRecord) -> TurnRecord:
    """Stream one chat completion into `rec` (TTFT at the first chunk with generated output)."""
    msg: dict[str, Any] = {"role": "assistant", "content": ""}
    calls: dict[int, dict[str, Any]] = {}
    rec.start = time.monotonic()
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                rec.error = f"http_{resp.status_code}"
                return rec
            async for line in resp.aiter_lines():
                data = line[5:].strip() if line.startswith("data:") else ""
                if not data:
                    continue
                if data == "[DONE]":
                    rec.ok = True
                    break
                obj = json.loads(data)
                if "error" in obj:
                    rec.error = "stream_error"
                    return rec
                for choice in obj.get("choices") or []:
                    if _merge_delta(msg, calls, choice.get("delta") or {}) and rec.ttft is None:
                        rec.ttft = time.monotonic() - rec.start
                    rec.finish_reason = choice.get("finish_reason") or rec.finish_reason
                if obj.get("usage"):
                    _apply_usage(rec, obj["usage"])
        if not rec.ok:
            rec.error = "truncated_stream"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        rec.error = type(exc).__name__
    finally:
        rec.end = time.monotonic()
        if calls:
            msg["tool_calls"] = [calls[i] for i in sorted(calls)]
        rec.tool_calls = len(calls)
        rec.message = msg
    return rec


def _tool_messages(answer: dict[str, Any], result: ToolResult) -> list[dict[str, Any]]:
    """The tool result after an answer: a `tool` message per call (the text goes to the first),
    or, when the answer called nothing, a user message carrying the output."""
    calls = answer.get("tool_calls") or []
    if not calls:
        return [{"role": "user", "content": f"Output of read_file {result.path}:\n{result.text}"}]
    out = [{"role": "tool", "tool_call_id": c.get("id") or f"call_{i}",
            "content": result.text if i == 0 else "(no output)"} for i, c in enumerate(calls)]
    return out


@dataclass(slots=True)
class RunConfig:
    url: str
    model_id: str
    max_tokens: int
    context: int
    turns: int


async def run_session(client: httpx.AsyncClient, cfg: RunConfig, work: Workload,
                      plan: SessionPlan, records: list[TurnRecord]) -> str:
    """One session's turns (appended to `records` as they finish, so that a session cut off by
    the deadline keeps its finished turns), and why it ended ("turns", "context" or "error")."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": work.system_prompts[plan.agent]},
        {"role": "user", "content": plan.task}]
    reusable = work.system_tokens[plan.agent]
    if plan.start_s > 0:
        await asyncio.sleep(plan.start_s)
    for k in range(cfg.turns):
        if k and plan.tool_s[k - 1] > 0:  # the tool runs before the next request
            await asyncio.sleep(plan.tool_s[k - 1])
        body = {"model": cfg.model_id, "messages": messages, "tools": TOOLS,
                "max_tokens": cfg.max_tokens, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}}
        rec = await chat_turn(client, cfg.url, body,
                              TurnRecord(plan.index, plan.agent, k + 1, reusable_tokens=reusable))
        records.append(rec)  # finished: a turn the deadline cancels never gets here
        if not rec.ok or rec.prompt_tokens is None:
            return "error"
        if k == cfg.turns - 1:
            return "turns"
        result = plan.tool_results[k]
        messages = [*messages, rec.message, *_tool_messages(rec.message, result)]
        reusable = rec.prompt_tokens + rec.output_tokens
        if reusable + result.num_tokens + TURN_OVERHEAD + cfg.max_tokens > cfg.context:
            return "context"
    return "turns"


async def run_sessions(cfg: RunConfig, work: Workload, deadline_s: float, timeout_s: float,
                       transport: httpx.AsyncBaseTransport | None = None,
                       ) -> tuple[list[TurnRecord], Counter[str], float]:
    """Every session at once; after `deadline_s` the unfinished ones are cancelled ("deadline")
    and keep the turns they finished."""
    limits = httpx.Limits(max_connections=len(work.sessions) + 4)
    t0 = time.monotonic()
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s, connect=30),
                                 transport=transport) as c:
        records: list[TurnRecord] = []
        tasks = [asyncio.create_task(run_session(c, cfg, work, p, records))
                 for p in work.sessions]
        done, pending = await asyncio.wait(tasks, timeout=deadline_s)
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.wait(pending, timeout=10)
    wall = time.monotonic() - t0
    ended: Counter[str] = Counter()
    for t in tasks:
        ok = t in done and not t.cancelled() and t.exception() is None
        ended[t.result() if ok else "deadline"] += 1
    for r in records:
        r.start, r.end = r.start - t0, r.end - t0
    return records, ended, wall


# -- prefill calibration: the same server, one fresh prompt at a time ---------------------------
def interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float | None:
    """Piecewise-linear y(x) through the points; proportional below the first, extrapolated
    along the last segment above the last."""
    if not xs:
        return None
    if len(xs) == 1 or x <= xs[0]:
        return ys[0] * x / xs[0]
    i = 1
    while i < len(xs) - 1 and x > xs[i]:
        i += 1
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def _alone(srv: ServerProcess, eos_bias: dict[str, float] | None) -> Callable[[str], Any]:
    """Send one prompt at a time to `srv` (4 tokens asked, EOS kept away) and return its
    `RequestRecord`: the calibrations' request."""
    spec = LoadSpec(srv.url, srv.model_id or "default", [], 1, 4,
                    ignore_eos=srv.spec.supports_ignore_eos,
                    eos_bias=None if srv.spec.supports_ignore_eos else eos_bias)

    async def one(text: str) -> Any:
        async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=30)) as client:
            return await one_request(client, spec, text)

    return lambda text: asyncio.run(one(text))


def calibrate_in_context(srv: ServerProcess, model: str, levels: list[tuple[int, list[int]]],
                         repeats: int, seed: int, eos_bias: dict[str, float] | None
                         ) -> dict[str, Any]:
    """TTFT of `n` new tokens after a cached prefix of `p` tokens, for each (p, [n, ...]) of
    `levels`: a fresh prefix is sent alone (its prefill fills the server's prefix cache), then
    once per `n` followed by `n` fresh tokens; fastest of `repeats` fresh prefixes per point.
    A point's coordinates are what the server reports: the prefix is its cached tokens (the
    prefix request's prompt tokens when it reports none), the new tokens the rest."""
    one = _alone(srv, eos_bias)
    out = []
    for i, (p, news) in enumerate(levels):
        heads = calib_prompts(model, [p], repeats, seed + 101 + i)[p]
        tails = calib_prompts(model, news, repeats, seed + 211 + i)
        best: dict[int, tuple[float, int, int]] = {}
        for r, head in enumerate(heads):
            first = one(head)
            if not first.ok:
                continue
            for n in news:
                rec = one(head + " " + tails[n][r])
                if not rec.ok or rec.ttft is None or rec.prompt_tokens is None:
                    continue
                cached = rec.cached_tokens if rec.cached_tokens is not None else first.prompt_tokens
                cached = min(int(cached or 0), rec.prompt_tokens)
                if n not in best or rec.ttft < best[n][0]:
                    best[n] = (rec.ttft, cached, rec.prompt_tokens - cached)
        if best:
            pts = sorted(best.values(), key=lambda t: t[2])
            out.append({"prefix": p, "cached_tokens": [c for _, c, _ in pts],
                        "new_tokens": [m for _, _, m in pts], "ttft_s": [t for t, _, _ in pts]})
    return {"levels": out}


def in_context_levels(context: int, sizes: list[int]) -> list[tuple[int, list[int]]]:
    """Prefixes at a quarter, a half and three quarters of the context, each with the
    calibration sizes up to 2,048 new tokens that fit after it."""
    levels = []
    for q in (1, 2, 3):
        p = context * q // 4
        news = [n for n in sizes if n <= 2048 and p + n + 16 <= context]
        if news:
            levels.append((p, news))
    return levels


def ideal_in_context(fresh: dict[str, Any], in_ctx: dict[str, Any] | None, prefix: int,
                     new: int) -> float | None:
    """The TTFT of `new` tokens after a cached `prefix`: each calibrated prefix's TTFT at `new`
    (the fresh calibration at prefix 0), linear in the prefix between them and extrapolated
    along the last two past the longest."""
    base = interp(fresh["prompt_tokens"], fresh["ttft_s"], new)
    if base is None:
        return None
    xs, ys = [0.0], [base]
    for lv in (in_ctx or {}).get("levels", []):
        x = sum(lv["cached_tokens"]) / len(lv["cached_tokens"])
        y = interp(lv["new_tokens"], lv["ttft_s"], new)
        if y is not None and x > xs[-1]:  # a level the server did not hold longer says nothing
            xs.append(x)
            ys.append(y)
    if len(xs) == 1 or prefix <= 0:
        return base
    return interp(xs, ys, prefix)


def calib_prompts(model: str, sizes: list[int], repeats: int, seed: int) -> dict[int, list[str]]:
    """Fresh random prompts of each size (distinct, so that no prefix cache hits them)."""
    from bench.workload import prompts_of_lengths

    texts = iter(p.text for p in prompts_of_lengths(model, [n for n in sizes for _ in range(repeats)],
                                                    seed))
    return {n: [next(texts) for _ in range(repeats)] for n in sizes}


def calibrate(srv: ServerProcess, prompts: dict[int, list[str]],
              eos_bias: dict[str, float] | None) -> dict[str, Any]:
    """TTFT of each fresh prompt alone (fastest of its repeats) and prefill tok/s = tokens / TTFT."""
    one = _alone(srv, eos_bias)
    sizes, ttfts, cpus, seen, parts = [], [], [], [], []
    for n, texts in prompts.items():
        cpu0, parts0 = cpu_seconds(srv.pid), ttft_parts(srv.url)
        got = [((r.ttft if r.ok else None), r.prompt_tokens) for r in map(one, texts)]
        cpu = _cpu(cpu0, cpu_seconds(srv.pid))
        times = [t for t, _ in got if t is not None]
        if times:
            sizes.append(n)
            ttfts.append(min(times))
            cpus.append(cpu / len(texts) if cpu is not None else None)
            seen.append(next((p for _, p in got if p is not None), n))
            parts.append(ttft_parts_mean(parts0, ttft_parts(srv.url)))
    return {"sizes": sizes, "prompt_tokens": seen, "ttft_s": ttfts,
            "cpu_s_per_request": cpus,  # server CPU seconds (prefill + 4 tokens), mean
            # mlxd's own split of the server-side TTFT, mean over the size's requests (None: a
            # peer without those metrics)
            "ttft_parts_mean_s": parts,
            "prefill_tok_s": [p / t for p, t in zip(seen, ttfts, strict=True)]}


def raw_prefill(model: str, prompts: dict[int, list[str]], chunk: int = RAW_CHUNK) -> dict[str, Any]:
    """mlx-lm's own prefill of the same token ids, in-process (fastest of the repeats)."""
    import engine  # noqa: F401  (the optimised BLAS before mlx)

    # isort: split
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load

    on_cpu = mx.default_device() == mx.cpu
    path = model
    if on_cpu:
        from bench.modelprep import float32_copy

        path = str(float32_copy(model))
    loaded = load(path)
    lm, tok = loaded[0], loaded[1]

    def once(ids: list[int]) -> tuple[float, float]:
        """(wall, CPU) seconds of one prefill."""
        cache = make_prompt_cache(lm)
        x = mx.array(ids)[None]
        t0, c0 = time.perf_counter(), time.process_time()
        for a in range(0, len(ids), chunk):
            logits = lm(x[:, a:a + chunk], cache=cache)
            mx.eval(logits[:, -1], [c.state for c in cache])
        return time.perf_counter() - t0, time.process_time() - c0

    once(list(tok.encode(next(iter(prompts.values()))[0]))[:64])  # warm-up
    return {**_fastest_per_size(prompts, tok, lambda ids, tag: once(ids)),
            "weights": "float32 copy" if on_cpu else "checkpoint dtype", "chunk": chunk}


def _fastest_per_size(prompts: dict[int, list[str]], tok: Any,
                      once: Callable[[list[int], str], tuple[float, float]]) -> dict[str, Any]:
    """Each size's prompts encoded and timed by `once(ids, tag)` -> (wall, CPU) seconds; the
    fastest repeat per size, as prefill seconds, CPU seconds and tok/s."""
    sizes, times, cpus, seen = [], [], [], []
    for n, texts in prompts.items():
        ids = [list(tok.encode(t)) for t in texts]
        wall, cpu = min(once(x, f"{n}-{i}") for i, x in enumerate(ids))
        sizes.append(n)
        seen.append(len(ids[0]))
        times.append(wall)
        cpus.append(cpu)
    return {"sizes": sizes, "prompt_tokens": seen, "prefill_s": times, "cpu_s": cpus,
            "prefill_tok_s": [p / t for p, t in zip(seen, times, strict=True)]}


def engine_prefill(model: str, prompts: dict[int, list[str]]) -> dict[str, Any]:
    """mlxd's engine alone, in-process, on the same token ids: loaded and warmed up as `mlxd
    serve` does, each prompt submitted with max_tokens 1 and the engine stepped on this thread
    until its first token (fastest of the repeats). Against the server's TTFT it separates the
    HTTP side (parsing, tokenizing, streaming) from the engine's; against raw mlx-lm the engine's
    own overhead."""
    import engine  # noqa: F401  (the optimised BLAS before mlx)

    # isort: split
    from engine.api import Request, SamplingParams
    from engine.core import Engine, EngineConfig
    from engine.loader import load_model
    from engine.scheduler import SchedulerConfig

    loaded = load_model(model)
    eng = Engine(loaded, EngineConfig(SchedulerConfig(), warmup=True))

    def once(ids: list[int], tag: str) -> tuple[float, float]:
        """(wall, CPU) seconds from submission to the first token."""
        got: list[int] = []
        t0, c0 = time.perf_counter(), time.process_time()
        eng.add(Request(f"engine-{tag}", ids, SamplingParams(temperature=0.0, max_tokens=1)),
                lambda events: got.extend(t for e in events for t in e.token_ids))
        while not got:
            eng.turn()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        while eng.has_pending():  # the row's end
            eng.turn()
        return wall, cpu

    return _fastest_per_size(prompts, loaded.tokenizer, once)


# -- per-run summary -----------------------------------------------------------------------------
def _pq(values: list[float]) -> dict[str, float | None]:
    return {"p50": percentile(values, 50), "p99": percentile(values, 99), "n": len(values)}


def fill_ideal(records: list[TurnRecord], calib: dict[str, Any],
               in_ctx: dict[str, Any] | None = None) -> None:
    """Each turn's ideal TTFT: its new tokens (the prompt less what it could reuse) prefilled
    after the reusable ones, cached (`in_ctx`), and as a fresh prompt (`ideal_fresh_ttft`)."""
    for r in records:
        if r.prompt_tokens is None:
            continue
        r.new_tokens = max(0, r.prompt_tokens - r.reusable_tokens)
        r.ideal_fresh_ttft = interp(calib["prompt_tokens"], calib["ttft_s"], r.new_tokens)
        r.ideal_ttft = ideal_in_context(calib, in_ctx, r.prompt_tokens - r.new_tokens,
                                        r.new_tokens)


def summarize_run(records: list[TurnRecord], ended: Counter[str], wall: float) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    later = [r for r in ok if r.turn >= 2]
    by_turn: dict[str, Any] = {}
    for t in sorted({r.turn for r in ok}):
        rs = [r for r in ok if r.turn == t]
        by_turn[str(t)] = {
            "ttft_s": _pq([r.ttft for r in rs if r.ttft is not None]),
            "ideal_ttft_s": _pq([r.ideal_ttft for r in rs if r.ideal_ttft is not None]),
            "prompt_tokens_mean": sum(r.prompt_tokens or 0 for r in rs) / len(rs),
            "cached_tokens_mean": _mean([r.cached_tokens for r in rs]),
            "reusable_tokens_mean": sum(r.reusable_tokens for r in rs) / len(rs)}
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    reported = [r for r in ok if r.cached_tokens is not None]
    cached = sum(r.cached_tokens or 0 for r in reported)
    reusable_later = sum(r.reusable_tokens for r in later if r.cached_tokens is not None)
    cached_later = sum(r.cached_tokens or 0 for r in later if r.cached_tokens is not None)
    out_tokens = sum(r.output_tokens for r in ok)
    over = [r.ttft / r.ideal_ttft for r in later if r.ttft and r.ideal_ttft]
    over_fresh = [r.ttft / r.ideal_fresh_ttft for r in later if r.ttft and r.ideal_fresh_ttft]
    return {
        "sessions": sum(ended.values()), "ended_by": dict(ended),
        "turns_completed": len(ok), "turns_failed": len(records) - len(ok),
        "failures": dict(Counter(r.error or "unknown" for r in records if not r.ok)),
        "wall_s": wall, "turns_per_min": 60 * len(ok) / max(wall, 1e-9),
        "output_tokens": out_tokens, "output_tok_s": out_tokens / max(wall, 1e-9),
        "tool_calls": sum(r.tool_calls for r in ok),
        "ttft_s": _pq([r.ttft for r in ok if r.ttft is not None]),
        "ttft_turn2plus_s": _pq([r.ttft for r in later if r.ttft is not None]),
        "ideal_ttft_turn2plus_s": _pq([r.ideal_ttft for r in later if r.ideal_ttft is not None]),
        "ttft_over_ideal_turn2plus": _pq(over),
        "ideal_fresh_ttft_turn2plus_s": _pq([r.ideal_fresh_ttft for r in later
                                             if r.ideal_fresh_ttft is not None]),
        "ttft_over_ideal_fresh_turn2plus": _pq(over_fresh),
        "ttft_by_turn": by_turn,
        "prompt_tokens": prompt,
        "cached_tokens": cached if reported else None,
        "prefix_hit_ratio": (cached / prompt) if reported and prompt else None,
        "reprefilled_tokens": (prompt - cached) if reported else None,
        "reusable_tokens_turn2plus": reusable_later,
        "new_tokens_turn2plus_mean": _mean([r.new_tokens for r in later]),
        "reprefilled_turn2plus_mean": _mean([(r.prompt_tokens or 0) - r.cached_tokens
                                             for r in later if r.cached_tokens is not None]),
        "cached_of_reusable_turn2plus": (cached_later / reusable_later
                                         if reported and reusable_later else None),
    }


def _mean(values: list[int | None]) -> float | None:
    xs = [v for v in values if v is not None]
    return sum(xs) / len(xs) if xs else None


def run_ratios(mine: dict[str, Any], peer: dict[str, Any]) -> dict[str, float | None]:
    return {
        "turns_per_min": ratio(mine["turns_per_min"], peer["turns_per_min"]),
        "output_tok_s": ratio(mine["output_tok_s"], peer["output_tok_s"]),
        "ttft_turn2plus_p50": ratio(mine["ttft_turn2plus_s"]["p50"], peer["ttft_turn2plus_s"]["p50"]),
        "ttft_turn2plus_p99": ratio(mine["ttft_turn2plus_s"]["p99"], peer["ttft_turn2plus_s"]["p99"]),
    }


# -- driving the servers -------------------------------------------------------------------------
def context_of(model: str) -> int:
    cfg = json.loads((Path(model) / "config.json").read_text())
    return int(cfg.get("max_position_embeddings") or cfg.get("max_seq_len") or 4096)


def clip_sizes(sizes: list[int], context: int) -> list[int]:
    """Prompt sizes that fit the context with the few tokens a calibration request generates."""
    return sorted({min(n, context - 8) for n in sizes if n > 0})


def _specs(args: argparse.Namespace, model: str) -> tuple[list[ServerSpec], dict[str, str]]:
    from bench.sweep import peer_specs

    if args.peers is None:  # on a CPU the same BLAS and dtype as mlxd; on a GPU as users run it
        args.peers = "mlx_lm" if common.machine_info().get("gpus") else "mlx_lm_blas"
    return peer_specs(args, model)


def _eos_bias(model: str) -> dict[str, float]:
    from bench.workload import eos_token_ids

    return {str(i): -100.0 for i in eos_token_ids(model)}


def _warm_up(srv: ServerProcess, model: str, bias: dict[str, float], seed: int) -> None:
    """Two short requests on prompts that are never measured."""
    calibrate(srv, calib_prompts(model, [64], 2, seed + 1), bias)


def _start(spec: ServerSpec, model: str, out: Path, log: Any) -> ServerProcess:
    log(f"starting {spec.name} ...")
    srv = ServerProcess(spec, model, out / "logs").start()
    log(f"  {spec.name} ready on {srv.url} in {srv.startup_s:.1f}s")
    return srv


def _server_entry(spec: ServerSpec, srv: ServerProcess, model: str) -> dict[str, Any]:
    return {"label": spec.label, "note": spec.note, "argv": spec.build(model, srv.port),
            "startup_s": round(srv.startup_s or 0, 2), "model_id": srv.model_id}


def run_agent(args: argparse.Namespace, out: Path, log: Any = print,
              save: Any = None) -> dict[str, Any]:
    """Raw mlx-lm's calibration, then each server in turn; `save(result)` after each one."""
    from bench.workload import load_tokenizer

    model = str((args.model or common.default_model()).resolve())
    ctx = args.context or context_of(model)
    tok = load_tokenizer(model)
    lo, hi = args.tool_tokens
    work = make_workload(tok, sessions=args.sessions, turns=args.turns, agents=args.agents,
                         seed=args.seed, tool_tokens=(lo, hi), system_tokens=args.system_tokens,
                         stagger_s=args.stagger, tool_seconds=args.tool_seconds)
    sizes = args.calib_sizes or [s for s in (128, 512, 1024, 2048, 3072) if s < ctx]
    sizes = clip_sizes(sizes, ctx)
    prompts = calib_prompts(model, sizes, args.calib_repeats, args.seed)
    specs, models = _specs(args, model)
    result: dict[str, Any] = {
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": common.machine_info(),
        "config": {"model": model, "model_name": Path(model).name, "context": ctx,
                   "sessions": args.sessions, "turns": args.turns, "agents": args.agents,
                   "max_tokens": args.max_tokens, "tool_tokens": [lo, hi],
                   "stagger_s": args.stagger, "tool_seconds": list(args.tool_seconds),
                   "system_tokens": work.system_tokens, "seed": args.seed,
                   "calib_sizes": sizes, "calib_repeats": args.calib_repeats,
                   "tool_result_tokens": [[t.num_tokens for t in p.tool_results]
                                          for p in work.sessions]},
        "baseline": specs[0].name, "servers": {}, "loadavg": {}}
    if not args.no_raw:
        log("raw mlx-lm prefill calibration ...")
        result["raw"] = raw_prefill(model, prompts, args.raw_chunk)
    bias = _eos_bias(model)
    for spec in specs:
        srv = _start(spec, models[spec.name], out, log)
        try:
            entry = _server_entry(spec, srv, models[spec.name])
            _warm_up(srv, model, bias, args.seed)
            entry["calibration"] = calibrate(srv, prompts, bias)
            if not args.no_in_context:
                entry["calibration_in_context"] = calibrate_in_context(
                    srv, model, in_context_levels(ctx, sizes), args.calib_repeats, args.seed, bias)
            cfg = RunConfig(srv.url, srv.model_id or "default", args.max_tokens, ctx, args.turns)
            result["loadavg"][spec.name] = [round(x, 2) for x in os.getloadavg()]
            cpu0 = cpu_seconds(srv.pid)
            parts0 = ttft_parts(srv.url)
            records, ended, wall = asyncio.run(
                run_sessions(cfg, work, args.deadline, args.request_timeout))
            cpu1 = cpu_seconds(srv.pid)
            fill_ideal(records, entry["calibration"], entry.get("calibration_in_context"))
            entry["summary"] = summarize_run(records, ended, wall)
            entry["summary"]["server_cpu_s"] = _cpu(cpu0, cpu1)
            entry["summary"]["ttft_parts_mean_s"] = ttft_parts_mean(parts0, ttft_parts(srv.url))
            entry["turns"] = [_turn_dict(r) for r in records]
            entry["exit_code"] = srv.stop()
        finally:
            srv.stop()
        result["servers"][spec.name] = entry
        if save is not None:
            save(result)
        s = entry["summary"]
        log(f"  {spec.name}: {s['turns_completed']} turns in {s['wall_s']:.1f}s, "
            f"{s['turns_per_min']:.1f} turns/min, {s['output_tok_s']:.1f} tok/s, TTFT turn>=2 "
            f"p50 {_f(s['ttft_turn2plus_s']['p50'])} p99 {_f(s['ttft_turn2plus_s']['p99'])} s, "
            f"hit ratio {_f(s['prefix_hit_ratio'])}"
            + (" | TTFT in parts (mean s): " + ", ".join(
                f"{k} {v:.3f}" for k, v in s["ttft_parts_mean_s"].items())
               if s.get("ttft_parts_mean_s") else ""))
    base = result["servers"][specs[0].name]["summary"]
    result["ratios"] = {n: run_ratios(base, e["summary"])
                        for n, e in result["servers"].items() if n != specs[0].name}
    result["machine"]["loadavg_end"] = list(os.getloadavg())
    return result


TTFT_PARTS = ("preprocess", "queue", "prefill")


def ttft_parts(url: str) -> dict[str, tuple[float, float]] | None:
    """(sum, count) of the server's `mlxd_request_{preprocess,queue,prefill}_seconds` and of its
    TTFT histogram from /metrics; None where the server has no such figures (peers)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(url + "/metrics", timeout=10).text
        got = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    except Exception:  # a peer without /metrics, or text that is not Prometheus'
        return None
    names = {p: f"mlxd_request_{p}_seconds" for p in TTFT_PARTS}
    names["ttft"] = "mlxd_time_to_first_token_seconds"
    if not all(f"{n}_sum" in got for n in names.values()):
        return None
    return {p: (got[f"{n}_sum"], got[f"{n}_count"]) for p, n in names.items()}


def ttft_parts_mean(before: dict[str, tuple[float, float]] | None,
                    after: dict[str, tuple[float, float]] | None) -> dict[str, float] | None:
    """Mean seconds per request of each TTFT part between two `ttft_parts` readings."""
    if before is None or after is None:
        return None
    out = {}
    for part, (total, count) in after.items():
        n = count - before[part][1]
        if n > 0:
            out[part] = (total - before[part][0]) / n
    return out


def _cpu(a: float | None, b: float | None) -> float | None:
    """CPU seconds the server used in between (steadier than wall time on a shared machine)."""
    return None if a is None or b is None else round(b - a, 3)


def _turn_dict(r: TurnRecord) -> dict[str, Any]:
    d = asdict(r)
    d.pop("message")
    d["e2e"] = r.e2e
    return d


def _f(v: float | None, nd: int = 3) -> str:
    return "–" if v is None else f"{v:.{nd}f}"


def agent_table(result: dict[str, Any]) -> str:
    rows = ["| server | turns | failed turns | sessions ended by | turns/min | output tok/s | "
            "TTFT p50 (s) | TTFT p99 (s) | "
            "TTFT p50 turns ≥2 (s) | TTFT p99 turns ≥2 (s) | ideal p50 turns ≥2 (s) | "
            "TTFT / ideal p50, p99 turns ≥2 | "
            "prompt tokens | cached / prompt | cached / reusable, turns ≥2 | "
            "new tokens / turn ≥2 | re-prefilled / turn ≥2 | server CPU-s |",
            "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for e in result["servers"].values():
        s = e["summary"]
        ended = ", ".join(f"{k} {v}" for k, v in sorted(s["ended_by"].items()))
        rows.append(
            f"| {e['label']} | {s['turns_completed']} | {s['turns_failed']} | {ended} | "
            f"{s['turns_per_min']:.1f} | "
            f"{s['output_tok_s']:.1f} | {_f(s['ttft_s']['p50'])} | {_f(s['ttft_s']['p99'])} | "
            f"{_f(s['ttft_turn2plus_s']['p50'])} | {_f(s['ttft_turn2plus_s']['p99'])} | "
            f"{_f(s['ideal_ttft_turn2plus_s']['p50'])} | "
            f"{_f(s['ttft_over_ideal_turn2plus']['p50'], 2)}, "
            f"{_f(s['ttft_over_ideal_turn2plus']['p99'], 2)} | {s['prompt_tokens']} | "
            f"{_f(s['prefix_hit_ratio'])} | {_f(s['cached_of_reusable_turn2plus'])} | "
            f"{_f(s['new_tokens_turn2plus_mean'], 0)} | {_f(s['reprefilled_turn2plus_mean'], 0)} | "
            f"{_f(s.get('server_cpu_s'), 1)} |")
    return "\n".join(rows)


def prefill_table(result: dict[str, Any]) -> str:
    eng = result.get("engine") or {}
    labels = [e["label"] for e in result["servers"].values()] + (["engine alone"] if eng else [])
    rows = ["| prompt tokens | " + " | ".join(f"{x} tok/s" for x in labels)
            + " | raw mlx-lm tok/s | " + " | ".join(f"{x} / raw" for x in labels) + " |"]
    rows.append("|" + "---:|" * (2 + 2 * len(labels)))
    raw = result.get("raw") or {}
    for i, n in enumerate(result["config"]["sizes"]):
        cells, rats = [], []
        rv = raw["prefill_tok_s"][i] if raw else None
        values = [(c["prefill_tok_s"][c["sizes"].index(n)] if n in c["sizes"] else None)
                  for c in (e["calibration"] for e in result["servers"].values())]
        if eng:
            values.append(eng["prefill_tok_s"][eng["sizes"].index(n)] if n in eng["sizes"] else None)
        for v in values:
            cells.append(_f(v, 0))
            rats.append(_f(ratio(v, rv), 2))
        rows.append(f"| {raw['prompt_tokens'][i] if raw else n} | " + " | ".join(cells)
                    + f" | {_f(rv, 0)} | " + " | ".join(rats) + " |")
    rows += ["", "Prompt tokens per CPU-second (server process; raw: this process):", "",
             "| prompt tokens | " + " | ".join(e["label"] for e in result["servers"].values())
             + " | raw mlx-lm |", "|" + "---:|" * (2 + len(result["servers"]))]
    for i, n in enumerate(result["config"]["sizes"]):
        cells = []
        for e in result["servers"].values():
            c = e["calibration"]
            j = c["sizes"].index(n) if n in c["sizes"] else None
            cpu = c.get("cpu_s_per_request", [None] * len(c["sizes"]))[j] if j is not None else None
            cells.append(_f(ratio(c["prompt_tokens"][j], cpu) if j is not None else None, 0))
        rc = ratio(raw["prompt_tokens"][i], raw["cpu_s"][i]) if raw.get("cpu_s") else None
        rows.append(f"| {n} | " + " | ".join(cells) + f" | {_f(rc, 0)} |")
    split = [(e["label"], e["calibration"]) for e in result["servers"].values()
             if any(e["calibration"].get("ttft_parts_mean_s") or [])]
    for label, c in split:  # where a server's TTFT goes (its own /metrics)
        rows += ["", f"{label}'s TTFT in parts, mean ms (HTTP in → submit, queued, prefill; "
                 "the rest is the client's side and the stream's first chunk):", "",
                 "| prompt tokens | TTFT (fastest) | preprocess | queue | prefill |",
                 "|---:|---:|---:|---:|---:|"]
        for n, t, part in zip(c["sizes"], c["ttft_s"], c["ttft_parts_mean_s"], strict=True):
            ms = [_f(part.get(k) * 1e3 if part and k in part else None, 1) for k in TTFT_PARTS]
            rows.append(f"| {n} | {t * 1e3:.1f} | " + " | ".join(ms) + " |")
    return "\n".join(rows)


def run_prefill(args: argparse.Namespace, out: Path, log: Any = print) -> dict[str, Any]:
    model = str((args.model or common.default_model()).resolve())
    ctx = context_of(model)
    sizes = clip_sizes(args.sizes, ctx)
    prompts = calib_prompts(model, sizes, args.repeats, args.seed)
    specs, models = _specs(args, model)
    result: dict[str, Any] = {
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": common.machine_info(),
        "config": {"model": model, "model_name": Path(model).name, "context": ctx,
                   "sizes": sizes, "repeats": args.repeats, "seed": args.seed},
        "baseline": specs[0].name, "servers": {}, "loadavg": {}}
    if not args.no_raw:
        log("raw mlx-lm prefill ...")
        result["raw"] = raw_prefill(model, prompts, args.raw_chunk)
    log("mlxd's engine alone, in-process ...")
    result["engine"] = engine_prefill(model, prompts)
    gc.collect()  # the engine's model and KV go before the servers start
    bias = _eos_bias(model)
    for spec in specs:
        srv = _start(spec, models[spec.name], out, log)
        try:
            entry = _server_entry(spec, srv, models[spec.name])
            result["loadavg"][spec.name] = [round(x, 2) for x in os.getloadavg()]
            _warm_up(srv, model, bias, args.seed)
            cpu0 = cpu_seconds(srv.pid)
            entry["calibration"] = calibrate(srv, prompts, bias)
            entry["server_cpu_s"] = _cpu(cpu0, cpu_seconds(srv.pid))
            entry["exit_code"] = srv.stop()
        finally:
            srv.stop()
        result["servers"][spec.name] = entry
    result["machine"]["loadavg_end"] = list(os.getloadavg())
    return result


# -- plots ---------------------------------------------------------------------------------------
def plot_agent(result: dict[str, Any], path: Path) -> Path:
    from bench.plot import COLORS

    plt = common.pyplot()
    fig, (ax_t, ax_b, ax_c) = plt.subplots(1, 3, figsize=(18, 5.5))
    names = list(result["servers"])
    for i, name in enumerate(names):
        e, color = result["servers"][name], COLORS[i % len(COLORS)]
        by = e["summary"]["ttft_by_turn"]
        turns = [int(t) for t in by]
        for q, style in (("p50", "o--"), ("p99", "o-")):
            ax_t.plot(turns, [by[str(t)]["ttft_s"][q] for t in turns], style, color=color,
                      label=f"{e['label']} {q}")
        ax_t.plot(turns, [by[str(t)]["ideal_ttft_s"]["p50"] for t in turns], ":", color=color,
                  label=f"{e['label']} ideal p50")
        ax_c.plot(turns, [by[str(t)]["prompt_tokens_mean"] for t in turns], "o-", color=color,
                  label=f"{e['label']} prompt")
        cached = [by[str(t)]["cached_tokens_mean"] for t in turns]
        if any(c is not None for c in cached):
            ax_c.plot(turns, cached, "s--", color=color, label=f"{e['label']} cached")
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        s = result["servers"][name]["summary"]
        ax_b.bar([j + i * width for j in range(2)], [s["turns_per_min"], s["output_tok_s"]],
                 width, color=COLORS[i % len(COLORS)], label=result["servers"][name]["label"])
    ax_b.set_xticks([j + width * (len(names) - 1) / 2 for j in range(2)])
    ax_b.set_xticklabels(["turns / min", "output tok/s"])
    from matplotlib.ticker import MaxNLocator

    for ax in (ax_t, ax_c):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_t.set_yscale("log")
    ax_t.set(xlabel="turn", ylabel="TTFT (s)", title="TTFT by turn (dotted: ideal, new tokens only)")
    ax_b.set_title("session throughput")
    ax_c.set(xlabel="turn", ylabel="tokens (mean per turn)", title="prompt and cached tokens")
    for ax in (ax_t, ax_b, ax_c):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    cfg = result["config"]
    fig.suptitle(f"{cfg['model_name']}: {cfg['sessions']} sessions x {cfg['turns']} turns, "
                 f"{cfg['agents']} agents, context {cfg['context']} — "
                 f"{result['machine'].get('summary', '')}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_prefill(result: dict[str, Any], path: Path) -> Path:
    from bench.plot import COLORS

    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    sizes = result["config"]["sizes"]
    series = [(e["label"], e["calibration"]) for e in result["servers"].values()]
    if result.get("raw"):
        series.append(("raw mlx-lm", result["raw"]))
    width = 0.8 / max(1, len(series))
    for i, (label, c) in enumerate(series):
        ys = [c["prefill_tok_s"][c["sizes"].index(n)] if n in c["sizes"] else 0 for n in sizes]
        ax.bar([j + i * width for j in range(len(sizes))], ys, width,
               color=COLORS[i % len(COLORS)], label=label)
    ax.set_xticks([j + width * (len(series) - 1) / 2 for j in range(len(sizes))])
    ax.set_xticklabels([str(n) for n in sizes])
    ax.set(xlabel="prompt tokens", ylabel="prefill tok/s (tokens / TTFT)",
           title=f"{result['config']['model_name']}: one prompt at concurrency 1")
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# -- the subcommands -----------------------------------------------------------------------------
def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    a, b = int(lo), int(hi or lo)
    if not 0 < a <= b:
        raise argparse.ArgumentTypeError("expected MIN,MAX with 0 < MIN <= MAX")
    return a, b


def _float_range(text: str) -> tuple[float, float]:
    lo, _, hi = text.partition(",")
    a, b = float(lo), float(hi or lo)
    if not 0 <= a <= b:
        raise argparse.ArgumentTypeError("expected MIN,MAX seconds with 0 <= MIN <= MAX")
    return a, b


def _server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, default=None,
                   help="model directory (default: the bundled tinycoder-16m)")
    p.add_argument("--peers", default=None,
                   help="comma list of mlx_lm, mlx_lm_blas, vllm_mlx; empty: mlxd alone "
                        "(default: mlx_lm_blas on a CPU, mlx_lm on a GPU)")
    p.add_argument("--blas-path", default=OPENBLAS, help="the BLAS mlx_lm_blas preloads")
    p.add_argument("--peer-blas-dtype", choices=["float32", "checkpoint"], default="float32")
    p.add_argument("--mlxd-args", default="", help="extra arguments for `mlxd serve`, quoted")
    p.add_argument("--no-raw", action="store_true", help="skip raw mlx-lm's in-process prefill")
    p.add_argument("--raw-chunk", type=int, default=RAW_CHUNK,
                   help="raw mlx-lm's prefill chunk (default: mlx-lm generate's 2048)")
    p.add_argument("--seed", type=int, default=0)
    common.add_out_arg(p)


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("agent", help="multi-turn agent sessions with growing prompts",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _server_args(p)
    p.add_argument("--sessions", type=int, default=4, help="concurrent sessions")
    p.add_argument("--turns", type=int, default=4, help="turns per session (at most)")
    p.add_argument("--agents", type=int, default=2, help="distinct system prompts")
    p.add_argument("--max-tokens", type=int, default=256, help="answer cap per turn")
    p.add_argument("--tool-tokens", type=_range, default=(200, 4000),
                   help="MIN,MAX tokens of each tool result")
    p.add_argument("--system-tokens", type=int, default=600, help="system prompt size")
    p.add_argument("--stagger", type=float, default=0.0,
                   help="spread the sessions' starts evenly over this many seconds (0: together)")
    p.add_argument("--tool-seconds", type=_float_range, default=(0.0, 0.0),
                   help="MIN,MAX seconds a tool runs between a turn and the next (uniform)")
    p.add_argument("--context", type=int, default=None,
                   help="context limit (default: the model's max_position_embeddings)")
    p.add_argument("--calib-sizes", type=common.int_list, default=None,
                   help="prompt sizes of the ideal-TTFT calibration (default 128..3072)")
    p.add_argument("--calib-repeats", type=int, default=2)
    p.add_argument("--no-in-context", action="store_true",
                   help="skip the in-context calibration (the ideal is then a fresh prompt's)")
    p.add_argument("--deadline", type=float, default=1800.0, help="seconds per server")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.set_defaults(func=cmd_agent)
    p = sub.add_parser("prefill", help="prefill tok/s of one long prompt against raw mlx-lm",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _server_args(p)
    p.add_argument("--sizes", type=common.int_list, default=[1024, 8192, 32768],
                   help="prompt tokens (clipped to the model's context)")
    p.add_argument("--repeats", type=int, default=3, help="fresh prompts per size (fastest kept)")
    p.set_defaults(func=cmd_prefill)


def cmd_agent(args: argparse.Namespace) -> int:
    out = common.out_dir(args, "agent")
    path = out / "agent.json"
    result = run_agent(args, out, save=lambda r: common.write_json(path, "agent", r, args))
    common.write_json(path, "agent", result, args)
    plot_agent(result, path.with_suffix(".png"))
    md = agent_table(result)
    (out / "table.md").write_text(md + "\n")
    print(md)
    print(f"\nwrote {path}, {path.with_suffix('.png')}")
    return 1 if any(e["summary"]["turns_failed"] for e in result["servers"].values()) else 0


def cmd_prefill(args: argparse.Namespace) -> int:
    out = common.out_dir(args, "prefill")
    result = run_prefill(args, out)
    path = common.write_json(out / "prefill.json", "prefill", result, args)
    plot_prefill(result, path.with_suffix(".png"))
    md = prefill_table(result)
    (out / "table.md").write_text(md + "\n")
    print(md)
    print(f"\nwrote {path}, {path.with_suffix('.png')}")
    return 0
