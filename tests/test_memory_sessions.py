"""Many long sessions under a small memory budget: the weights, the KV every admitted row will
allocate (8-bit, rows padded to the longest), the prefix cache and a step's activations stay
inside `--memory-budget` at every step; prefix-cache blocks are evicted least recently used to
admit a request; a request that can never fit alone is a 413 up front, one that fits exactly
runs; and the greedy outputs are those of an engine under no memory pressure."""

from __future__ import annotations

import random
from collections.abc import Callable

import mlx.core as mx
import pytest

from engine.api import EngineError, Request
from engine.core import Engine, EngineConfig
from engine.kv import batch as kvb
from engine.kv.batch import KVConfig
from engine.scheduler import SchedulerConfig
from tests.tiny_models import greedy, loaded, tiny_model

CHUNK = 128
BLOCK = 16
MB = 1_000_000


@pytest.fixture(scope="module")
def lm():
    model, cfg = tiny_model("llama", head_dim=32)  # two ring layers (window 24), two full
    return loaded(model, cfg)


def _engine(lm, budget: int, *, prefix_bytes: int = 1 << 30, kv_bits: int = 8) -> Engine:
    return Engine(lm, EngineConfig(
        SchedulerConfig(prefill_chunk=CHUNK, max_num_seqs=16), kv=KVConfig(kv_bits, 32),
        prefix_cache_bytes=prefix_bytes, memory_budget=budget, prefix_block_size=BLOCK))


def _held(eng: Engine) -> tuple[int, int]:
    """(weights + allocated KV + prefix cache, allocated KV) as they are now."""
    sched = eng.scheduler
    kv = kvb.nbytes(sched.running.caches)
    if sched.prefill is not None:
        kv += kvb.nbytes(sched.prefill.caches)
    return eng.budget.weights + kv + sched.prefix.nbytes, kv


def _drive(eng: Engine, reqs: list[Request],
           check: Callable[[Engine], None] | None = None) -> dict[str, list[int]]:
    """Run the requests to the end on this thread, step by step; `check` after every step."""
    out: dict[str, list[int]] = {}
    finish: dict[str, str | None] = {}
    for req in reqs:
        out[req.req_id], finish[req.req_id] = [], None

        def sink(events, rid=req.req_id):
            for ev in events:
                out[rid].extend(ev.token_ids)
                finish[rid] = ev.finish_reason or finish[rid]

        eng._sinks[req.req_id] = sink
        eng.scheduler.add(eng._validate(req))
    for _ in range(20_000):
        if not (eng.scheduler.has_work() or eng.runner.in_flight):
            break
        eng._step()
        if check is not None:
            check(eng)
    assert all(f == "length" for f in finish.values()), finish
    return out


def _sessions(seed: int, n: int, max_tokens: int) -> list[Request]:
    """Sessions of one agent: a shared 200-token system prompt, then 350..700 tokens each."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 500) for _ in range(200)]
    return [greedy(f"s{i}", system + [rng.randrange(3, 500) for _ in range(rng.randint(350, 700))],
                   max_tokens) for i in range(n)]


class Inside:
    """After every step: memory held within the budget, KV within what admission reserved,
    and MLX's active memory (this engine's share) within the budget."""

    def __init__(self, eng: Engine):
        mx.synchronize()
        self.base = mx.get_active_memory() - eng.budget.weights  # what is not this engine's
        self.steps = 0
        self.most = 0

    def __call__(self, eng: Engine) -> None:
        held, kv = _held(eng)
        budget = eng.budget.budget
        assert held <= budget, (self.steps, held, budget)
        assert kv <= eng.scheduler.kv_reserved(), (self.steps, kv, eng.scheduler.kv_reserved())
        mx.synchronize()
        active = mx.get_active_memory() - self.base
        assert active <= budget, (self.steps, active, budget)
        self.most = max(self.most, held)
        self.steps += 1


def test_many_long_sessions_stay_inside_the_budget(lm):
    """Twelve sessions of 550..900-token prompts (8-bit KV, prefix cache on) under 6 MB, where
    all of them at once would need about three times that: every step stays inside, every
    request finishes, the prefix cache gave blocks back, and each output is the output with
    no memory pressure."""
    reqs = _sessions(seed=0, n=12, max_tokens=24)
    free = _engine(lm, 1 << 40)
    want = _drive(free, reqs)
    eng = _engine(lm, 6 * MB)
    inside = Inside(eng)
    got = _drive(eng, [greedy(r.req_id, r.prompt_ids, 24) for r in reqs], inside)
    assert got == want
    stats = eng.prefix.stats()
    assert stats is not None and stats.evicted_blocks > 0 and stats.hit_tokens > 0
    assert inside.most > 0.7 * eng.budget.budget  # the budget was what bounded it


def test_rows_of_mixed_lengths_stay_inside_what_admission_reserved(lm):
    """A 1,500-token prompt and fifteen 20-token ones: every row of a batch is as wide as the
    longest (in 256-column steps), so short rows next to the long one cost as much as it does;
    admission counts that, and nothing grows past it while decoding."""
    rng = random.Random(3)
    reqs = [greedy("long", [rng.randrange(3, 500) for _ in range(1500)], 60)]
    reqs += [greedy(f"s{i}", [rng.randrange(3, 500) for _ in range(20)], 40) for i in range(15)]
    want = _drive(_engine(lm, 1 << 40, prefix_bytes=0), reqs)
    eng = _engine(lm, 8 * MB, prefix_bytes=0)
    got = _drive(eng, [greedy(r.req_id, r.prompt_ids, r.params.max_tokens) for r in reqs],
                 Inside(eng))
    assert got == want


def test_prefix_blocks_are_evicted_least_recently_used_to_admit(lm):
    """Two earlier sessions sit in the prefix cache, `old` used before `recent`. A request that
    fits next to a decoding row only once some blocks go is admitted in the same step, and the
    blocks that went are `old`'s: `recent` still hits in full."""
    rng = random.Random(5)
    old, recent = ([rng.randrange(3, 500) for _ in range(400)] for _ in range(2))
    eng = _engine(lm, 1 << 40)
    _drive(eng, [greedy("old", old, 4)])
    _drive(eng, [greedy("recent", recent, 4)])
    cache = eng.scheduler.prefix.cache
    recent_bytes = cache.pinned_bytes([cache.lookup(recent, max_tokens=len(recent) - 1)])
    assert 0 < recent_bytes < cache.nbytes
    decoding = eng._validate(greedy("decoding", [rng.randrange(3, 500) for _ in range(40)], 200))
    sched = eng.scheduler
    sched.add(decoding)
    while not sched.running.rows:
        eng._step()
    assert sched.running.rows == [decoding]
    new = eng._validate(greedy("new", [rng.randrange(3, 500) for _ in range(300)], 8))
    # room for the rows and `recent`'s blocks plus half of `old`'s: some of `old` must go
    room = recent_bytes + (cache.nbytes - recent_bytes) // 2
    eng.budget.budget += room - sched._free([new])
    sched.add(new)
    eng._step()
    assert sched.prefill is not None and new in sched.prefill.rows or new in sched.running.rows
    held, _ = _held(eng)
    assert held <= eng.budget.budget
    evicted = eng.prefix.stats().evicted_blocks
    assert evicted > 0
    hit_recent = cache.lookup(recent, max_tokens=len(recent) - 1)
    hit_old = cache.lookup(old, max_tokens=len(old) - 1)
    assert hit_recent is not None and hit_recent.num_tokens == (len(recent) - 1) // BLOCK * BLOCK
    assert hit_old is None or hit_old.num_tokens < (len(old) - 1) // BLOCK * BLOCK


def test_a_waiting_rows_evicted_hit_is_looked_up_again(lm):
    """A row looked up while it waited, whose blocks were then evicted, prefills from what is
    still cached (here nothing) rather than from blocks that are gone."""
    rng = random.Random(6)
    prompt = [rng.randrange(3, 500) for _ in range(200)]
    eng = _engine(lm, 1 << 40)
    _drive(eng, [greedy("first", prompt, 4)])
    row = eng._validate(greedy("again", prompt, 4))
    prefix = eng.scheduler.prefix
    prefix.lookup(row)
    assert row.num_cached_tokens > 0
    prefix.set_room(0)
    assert prefix.nbytes == 0
    prefix.lookup(row)
    assert row.num_cached_tokens == 0


def test_413_exactly_when_a_request_cannot_fit_alone(lm):
    """The refusal line is the request's need alone: weights, its KV at its longest (a whole
    256-column step, at the KV's bits) and its costliest step's activations. At that budget it
    runs inside it; a byte less is a 413; and at 16-bit KV the same budget refuses it."""
    prompt = [3 + i % 400 for i in range(700)]
    probe = _engine(lm, 1 << 40)
    need = probe.budget.alone_bytes(len(prompt), 40, probe.prefix.chunk)
    assert need > probe.budget.weights + probe.budget.footprint.row_bytes(len(prompt) + 40)
    tight = _engine(lm, need)
    out = _drive(tight, [greedy("fits", prompt, 40)], Inside(tight))
    assert len(out["fits"]) == 40
    with pytest.raises(EngineError) as err:
        _engine(lm, need - 1)._validate(greedy("over", prompt, 40))
    assert err.value.status == 413 and err.value.code == "memory_budget_exceeded"
    with pytest.raises(EngineError) as err:
        _engine(lm, need, kv_bits=16)._validate(greedy("wide", prompt, 40))
    assert err.value.status == 413
