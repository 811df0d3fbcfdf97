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


class _BrokenMatcher:
    """A grammar matcher whose mask computation fails (the grammar engine erroring)."""

    def unsafe_compute_mask_ptr(self, *args, **kwargs):
        raise RuntimeError("matcher state corrupted")


class _BrokenConstraint:
    matcher = _BrokenMatcher()
    error = ""

    def consume(self, token: int) -> bool:
        return True

    def is_done(self) -> bool:
        return False


def test_a_bad_row_fails_alone_and_its_batch_mates_finish_as_alone():
    """One row whose grammar engine fails at mask time and one whose sampling settings the
    engine thread refuses (a logit_bias id past the vocabulary, which skipped the add-time
    checks) end with "error" and a message; the rows submitted together with them produce the
    tokens they produce alone, and the engine goes on serving."""
    from engine.api import Request, SamplingParams
    from engine.core import Engine, EngineConfig
    from engine.scheduler import SchedulerConfig
    from tests.tiny_models import Collected

    model, cfg = tiny_model("llama")
    lm = loaded(model, cfg)
    rng = random.Random(5)
    good = [greedy(f"g{i}", [rng.randrange(3, 500) for _ in range(9 + 5 * i)], 30) for i in range(3)]
    eng = make_engine(lm)
    try:
        alone = {r.req_id: run_alone(eng, r).tokens for r in good}
    finally:
        eng.stop()
    eng = Engine(lm, EngineConfig(SchedulerConfig()))
    real_compile = eng._compile_constraint
    eng._compile_constraint = lambda spec: _BrokenConstraint() if spec == "broken" else real_compile(spec)
    grammar = Request("bad-grammar", [7, 8, 9, 10], SamplingParams(temperature=0.0, max_tokens=30,
                                                                   constraint="broken"))
    bias = Request("bad-bias", [7, 8, 9], SamplingParams(temperature=0.0, max_tokens=30,
                                                         logit_bias={10**6: 1.0}))
    outs: dict[str, Collected] = {}
    for req in [good[0], grammar, good[1], bias, good[2]]:  # queued before the engine starts:
        out = outs[req.req_id] = Collected()  # they are prefilled and decoded as one batch

        def sink(events, out=out):
            for ev in events:
                out.events.append(ev)
                out.tokens.extend(ev.token_ids)
                if ev.finish_reason is not None:
                    out.finish = ev.finish_reason
                    out.done.set()

        row = eng._validate(req) if req is not bias else eng._validate(
            Request("bad-bias", req.prompt_ids, SamplingParams(temperature=0.0, max_tokens=30)))
        if req is bias:
            row.request = req  # past the add-time checks, as a caller's own RowMeta would be
        eng.enqueue(row, sink)
    eng.start()
    try:
        assert all(o.done.wait(120) for o in outs.values())
        for name, want in (("bad-grammar", "matcher state corrupted"), ("bad-bias", "logit_bias")):
            ev = outs[name].events[-1]
            assert outs[name].finish == "error" and want in (ev.error or ""), ev
        for r in good:
            assert outs[r.req_id].finish == "length"
            assert outs[r.req_id].tokens == alone[r.req_id], r.req_id
        assert eng.stats().last_error is None  # no step failed as a whole
        again = run_alone(eng, greedy("after", good[0].prompt_ids, 30))
        assert again.tokens == alone[good[0].req_id]
    finally:
        eng.stop()


def test_a_sink_that_raises_aborts_its_request_and_the_engine_serves_on():
    """A consumer whose sink raises (a server-side bug) loses its request, which leaves the
    batch at once; its batch mates finish as alone and the engine thread keeps serving."""
    model, cfg = tiny_model("llama")
    lm = loaded(model, cfg)
    eng = make_engine(lm)
    try:
        mate = greedy("mate", [5, 9, 13, 17], max_tokens=30)
        alone = run_alone(eng, mate).tokens
        calls = []

        def broken(events):
            calls.append(events)
            raise RuntimeError("consumer bug")

        eng.add(greedy("bad", [7, 11, 15], max_tokens=40), broken)
        out = submit(eng, greedy("mate", [5, 9, 13, 17], max_tokens=30))
        assert out.done.wait(120) and out.tokens == alone
        assert len(calls) == 1  # nothing after the failure
        later = run_alone(eng, greedy("later", [5, 9, 13, 17], max_tokens=30))
        assert later.tokens == alone
        stats = eng.stats()
        assert stats.num_running == 0 and stats.num_queued == 0 and stats.active_requests == 0
    finally:
        eng.stop()


def test_a_row_joins_into_the_slot_a_finished_row_left(monkeypatch):
    """When a row finishes, the batch keeps its slot free (the last row moves into it) and a
    row that joins later is written into the free slot instead of the whole batch being
    copied; every row still equals the same request alone."""
    from engine.core import Engine, EngineConfig
    from engine.kv.attention import KVLayout
    from engine.scheduler import SchedulerConfig
    from tests.tiny_models import drive

    model, cfg = tiny_model("llama")
    lm = loaded(model, cfg)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, cfg["vocab_size"]) for _ in range(9 + 4 * i)] for i in range(5)]
    reqs = [greedy(f"r{i}", p, 3 if i == 0 else 16) for i, p in enumerate(prompts)]
    alone = {r.req_id: drive(Engine(lm, EngineConfig(SchedulerConfig())), [r])[0].tokens
             for r in reqs}
    in_place = []
    write_rows = KVLayout._write_rows
    monkeypatch.setattr(KVLayout, "_write_rows",
                        lambda self, others: in_place.append(1) or write_rows(self, others))
    eng = Engine(lm, EngineConfig(SchedulerConfig()))
    outs = [submit(eng, r) for r in reqs[:4]]
    while not outs[0].done.is_set():
        eng.turn()
    assert not in_place
    outs.append(submit(eng, reqs[4]))
    while not all(o.done.is_set() for o in outs):
        eng.turn()
    assert in_place  # the late row was written into the slot r0 left
    assert {r.req_id: o.tokens for r, o in zip(reqs, outs, strict=True)} == alone
