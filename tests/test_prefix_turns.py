"""The prefix cache across turns: a finished row's whole sequence (prompt, answer, stop token)
is cached, so the next turn, which re-sends the answer, restores through it. Exact tier: the
next turn's greedy tokens equal a run with the prefix cache off (float32, tiny random models)."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest

from engine.core import Engine, EngineConfig
from engine.scheduler import SchedulerConfig
from tests.tiny_models import greedy, loaded, run_alone, submit, tiny_model

BLOCK = 16


def _engine(lm, prefix_bytes: int = 64 << 20, **sched) -> Engine:
    eng = Engine(lm, EngineConfig(SchedulerConfig(**sched), prefix_cache_bytes=prefix_bytes,
                                  prefix_block_size=BLOCK))
    eng.start()
    return eng


def _prompt(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def _two_turns(lm, vocab: int, p1: int, a1: int, seed: int, **sched):
    """Turn 1 (p1 prompt tokens, a1 answer tokens), then turn 2 = turn 1 + its answer + 9 new
    tokens, on a cache-on engine; turn 2 again on a cache-off engine. Returns (turn-1 prompt,
    turn-1 answer, turn 2 with the cache, turn 2 without, the cache's stats)."""
    rng = random.Random(seed)
    first = _prompt(rng, vocab, p1)
    eng = _engine(lm, **sched)
    try:
        answer = run_alone(eng, greedy("t1", first, a1)).tokens
        second = first + answer + _prompt(rng, vocab, 9)
        got = run_alone(eng, greedy("t2", second, 24))
        stats = eng.stats().prefix_cache
    finally:
        eng.stop()
    plain = _engine(lm, prefix_bytes=0, **sched)
    try:
        ref = run_alone(plain, greedy("t2", second, 24))
    finally:
        plain.stop()
    assert ref.events[-1].num_cached_tokens == 0
    return first, answer, got, ref, stats


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "qwen3"])
def test_next_turn_restores_through_the_previous_answer(arch):
    """llama and gemma3 have sliding-window layers of 24 (ring wrapped long before the answer
    ends), qwen3 full attention only."""
    model, cfg = tiny_model(arch)
    lm = loaded(model, cfg)
    first, answer, got, ref, stats = _two_turns(lm, cfg["vocab_size"], 37, 50, seed=1)
    assert len(answer) == 50
    # the last sampled token's KV may not exist yet (a synchronous last step): at most one
    # token short, then whole blocks only
    floor = (len(first) + len(answer) - 1) // BLOCK * BLOCK
    assert floor > (len(first) - 1) // BLOCK * BLOCK  # beyond what the prompt alone gave
    assert got.events[-1].num_cached_tokens >= floor
    assert got.tokens == ref.tokens
    assert stats is not None and stats.hits >= 1


def test_ring_wrapped_by_the_answer_restores_at_the_answer_end():
    """A 4-token prompt and a 70-token answer on window-24 rings: nothing of the prompt's
    blocks is in the ring at the end, the hit comes from the answer's blocks alone."""
    model, cfg = tiny_model("llama", seed=3)
    lm = loaded(model, cfg)
    first, answer, got, ref, _ = _two_turns(lm, cfg["vocab_size"], 4, 70, seed=2)
    assert got.events[-1].num_cached_tokens >= (len(first) + len(answer) - 1) // BLOCK * BLOCK
    assert got.tokens == ref.tokens


def test_stop_token_is_part_of_the_cached_sequence():
    """A row that ends on its stop token fed that token (pipelined step) or at least sampled it;
    a next turn that re-sends answer + stop token restores through the answer."""
    model, cfg = tiny_model("qwen3", seed=4)
    rng = random.Random(5)
    first = _prompt(rng, cfg["vocab_size"], 40)
    probe = _engine(loaded(model, cfg))
    try:
        ref_answer = run_alone(probe, greedy("p", first, 40)).tokens
    finally:
        probe.stop()
    stop = ref_answer[30]
    cut = ref_answer.index(stop)
    lm = loaded(model, cfg, eos=(stop,))
    eng = _engine(lm)
    try:
        res = run_alone(eng, greedy("t1", first, 40))
        assert res.finish == "stop" and res.tokens == ref_answer[:cut]
        second = first + res.tokens + [stop] + _prompt(rng, cfg["vocab_size"], 5)
        got = run_alone(eng, greedy("t2", second, 8))
    finally:
        eng.stop()
    assert got.events[-1].num_cached_tokens >= (len(first) + cut) // BLOCK * BLOCK


def test_aborted_and_failed_rows_store_nothing_beyond_the_prompt():
    model, cfg = tiny_model("qwen3", seed=6)
    lm = loaded(model, cfg)
    rng = random.Random(7)
    first = _prompt(rng, cfg["vocab_size"], 20)
    eng = _engine(lm)
    try:
        c = submit(eng, greedy("t1", first, 400))
        while len(c.tokens) < 40 and not c.done.is_set():
            c.done.wait(0.01)
        eng.abort("t1")
        assert c.done.wait(60) and c.finish == "abort"
        seen = c.tokens[:32]
        got = run_alone(eng, greedy("t2", first + seen + [5, 6, 7], 4))
    finally:
        eng.stop()
    assert got.events[-1].num_cached_tokens == (len(first) - 1) // BLOCK * BLOCK


def test_finished_rows_stay_inside_the_byte_budget():
    model, cfg = tiny_model("llama")
    lm = loaded(model, cfg)
    budget = 48 * 1024
    eng = _engine(lm, prefix_bytes=budget)
    rng = random.Random(8)
    try:
        for i in range(6):
            run_alone(eng, greedy(f"r{i}", _prompt(rng, cfg["vocab_size"], 30), 60))
            mx.synchronize()
            assert eng.stats().prefix_cache.bytes <= budget
        assert eng.stats().prefix_cache.evicted_blocks > 0
    finally:
        eng.stop()


def test_batched_rows_finishing_at_different_steps_each_store_their_own_sequence():
    """Eight rows decoding together finish at different lengths; each next turn restores its
    own conversation exactly (rows are dropped from the batch after their KV was taken)."""
    model, cfg = tiny_model("llama", seed=9)
    lm = loaded(model, cfg)
    rng = random.Random(10)
    firsts = [_prompt(rng, cfg["vocab_size"], 20 + 3 * i) for i in range(8)]
    eng = _engine(lm)
    try:
        runs = [submit(eng, greedy(f"a{i}", p, 30 + 5 * i)) for i, p in enumerate(firsts)]
        for r in runs:
            assert r.done.wait(120)
        seconds = [p + r.tokens + [4, 5] for p, r in zip(firsts, runs, strict=True)]
        got = [run_alone(eng, greedy(f"b{i}", s, 6)) for i, s in enumerate(seconds)]
    finally:
        eng.stop()
    plain = _engine(lm, prefix_bytes=0)
    try:
        ref = [run_alone(plain, greedy(f"b{i}", s, 6)).tokens for i, s in enumerate(seconds)]
    finally:
        plain.stop()
    for i, (g, s) in enumerate(zip(got, seconds, strict=True)):
        assert g.events[-1].num_cached_tokens >= (len(s) - 3) // BLOCK * BLOCK, i
        assert g.tokens == ref[i], i


def test_recurrent_hybrid_restores_at_a_boundary_captured_while_decoding():
    """qwen3_next (gated-DeltaNet + full attention): the recurrent state exists only at the
    row's current length, so the answer's boundaries are captured as the row passes them; the
    next turn restores at the last one and decodes exactly as a fresh prefill."""
    from tests.tiny_archs import TINY_CONFIGS as REGISTRY_TINY
    from tests.tiny_archs import tiny_model as registry_tiny

    mx.disable_compile()  # compiled helpers JIT per shape on CPU (slow); same answers
    try:
        cfg = dict(REGISTRY_TINY["qwen3_next"])
        lm = loaded(registry_tiny("qwen3_next", seed=2), cfg)
        first, answer, got, ref, _ = _two_turns(lm, cfg["vocab_size"], 37, 30, seed=3)
    finally:
        mx.enable_compile()
    assert got.events[-1].num_cached_tokens >= (len(first) + len(answer) - 1) // BLOCK * BLOCK
    assert got.tokens == ref.tokens


def test_divergence_inside_a_wrapped_answer_keeps_the_hit_up_to_it():
    """The next turn re-renders the answer differently from token 41 on (a template that edits
    it): the ring layers' blocks near that point were captured while decoding, so the hit
    reaches the last block boundary before the divergence."""
    model, cfg = tiny_model("llama", seed=3)
    lm = loaded(model, cfg)
    rng = random.Random(11)
    first = _prompt(rng, cfg["vocab_size"], 4)
    eng = _engine(lm)
    try:
        answer = run_alone(eng, greedy("t1", first, 70)).tokens
        edited = [t + 1 if t + 1 < cfg["vocab_size"] else 3 for t in answer[41:]]
        second = first + answer[:41] + edited + [7, 8]
        got = run_alone(eng, greedy("t2", second, 16))
    finally:
        eng.stop()
    plain = _engine(lm, prefix_bytes=0)
    try:
        ref = run_alone(plain, greedy("t2", second, 16))
    finally:
        plain.stop()
    assert got.events[-1].num_cached_tokens == (len(first) + 41) // BLOCK * BLOCK
    assert got.tokens == ref.tokens


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_requests_arriving_together_share_the_first_ones_prefix(arch):
    """Three long prompts with a common 80-token system prompt reach the engine in one burst
    (queued before its thread runs, so the first lookups all miss): each starts after the one
    before it has stored its blocks, and finds the shared prefix then. Greedy tokens equal
    each prompt alone with the cache off; the counters count each row once."""
    model, cfg = tiny_model(arch, seed=9)
    lm = loaded(model, cfg)
    rng = random.Random(10)
    system = _prompt(rng, cfg["vocab_size"], 80)
    prompts = [system + _prompt(rng, cfg["vocab_size"], 30 + 7 * i) for i in range(3)]
    eng = Engine(lm, EngineConfig(SchedulerConfig(prefill_chunk=32), prefix_cache_bytes=64 << 20,
                                  prefix_block_size=BLOCK))
    runs = [submit(eng, greedy(f"s{i}", p, 12)) for i, p in enumerate(prompts)]
    eng.start()
    try:
        for c in runs:
            assert c.done.wait(120)
        stats = eng.stats().prefix_cache
    finally:
        eng.stop()
    cached = sorted(c.events[-1].num_cached_tokens for c in runs)
    assert cached[0] == 0 and cached[1] >= len(system) // BLOCK * BLOCK
    assert stats is not None and stats.queries == 3 and stats.hits == 2
    assert stats.hit_tokens == sum(cached)
    plain = _engine(lm, prefix_bytes=0, prefill_chunk=32)
    try:
        for c, p in zip(runs, prompts, strict=True):
            assert c.tokens == run_alone(plain, greedy("ref", p, 12)).tokens
    finally:
        plain.stop()
