"""CUDA's stable prefill shapes (engine/runner.py), exercised on the CPU by forcing them on.

With stable shapes the last prefill chunk is right-padded to a power-of-two width and the keys are
widened to the layout's capacity; the tokens must be exactly those of the plain path, for rows of
any length alone and batched, across sliding-window rings, with chunking, the prefix cache and
quantized KV.
"""

from __future__ import annotations

import random

import pytest

import engine.runner as runner_mod
from engine.core import Engine, EngineConfig
from engine.kvcache import KVConfig
from engine.runner import bucket_width
from engine.scheduler import SchedulerConfig
from tests.tiny_models import greedy, loaded, submit, tiny_model


def test_bucket_width():
    assert [bucket_width(w, 512) for w in (1, 15, 16, 17, 100, 300, 512)] == [16, 16, 16, 32, 128, 512, 512]
    assert bucket_width(200, 240) == 240  # never past the scheduler's chunk
    assert bucket_width(240, 240) == 240
    assert bucket_width(5, 4) == 5  # never narrower than the chunk itself


def _run(lm, prompts, stable, monkeypatch, kv_bits=16, prefix=0, chunk=32, together=True):
    monkeypatch.setattr(runner_mod, "wide_enabled", lambda: stable)
    monkeypatch.setenv("MLXD_STABLE_SHAPES", "1")  # opt-in; wide_enabled() stands for CUDA
    cfg = EngineConfig(SchedulerConfig(prefill_chunk=chunk), kv=KVConfig(kv_bits=kv_bits, kv_group_size=32),
                       prefix_cache_bytes=prefix)
    eng = Engine(lm, cfg)
    assert eng.runner.stable_shapes is stable
    assert (eng.runner.warmup_seconds > 0) is stable
    eng.start()
    try:
        outs = []
        if together:
            cs = [submit(eng, greedy(f"r{i}", p, 12)) for i, p in enumerate(prompts)]
            for c in cs:
                assert c.done.wait(120)
            outs = [c.tokens for c in cs]
        else:
            for i, p in enumerate(prompts):
                c = submit(eng, greedy(f"r{i}", p, 12))
                assert c.done.wait(120)
                outs.append(c.tokens)
        return outs
    finally:
        eng.stop()


@pytest.mark.parametrize("arch,kv_bits", [("llama", 16), ("gemma3_text", 16), ("llama", 8)])
def test_stable_shapes_give_the_same_tokens(arch, kv_bits, monkeypatch):
    model, cfg = tiny_model(arch, **({"head_dim": 32} if kv_bits < 16 else {}))
    lm = loaded(model, cfg)
    rng = random.Random(1)
    # lengths around the buckets, past the 24-token window and over several 32-token chunks
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (2, 9, 17, 33, 70, 101)]
    ref = _run(lm, prompts, False, monkeypatch, kv_bits=kv_bits)
    assert _run(lm, prompts, True, monkeypatch, kv_bits=kv_bits) == ref
    alone = _run(lm, prompts, True, monkeypatch, kv_bits=kv_bits, together=False)
    assert alone == ref


def test_stable_shapes_with_the_prefix_cache(monkeypatch):
    model, cfg = tiny_model("llama")
    lm = loaded(model, cfg)
    rng = random.Random(2)
    shared = [rng.randrange(3, 500) for _ in range(80)]
    prompts = [shared + [rng.randrange(3, 500) for _ in range(n)] for n in (3, 21, 40)]
    ref = _run(lm, prompts, False, monkeypatch, together=False)
    got = _run(lm, prompts, True, monkeypatch, prefix=1 << 26, together=False)
    assert got == ref


def test_stable_shapes_are_opt_in(monkeypatch):
    monkeypatch.setattr(runner_mod, "wide_enabled", lambda: True)  # as on CUDA
    monkeypatch.delenv("MLXD_STABLE_SHAPES", raising=False)
    model, cfg = tiny_model("llama")
    assert runner_mod.Runner(model).stable_shapes is False
    monkeypatch.setenv("MLXD_STABLE_SHAPES", "1")
    assert runner_mod.Runner(model).stable_shapes is True
    monkeypatch.setattr(runner_mod, "wide_enabled", lambda: False)  # CPU / Metal: never
    assert runner_mod.Runner(model).stable_shapes is False
