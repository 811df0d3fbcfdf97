"""Prefill order and budget, at the scheduler with a fake runner (no model): no request is passed
by later ones in more than `max_passed` steps, short prompts interleave with a long one's chunks,
the long one still finishes its prefill within twice its chunks, and a step's chunk follows the
prefill budget within what memory and the layouts allow."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from engine.api import Request, SamplingParams
from engine.batch import RowMeta
from engine.kv.memory import MemoryBudget, ModelFootprint
from engine.scheduler import (
    MAX_BUDGET_CHUNKS,
    Plan,
    Scheduler,
    SchedulerConfig,
    StepResult,
    auto_prefill_budget,
)

CHUNK = 64


class FakeLayer:
    """Stands in for a KV layout: only the row bookkeeping the batch does."""

    def __init__(self, rows: int):
        self.rows = list(range(rows))

    def filter(self, keep: list[int], moves: list[Any] | None = None) -> None:
        self.rows = [self.rows[i] for i in keep]

    def extend(self, other: FakeLayer) -> None:
        self.rows += other.rows


@dataclass
class FakeRunner:
    """Runs plans without a model: every decoding row gets one token per step."""

    step: int = 0
    started: dict[str, int] = field(default_factory=dict)  # req_id -> step its prefill began
    joined: dict[str, int] = field(default_factory=dict)  # req_id -> step it joined the batch
    groups: list[tuple[int, list[str]]] = field(default_factory=list)  # groups as they started
    prefill_steps: dict[str, list[int]] = field(default_factory=dict)  # steps with its chunk

    def run(self, plan: Plan) -> StepResult:
        group = plan.prefill
        if group is not None:
            ids = [r.req_id for r in group.rows]
            if group.done == 0:
                self.groups.append((self.step, ids))
            for rid in ids:
                self.started.setdefault(rid, self.step)
                self.prefill_steps.setdefault(rid, []).append(self.step)
        if plan.join is not None:
            for row in plan.join.rows:
                self.joined[row.req_id] = self.step
            # the last chunk samples the rows' first tokens (engine.runner)
            plan.join.next_tokens = mx.full((len(plan.join),), 5, dtype=mx.int32)
            plan.batch.concat(plan.join)
        rows = list(plan.batch.rows)
        self.step += 1
        return StepResult(rows, [[5] for _ in rows], width=1 if rows else 0)


def _scheduler(memory: MemoryBudget | None = None, **cfg) -> Scheduler:
    cfg.setdefault("prefill_chunk", CHUNK)
    cfg.setdefault("prefill_budget", 4 * CHUNK)
    budget = memory or MemoryBudget(budget=1 << 40, weights=0, footprint=ModelFootprint(()))
    return Scheduler(SchedulerConfig(**cfg), lambda n: [FakeLayer(n)], 100, budget)


def _measured(memory: MemoryBudget | None = None) -> Scheduler:
    """A scheduler whose start-up measurement gave an idle chunk of 16 chunks."""
    sched = _scheduler(memory)
    sched.size_idle_chunk(16 * CHUNK / 0.2)  # 200 ms (`prefill_step_s`) of prefill
    return sched


def _fixed(**cfg) -> Scheduler:
    """Every long prompt in chunks of CHUNK (a budget of one chunk, busy or idle)."""
    return _scheduler(prefill_budget=CHUNK, idle_budget_factor=1, **cfg)


def _row(req_id: str, prompt_len: int, max_tokens: int) -> RowMeta:
    request = Request(req_id, [3] * prompt_len, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return RowMeta(request, prompt_len, max_tokens, frozenset())


def _drive(sched: Scheduler, arrivals: dict[int, list[RowMeta]], max_steps: int = 2000,
           cols: list[tuple[int, int]] | None = None) -> FakeRunner:
    """Run the arrivals to the end; `cols`, when given, gets (step, prefill columns) of every
    step that prefilled."""
    runner = FakeRunner()
    last = max(arrivals)
    while runner.step < max_steps and (runner.step <= last or sched.has_work()):
        for row in arrivals.get(runner.step, []):
            sched.add(row)
        plan = sched.schedule()
        if cols is not None and plan.prefill is not None:
            cols.append((runner.step, plan.prefill_end - plan.prefill.done))
        sched.update(plan, runner.run(plan))
    assert not sched.has_work(), "the stream did not drain"
    return runner


def _passes(runner: FakeRunner, arrived: dict[str, int], order: list[str]) -> dict[str, int]:
    """Per request: steps in which a group holding a request that arrived after it started
    while it was still waiting."""
    rank = {rid: i for i, rid in enumerate(order)}
    out = {}
    for rid in order:
        out[rid] = sum(
            1 for step, ids in runner.groups
            if arrived[rid] <= step < runner.started[rid] and any(rank[o] > rank[rid] for o in ids)
        )
    return out


def _long_stream(seed: int, n: int) -> tuple[dict[int, list[RowMeta]], dict[str, int], list[str]]:
    """Four short rows decoding from step 0, then a prompt every 2 steps: mostly long ones
    (2..12 chunks), some short, in random order of length."""
    rng = random.Random(seed)
    arrivals: dict[int, list[RowMeta]] = {0: [_row(f"d{i}", 10, 400) for i in range(4)]}
    arrived = {f"d{i}": 0 for i in range(4)}
    order = [f"d{i}" for i in range(4)]
    for i in range(n):
        step = 2 + 2 * i
        plen = rng.choice([rng.randint(2 * CHUNK, 12 * CHUNK), rng.randint(2, CHUNK)])
        rid = f"p{i}"
        arrivals.setdefault(step, []).append(_row(rid, plen, 8))
        arrived[rid], order = step, order + [rid]
    return arrivals, arrived, order


def test_no_request_is_passed_in_more_than_max_passed_steps():
    arrivals, arrived, order = _long_stream(seed=1, n=60)
    sched = _scheduler(max_passed=3)
    runner = _drive(sched, arrivals)
    passes = _passes(runner, arrived, order)
    assert max(passes.values()) <= 3, passes
    assert any(passes.values()), "the stream never reordered anything: the test shows nothing"
    # every prompt got its first token (joined the batch)
    assert set(runner.joined) == set(order)


def test_without_the_bound_a_long_prompt_starves_behind_short_ones():
    """Shortest-first alone (no bound) lets a stream of short prompts pass a long one again and
    again; with the bound it is passed in at most `max_passed` steps."""

    def arrivals() -> dict[int, list[RowMeta]]:
        out = {s: [_row(f"s{s}", 20, 4)] for s in range(40)}
        out[0].insert(0, _row("long", 6 * CHUNK, 4))
        return out

    order = ["long"] + [f"s{s}" for s in range(40)]
    arrived = {"long": 0, **{f"s{s}": s for s in range(40)}}
    unbounded = _drive(_fixed(max_passed=10**9), arrivals())
    bounded = _drive(_fixed(max_passed=2), arrivals())
    assert _passes(unbounded, arrived, order)["long"] > 10
    assert _passes(bounded, arrived, order)["long"] <= 2
    assert bounded.joined["long"] < unbounded.joined["long"]


def test_short_prompts_interleave_with_a_long_prefill():
    """A 10-chunk prompt starts first; short prompts arriving during its prefill join the batch
    within two steps, not after its whole prefill, and the long one's prefill still ends within
    twice its chunks."""
    long_chunks = 10
    arrivals = {0: [_row("long", long_chunks * CHUNK, 4)]}
    for s in (2, 5, 9):
        arrivals[s] = [_row(f"s{s}", 40, 4)]
    runner = _drive(_fixed(), arrivals)
    long_steps = runner.prefill_steps["long"]
    assert len(long_steps) == long_chunks
    for s in (2, 5, 9):
        assert runner.joined[f"s{s}"] - s <= 1, (s, runner.joined)
        assert runner.joined[f"s{s}"] < runner.joined["long"]  # before the long one finished
    assert runner.joined["long"] - runner.started["long"] < 2 * long_chunks


def test_a_long_prompt_waits_for_the_long_slot_but_short_ones_do_not():
    """Two long prompts: the second starts after the first's prefill (one long one at a time);
    a short prompt arriving after both passes the second, not the first."""
    arrivals = {0: [_row("a", 4 * CHUNK, 4), _row("b", 4 * CHUNK, 4)], 1: [_row("s", 9, 4)]}
    runner = _drive(_fixed(max_passed=4), arrivals)
    assert runner.started["b"] >= runner.joined["a"]
    assert runner.started["s"] < runner.started["b"]


def test_group_budget_grows_when_no_rows_decode():
    """With rows decoding a group holds budget / width rows; with none it may hold
    `idle_budget_factor` times as many."""
    rows = [_row(f"r{i}", 32, 4) for i in range(40)]  # width 32
    idle = _scheduler(prefill_budget=128, idle_budget_factor=4)
    for r in rows:
        idle.add(r)
    assert len(idle.schedule().prefill.rows) == 16  # 4 x 128 / 32
    busy = _scheduler(prefill_budget=128, idle_budget_factor=4)
    busy.add(_row("d", 5, 100))
    busy.update(plan := busy.schedule(), FakeRunner().run(plan))
    for r in rows:
        busy.add(_row("b" + r.req_id, 32, 4))
    assert len(busy.schedule().prefill.rows) == 4  # 128 / 32


def test_auto_budget_rule():
    # 20,000 tokens/s x 50 ms = 1,000 -> 992 (multiple of 16)
    assert auto_prefill_budget(20_000, 256, 0.05) == 992
    assert auto_prefill_budget(100, 256, 0.05) == 256  # at least one chunk
    assert auto_prefill_budget(1e9, 256, 0.05) == MAX_BUDGET_CHUNKS * 256


def _chunks(runner: FakeRunner, sched_steps: list[tuple[int, int]], rid: str) -> list[int]:
    return [cols for step, cols in sched_steps if step in runner.prefill_steps[rid]]


def _drive_cols(sched: Scheduler, arrivals: dict[int, list[RowMeta]]) -> tuple[FakeRunner, list]:
    cols: list[tuple[int, int]] = []
    return _drive(sched, arrivals, cols=cols), cols


def test_a_long_prompt_runs_in_chunks_of_the_budget_busy_and_the_idle_budget_idle():
    """With no rows decoding, a long prompt's chunks are the idle budget (4 x 4 chunks; the
    last one what is left); while rows decode, the prefill budget (4 chunks); and when rows
    start decoding in the middle of its prefill, its chunks shrink to the prefill budget."""
    n = 40 * CHUNK  # 40 chunks of prefill
    runner, cols = _drive_cols(_measured(), {0: [_row("long", n, 4)]})
    assert _chunks(runner, cols, "long") == [16 * CHUNK, 16 * CHUNK, 8 * CHUNK]
    busy = {0: [_row("d", 5, 400)], 1: [_row("long", n, 4)]}
    runner, cols = _drive_cols(_measured(), busy)
    assert _chunks(runner, cols, "long") == [4 * CHUNK] * 10
    assert runner.joined["long"] - runner.started["long"] == 9  # a chunk a step
    later = {0: [_row("long", n, 4)], 1: [_row("s", 9, 400)]}
    runner, cols = _drive_cols(_measured(), later)
    long_cols = _chunks(runner, cols, "long")
    assert long_cols[0] == 16 * CHUNK and set(long_cols[1:]) == {4 * CHUNK}
    assert sum(long_cols) == n


def test_the_idle_chunk_follows_the_measured_rate_within_the_layouts_limits():
    sched = _scheduler()
    assert sched.step_chunk() == CHUNK and sched.chunk_widths() == [4 * CHUNK]  # not measured
    sched.size_idle_chunk(20_100)  # 20,100 tokens/s x 4 x 50 ms = 4,020 -> 4,016 (block 16)
    assert sched.step_chunk() == 4016 and sched.chunk_widths() == [4 * CHUNK, 4016]
    sched.prefix.max_chunk = 5 * CHUNK + 7  # e.g. a ring: rounded down to the block size
    sched.size_idle_chunk(20_000)
    assert sched.step_chunk() == 5 * CHUNK
    sched.size_idle_chunk(100)  # a slow device: never below prefill_chunk
    assert sched.step_chunk() == CHUNK and sched.chunk_widths() == [4 * CHUNK]


def test_the_busy_chunk_is_the_budget_within_the_layouts_limits():
    """While rows decode a long prompt's chunk is the prefill budget in columns, rounded down
    to the block size, at most `max_chunk`, at least `prefill_chunk`."""
    sched = _scheduler(prefill_budget=3 * CHUNK + 5)
    sched.add(_row("d", 5, 100))
    sched.update(plan := sched.schedule(), FakeRunner().run(plan))
    assert len(sched.running) == 1
    assert sched.step_chunk() == sched.busy_chunk() == 3 * CHUNK  # a multiple of the block
    sched.prefix.max_chunk = 2 * CHUNK
    assert sched.step_chunk() == 2 * CHUNK
    sched.prefill_budget = CHUNK // 2  # a budget below one chunk: the chunk still advances
    assert sched.step_chunk() == CHUNK and sched.chunk_widths() == []


def test_a_long_prompt_takes_small_chunks_when_big_ones_do_not_fit_memory():
    """The idle chunk's activations would not fit the memory budget; alone, the prompt still
    runs, in chunks of prefill_chunk, and the scheduler accounts those."""
    per_token = 1 << 20
    memory = MemoryBudget(budget=(8 * CHUNK) * per_token, weights=0,
                          footprint=ModelFootprint(()), prefill_bytes_per_token=per_token)
    n = 12 * CHUNK
    runner, cols = _drive_cols(_measured(memory), {0: [_row("long", n, 4)]})
    assert _chunks(runner, cols, "long") == [CHUNK] * 12
    roomy = MemoryBudget(budget=(32 * CHUNK) * per_token, weights=0,
                         footprint=ModelFootprint(()), prefill_bytes_per_token=per_token)
    runner, cols = _drive_cols(_measured(roomy), {0: [_row("long", n, 4)]})
    assert _chunks(runner, cols, "long") == [12 * CHUNK]
