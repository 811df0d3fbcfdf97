"""The first token comes from the prefill: a prompt's last chunk computes the logits at each
row's last prompt token only (engine.models.heads) and samples from them, and the engine
reports that token in the step the prefill completes, not one decode step later: the moment it
is read, before the step stores the prompt's blocks and launches the next decode."""

from __future__ import annotations

import random
import threading

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from engine.api import Request, SamplingParams
from engine.core import Engine, EngineConfig
from engine.models import ARCHITECTURES
from engine.models.heads import decoder_owner, logits_at
from engine.scheduler import SchedulerConfig
from tests.tiny_archs import tiny_model
from tests.tiny_models import greedy, greedy_deviations, loaded, make_engine, run_alone, submit
from tests.tiny_models import tiny_model as tiny_llama


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_logits_at_equal_the_full_logits_at_those_positions(arch):
    model = tiny_model(arch, seed=3)
    owner = decoder_owner(model)
    assert owner is not None, "every registered architecture has a decoder stack to gather"
    stack, keys = owner["model"], list(owner.keys())
    ids = mx.array([[5, 9, 13, 17, 21, 25, 29], [7, 11, 15, 19, 23, 27, 31]], dtype=mx.int32)
    full = model(ids, cache=make_prompt_cache(model)).astype(mx.float32)
    rows, cols = mx.array([0, 1, 1], dtype=mx.int32), mx.array([6, 3, 0], dtype=mx.int32)
    cache = make_prompt_cache(model)
    got = logits_at(model, lambda: model(ids, cache=cache), rows, cols).astype(mx.float32)
    assert got.shape == (3, full.shape[-1])
    assert mx.allclose(got, full[rows, cols], atol=1e-4, rtol=1e-4).item()
    assert owner["model"] is stack and list(owner.keys()) == keys  # the tree is as it was


def test_a_model_without_a_decoder_stack_gets_its_full_logits_sliced():
    class Bare:  # no `model` entry: nothing to swap
        def get(self, key):
            return None

    logits = mx.arange(2 * 3 * 4, dtype=mx.float32).reshape(2, 3, 4)
    got = logits_at(Bare(), lambda: logits, mx.array([1, 0]), mx.array([2, 1]))  # type: ignore[arg-type]
    assert got.tolist() == [logits[1, 2].tolist(), logits[0, 1].tolist()]


def _steps_until(eng: Engine, done) -> int:
    steps = 0
    while not done():
        eng.turn()
        steps += 1
        assert steps < 200
    return steps


def test_the_first_token_is_out_in_the_step_the_prefill_completes():
    """With rows decoding (a pipelined step in flight), a new prompt's first token is reported
    by the step that prefills it; its greedy output is the model's own (teacher-forced), and
    the rows already decoding are not disturbed."""
    model, cfg = tiny_llama("llama")
    lm = loaded(model, cfg)
    eng = Engine(lm, EngineConfig(SchedulerConfig(prefill_chunk=32)))
    busy = submit(eng, greedy("busy", list(range(3, 20)), 30))
    _steps_until(eng, lambda: len(busy.tokens) >= 3)
    assert eng.runner.in_flight
    def prefills() -> int:
        return sum(n for (kind, _, _), n in eng.runner.shapes.items() if kind == "prefill")

    prompt = [(7 * j) % 500 + 3 for j in range(45)]
    new = submit(eng, greedy("new", prompt, 12))
    before = prefills()
    steps = _steps_until(eng, lambda: bool(new.tokens))
    assert steps == prefills() - before  # every step prefilled: out with its last chunk
    assert len(new.tokens) == 1
    while eng.has_pending():
        eng.turn()
    assert len(new.tokens) == 12 and len(busy.tokens) == 30
    assert greedy_deviations(model, prompt, new.tokens)[0] == 0
    assert greedy_deviations(model, list(range(3, 20)), busy.tokens)[0] == 0


def test_first_tokens_of_a_group_sampled_seeded_with_logprobs():
    """A group of rows of different lengths (right-padded) samples every row's first token at
    its own last position: seeded rows give the same tokens and logprobs alone and in the
    group, and the first event carries the first token's logprobs."""
    model, cfg = tiny_llama("llama")
    lm = loaded(model, cfg)

    def req(i: int) -> Request:
        params = SamplingParams(temperature=0.9, seed=100 + i, max_tokens=6, logprobs=True,
                                top_logprobs=2)
        return Request(f"r{i}", [(11 * i + 5 * j) % 500 + 3 for j in range(5 + 4 * i)], params)

    def run(reqs: list[Request]) -> dict:
        eng = Engine(lm, EngineConfig(SchedulerConfig(prefill_chunk=64)))
        outs = {r.req_id: submit(eng, r) for r in reqs}
        while eng.has_pending():
            eng.turn()
        return outs

    together = run([req(i) for i in range(4)])
    for i in range(4):
        alone = run([req(i)])[f"r{i}"]
        got = together[f"r{i}"]
        assert got.tokens == alone.tokens and len(got.tokens) == 6
        first = got.events[0]
        assert first.token_ids == got.tokens[:1]
        assert first.logprobs is not None and len(first.logprobs) == 1 and first.logprobs[0] <= 0
        assert first.top_logprobs is not None and len(first.top_logprobs[0]) == 2
        lps = [lp for ev in got.events for lp in (ev.logprobs or [])]
        assert lps == pytest.approx([lp for ev in alone.events for lp in (ev.logprobs or [])],
                                    abs=1e-4)


def test_no_decode_step_is_launched_past_every_row_s_last_token():
    """A request of max_tokens n costs its prefill and n - 1 decode forwards: once every row's
    last token is computed (in flight, or the prefill's), nothing more is launched, so the next
    request does not wait for a step whose tokens would be thrown away."""
    model, cfg = tiny_llama("llama")
    eng = Engine(loaded(model, cfg), EngineConfig(SchedulerConfig(prefill_chunk=32)))

    def decodes() -> int:
        return sum(n for (kind, _, _), n in eng.runner.shapes.items() if kind == "decode")

    for n in (1, 2, 6):
        before = decodes()
        out = submit(eng, greedy(f"n{n}", [3, 8, 13, 18, 23], n))
        while eng.has_pending():
            eng.turn()
        assert len(out.tokens) == n and out.finish == "length"
        assert decodes() - before == n - 1, n
        assert not eng.runner.in_flight
    # two rows of different limits: the batch runs until the longer one's last token
    before = decodes()
    a = submit(eng, greedy("a", [3, 8, 13], 3))
    b = submit(eng, greedy("b", [4, 9, 14], 7))
    while eng.has_pending():
        eng.turn()
    assert len(a.tokens) == 3 and len(b.tokens) == 7
    assert decodes() - before == 6


def test_first_token_goes_out_before_the_step_stores_and_launches(tinycoder_path):
    """A prompt's first token reaches its client as soon as the prefill's last chunk is read:
    before that chunk's blocks go into the prefix cache and before the row's first decode step
    is launched; the output is the same as a run alone, and a prompt that ends at its first
    token is stored all the same."""
    from engine.loader import load_model

    lm = load_model(str(tinycoder_path), dtype="float32")
    lm.eos_token_ids = ()
    eng = Engine(lm, EngineConfig(SchedulerConfig()))
    order: list[str] = []
    store, launch = eng.prefix.store, eng.runner._launch

    def stored(*args, **kwargs):
        order.append("store")
        return store(*args, **kwargs)

    def launched(*args, **kwargs):
        order.append("launch")
        return launch(*args, **kwargs)

    eng.prefix.store = stored  # type: ignore[method-assign]
    eng.runner._launch = launched  # type: ignore[method-assign]
    chunk = eng.prefix.chunk
    rng = random.Random(3)
    prompt = [rng.randrange(3, 4000) for _ in range(2 * chunk + 5)]

    tokens: list[int] = []
    done = threading.Event()

    def sink(events) -> None:
        for e in events:
            if e.token_ids and not tokens:
                order.append("token")
            tokens.extend(e.token_ids)
            if e.finish_reason is not None:
                done.set()

    eng.add(greedy("r", prompt, 4), sink)
    eng.start()
    try:
        assert done.wait(300)
    finally:
        eng.stop()
    # a store per chunk, the first token, the last chunk's store, then the decode launch
    first = order.index("token")
    assert order[:first] == ["store"] * first and first >= 2
    assert order[first + 1] == "store" and "launch" in order[first + 2 :]
    alone = make_engine(lm)
    try:
        assert tokens == run_alone(alone, greedy("alone", prompt, 4)).tokens
    finally:
        alone.stop()

    one = Engine(lm, EngineConfig(SchedulerConfig()))
    one.start()
    try:
        assert run_alone(one, greedy("a", prompt, 1)).tokens == tokens[:1]
        assert one.stats().prefix_cache.blocks >= len(prompt) // one.prefix.block_size
    finally:
        one.stop()
