"""Exact tier: every row of a continuously batched run equals the same request run alone."""

from __future__ import annotations

import random

import pytest

from tests.tiny_models import greedy, loaded, make_engine, run_alone, submit, tiny_model


def _requests(vocab: int, n: int, seed: int, long_len: int) -> list:
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        plen = long_len if i % 4 == 1 else rng.randint(1, 40)
        prompt = [rng.randrange(3, vocab) for _ in range(plen)]
        reqs.append(greedy(f"r{i}", prompt, max_tokens=rng.randint(5, 60)))
    return reqs


def _check_batched_equals_alone(lm, reqs, **sched):
    eng = make_engine(lm, **sched)
    try:
        alone = {r.req_id: run_alone(eng, r).tokens for r in reqs}
        # Batched: the first half starts together; the rest join while those are decoding.
        first, rest = reqs[: len(reqs) // 2], reqs[len(reqs) // 2 :]
        outs = {r.req_id: submit(eng, r) for r in first}
        for r in rest:
            lead = outs[first[0].req_id]
            for _ in range(200):
                if len(lead.tokens) >= 3 or lead.done.is_set():
                    break
                lead.done.wait(0.01)
            outs[r.req_id] = submit(eng, r)
        for r in reqs:
            assert outs[r.req_id].done.wait(300)
        for r in reqs:
            assert outs[r.req_id].tokens == alone[r.req_id], r.req_id
            assert len(alone[r.req_id]) == r.params.max_tokens
        stats = eng.stats()
        assert stats.num_running == 0 and stats.kv_bytes == 0
    finally:
        eng.stop()


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "qwen3"])
def test_tiny_batched_equals_alone(arch):
    model, cfg = tiny_model(arch)
    lm = loaded(model, cfg)
    # long prompts (70 tokens) exceed the 24-token sliding window and the 32-token chunk
    _check_batched_equals_alone(lm, _requests(cfg["vocab_size"], 10, seed=1, long_len=70),
                                prefill_chunk=32, prefill_budget=256)


def test_bundled_model_batched_equals_alone(tinycoder_path):
    from engine.loader import load_model

    lm = load_model(str(tinycoder_path), dtype="float32")
    lm.eos_token_ids = ()  # run every row to its max_tokens
    _check_batched_equals_alone(lm, _requests(lm.vocab_size, 8, seed=2, long_len=300),
                                prefill_chunk=128)


def test_engine_matches_mlx_lm_greedy(tinycoder_path):
    """Our engine alone equals mlx-lm's own greedy generation (sanity against the reference)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from engine.loader import load_model

    lm = load_model(str(tinycoder_path), dtype="float32")
    prompt = lm.tokenizer.encode("def parse_args(argv):")
    ref = []
    for tok, _ in generate_step(mx.array(prompt), lm.model, max_tokens=300, sampler=lambda x: mx.argmax(x, axis=-1)):
        ref.append(int(tok))
    lm.eos_token_ids = ()
    eng = make_engine(lm)
    try:
        ours = run_alone(eng, greedy("a", prompt, 300)).tokens
    finally:
        eng.stop()
    assert ours == ref
