"""Prefix cache wired into the scheduler: reuse is exact, reported, and bounded in bytes."""

from __future__ import annotations

import random

from engine.core import PREFIX_BLOCK_SIZE
from engine.loader import load_model
from tests.tiny_models import drive, greedy, loaded, run_alone, tiny_model


def _engine(lm, **cfg):
    from engine.core import Engine, EngineConfig
    from engine.scheduler import SchedulerConfig

    sched = {k: cfg.pop(k) for k in list(cfg) if k in ("prefill_chunk", "max_num_seqs")}
    eng = Engine(lm, EngineConfig(SchedulerConfig(**sched), **cfg))
    eng.start()
    return eng


def test_shared_1000_token_prefix_is_reused_exactly(tinycoder_path):
    lm = load_model(str(tinycoder_path), dtype="float32")
    lm.eos_token_ids = ()
    rng = random.Random(0)
    shared = [rng.randrange(3, lm.vocab_size) for _ in range(1008)]
    first = greedy("a", shared + [rng.randrange(3, 8000) for _ in range(40)], 8)
    second = greedy("b", shared + [rng.randrange(3, 8000) for _ in range(30)], 40)
    eng = _engine(lm)
    try:
        run_alone(eng, first)
        got = run_alone(eng, second)
        stats = eng.stats()
    finally:
        eng.stop()
    block = PREFIX_BLOCK_SIZE
    assert got.events[-1].num_cached_tokens == len(shared) // block * block
    assert stats.prefix_cache.hits >= 1 and stats.prefix_cache.bytes > 0
    plain = _engine(lm, prefix_cache_bytes=0)
    try:
        ref = run_alone(plain, greedy("b", second.prompt_ids, 40))
    finally:
        plain.stop()
    assert ref.events[-1].num_cached_tokens == 0
    assert got.tokens == ref.tokens


def test_prefix_cache_stays_under_budget():
    model, cfg = tiny_model("llama")
    lm = loaded(model, cfg)
    budget = 64 * 1024
    eng = _engine(lm, prefix_cache_bytes=budget)
    rng = random.Random(1)
    try:
        for i in range(12):
            prompt = [rng.randrange(3, cfg["vocab_size"]) for _ in range(120)]
            run_alone(eng, greedy(f"r{i}", prompt, 3))
            assert eng.stats().prefix_cache.bytes <= budget
        stats = eng.stats()
        assert stats.prefix_cache.evicted_blocks > 0
    finally:
        eng.stop()


def test_memory_budget_refuses_what_cannot_fit():
    import pytest

    from engine.api import EngineError

    model, cfg = tiny_model("qwen3")
    lm = loaded(model, cfg)
    eng = _engine(lm, memory_budget=2 * 1024 * 1024)
    try:
        weights = eng.budget.weights
        assert weights < 2 * 1024 * 1024
        with pytest.raises(EngineError) as err:
            eng.add(greedy("big", [3 + i % 500 for i in range(1500)], 500), lambda evs: None)
        assert err.value.status == 413
        ok = run_alone(eng, greedy("small", [5, 6, 7], 4))
        assert len(ok.tokens) == 4
    finally:
        eng.stop()



def test_rows_with_the_same_hit_share_one_restore(tinycoder_path):
    """An agent's sessions arriving together on its cached system prompt start as one group
    that restores the prefix once, and each row decodes what it decodes with no cache."""
    from engine.core import Engine, EngineConfig
    from engine.scheduler import SchedulerConfig

    lm = load_model(str(tinycoder_path), dtype="float32")
    lm.eos_token_ids = ()
    rng = random.Random(1)
    shared = [rng.randrange(3, lm.vocab_size) for _ in range(600)]
    reqs = [greedy(f"s{i}", shared + [rng.randrange(3, 8000) for _ in range(5 + 3 * i)], 12)
            for i in range(4)]
    eng = Engine(lm, EngineConfig(SchedulerConfig()))
    restores = []
    restore = eng.prefix.cache.restore
    eng.prefix.cache.restore = lambda hit: restores.append(hit) or restore(hit)
    drive(eng, [greedy("seed", shared + [7, 8, 9], 2)])
    got = drive(eng, reqs)
    block = PREFIX_BLOCK_SIZE
    assert [o.events[-1].num_cached_tokens for o in got] == [len(shared) // block * block] * 4
    assert len(restores) == 1
    plain = Engine(lm, EngineConfig(SchedulerConfig(), prefix_cache_bytes=0))
    ref = drive(plain, [greedy(r.req_id, r.prompt_ids, 12) for r in reqs])
    assert [o.tokens for o in got] == [o.tokens for o in ref]
