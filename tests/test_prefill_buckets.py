"""Bucketed prefill shapes (engine.runner.buckets_prefill_shapes, on MLX-CUDA for models whose
layouts are all full attention), forced on here on the CPU: a group's last chunk is padded to
`bucketed_width` and prefix-cache hits are used in multiples of `BUCKET_HIT_TOKENS`, and the
greedy output is the same as without, token for token, for prompts alone, over cached
prefixes, in chunks and grouped."""

from __future__ import annotations

import random

import pytest

from engine.core import Engine, EngineConfig
from engine.runner import BUCKET_HIT_TOKENS, BUCKET_MIN_WIDTH, bucketed_width
from engine.scheduler import SchedulerConfig
from tests.tiny_models import greedy, loaded, submit, tiny_model


def test_bucketed_widths_are_few_and_pad_at_most_a_quarter():
    assert bucketed_width(BUCKET_MIN_WIDTH - 1) == BUCKET_MIN_WIDTH - 1
    widths = {bucketed_width(w) for w in range(BUCKET_MIN_WIDTH, 8192)}
    assert len(widths) == 4 * 5 + 1  # four an octave from 256, and 8192 itself
    for w in range(BUCKET_MIN_WIDTH, 8192):
        assert w <= bucketed_width(w) <= w * 1.25


def _run(arch: str, bucket: bool, waves: list[list[list[int]]], **overrides):
    model, cfg = tiny_model(arch, max_position_embeddings=8192, **overrides)
    eng = Engine(loaded(model, cfg), EngineConfig(SchedulerConfig(prefill_budget=1024),
                                                  prefix_cache_bytes=1 << 30))
    if bucket:
        eng.runner.bucket_widths = True
        eng.prefix.hit_blocks = BUCKET_HIT_TOKENS // eng.prefix.block_size
    eng.start()
    tokens, cached = [], []
    try:
        for w, wave in enumerate(waves):  # a wave's prompts arrive together
            outs = [submit(eng, greedy(f"r{w}-{i}", p, 10)) for i, p in enumerate(wave)]
            for out in outs:
                assert out.done.wait(300)
                tokens.append(out.tokens)
                cached.append(out.events[-1].num_cached_tokens)
        widths = {s[2] for s in eng.runner.shapes if s[0] == "prefill"}
    finally:
        eng.stop()
    return tokens, cached, widths


@pytest.mark.parametrize("arch, overrides", [
    ("qwen3", {}),
    ("llama", {"layer_types": None, "sliding_window": None}),
])
def test_bucketed_prefill_gives_the_same_tokens(arch, overrides):
    rng = random.Random(0)
    base = [rng.randrange(3, 500) for _ in range(3000)]
    waves = [
        [base[:700]],
        [base[:1300], [rng.randrange(3, 500) for _ in range(300)]],  # over a hit, and fresh
        [base[:1300] + [5, 6, 7] * 100],
        [base[:2900]],  # chunks over a hit
        [base[:40], base[:90], [9] * 60],  # a group of short prompts (one right-padded forward)
    ]
    plain, _, _ = _run(arch, False, waves, **overrides)
    got, cached, widths = _run(arch, True, waves, **overrides)
    assert got == plain
    assert all(c % BUCKET_HIT_TOKENS == 0 for c in cached) and max(cached) >= 1024
    wide = {w for w in widths if w >= BUCKET_MIN_WIDTH}
    assert wide and all(bucketed_width(w) == w for w in wide)
    assert any(w != bucketed_width(w) for w in range(BUCKET_MIN_WIDTH, 3000))
