"""A long prompt with nothing decoding is prefilled in the idle chunk (engine.scheduler,
`size_idle_chunk`): the same greedy tokens as in `prefill_chunk` chunks (the exact tier, float32),
the idle width warmed at start-up, and the chunks down to the prefill budget once rows decode."""

from __future__ import annotations

import random

from engine.core import Engine, EngineConfig
from engine.scheduler import SchedulerConfig
from tests.tiny_models import greedy, loaded, run_alone, submit, tiny_model

CHUNK = 64


def _engine(idle_rate: float | None, prefix: bool = True, budget: int | None = None) -> Engine:
    model, cfg = tiny_model("llama", layer_types=["full_attention"] * 4)  # no ring: no limit
    sched = SchedulerConfig(prefill_chunk=CHUNK, prefill_budget=budget)
    eng = Engine(loaded(model, cfg), EngineConfig(sched,
                                                  prefix_cache_bytes=(1 << 26) if prefix else 0))
    if idle_rate is not None:  # what a warm-up measuring this rate would set
        eng.scheduler.size_idle_chunk(idle_rate)
        eng.warm_chunks()
    return eng


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 200) for _ in range(n)]


def test_idle_chunks_give_the_same_tokens_and_fewer_forwards():
    prompt = _prompt(9 * CHUNK + 5, 0)
    plain = _engine(None)
    big = _engine(8 * CHUNK / 0.2)  # an idle chunk of 8 chunks
    assert big.scheduler.idle_chunk == 8 * CHUNK
    assert big.runner.shapes[("prefill", 1, 8 * CHUNK)] == 1  # warmed at start-up
    for eng in (plain, big):
        eng.start()
    try:
        want = run_alone(plain, greedy("a", prompt, 24)).tokens
        got = run_alone(big, greedy("a", prompt, 24)).tokens
    finally:
        plain.stop()
        big.stop()
    assert got == want and len(want) == 24
    assert plain.runner.shapes[("prefill", 1, CHUNK)] == 9  # 9 whole chunks, then the rest
    assert big.runner.shapes[("prefill", 1, 8 * CHUNK)] == 2  # the warm-up's and the prompt's


def test_rows_decoding_take_long_prompts_in_chunks_of_the_prefill_budget():
    """A long prompt that arrives while a row decodes runs in chunks of the prefill budget (2
    chunks here; 8 when idle), and both rows' tokens are those they get alone."""
    eng = _engine(8 * CHUNK / 0.2, prefix=False, budget=2 * CHUNK)
    assert eng.runner.shapes[("prefill", 1, 2 * CHUNK)] == 1  # the busy width warmed too
    long_prompt, short_prompt = _prompt(6 * CHUNK + 1, 1), _prompt(10, 2)
    eng.start()
    try:
        alone_long = run_alone(eng, greedy("l0", long_prompt, 16)).tokens
        alone_short = run_alone(eng, greedy("s0", short_prompt, 200)).tokens
        before = eng.runner.shapes[("prefill", 1, 2 * CHUNK)]
        short = submit(eng, greedy("s1", short_prompt, 200))
        while not short.tokens:
            short.done.wait(0.01)
        long = run_alone(eng, greedy("l1", long_prompt, 16))
        assert short.done.wait(120)
    finally:
        eng.stop()
    assert long.tokens == alone_long and short.tokens == alone_short
    assert eng.runner.shapes[("prefill", 1, 2 * CHUNK)] - before == 3
