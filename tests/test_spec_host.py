"""The cheaper host paths of a speculative round give the same state and verdicts.

* `KVLayout.append_columns` (the ring commit of a verify round) leaves every layout kind
  (plain / rotating / quantized / rotating quantized, sink columns, rings that wrap, ragged
  and equal keeps, one and several rows) exactly as `prepare(lengths=keep)` + the chunk +
  `finalize` does: the same positions per row and the same values in those columns.
* The host-side greedy verdict equals the device one (`accept.verify`'s greedy fast path).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.kv.attention import (
    PlainLayout,
    QuantizedLayout,
    QuantizedRotatingLayout,
    RotatingLayout,
)
from engine.sampling import SamplerState
from engine.spec.accept import greedy_verdict_host, verify

SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
KINDS = {
    "plain": lambda: PlainLayout(0),
    "rotating": lambda: RotatingLayout(0, window=8),
    "rotating_sink": lambda: RotatingLayout(0, window=8, keep=2),
    "quantized": lambda: QuantizedLayout(0, bits=8, group_size=32),
    "rotating_quantized": lambda: QuantizedRotatingLayout(0, window=8, bits=8, group_size=32),
}
H, D = 2, 32


def _fill(layout, lengths: list[int], rng: np.random.Generator) -> None:
    """Rows of the given lengths (right-padded prefill of random keys)."""
    rows = [type(layout)(1, **layout._params()) for _ in lengths]
    for r, n in zip(rows, lengths, strict=True):
        k = mx.array(rng.standard_normal((1, H, n, D)).astype(np.float32))
        v = mx.array(rng.standard_normal((1, H, n, D)).astype(np.float32))
        r.update_and_fetch(k, v)
    layout.merge(rows)


def _row_state(layout, i: int) -> tuple[list[int], list[np.ndarray]]:
    pos, cols = layout.row_positions(i)
    bufs = [np.array(b[i][:, cols.tolist()].astype(mx.float32)) for b in layout.state]
    return pos.tolist(), bufs


@pytest.mark.parametrize("kind", sorted(KINDS))
@given(
    lengths=st.lists(st.integers(1, 30), min_size=1, max_size=4),
    width=st.integers(2, 6),
    data=st.data(),
)
@SETTINGS
def test_append_columns_equals_the_general_path(kind, lengths, width, data):
    rng = np.random.default_rng(len(lengths) * 100 + width)
    equal = data.draw(st.booleans())
    if equal:
        keep = [data.draw(st.integers(1, width))] * len(lengths)
    else:
        keep = data.draw(st.lists(st.integers(1, width), min_size=len(lengths),
                                  max_size=len(lengths)))
    a, b = KINDS[kind](), KINDS[kind]()
    _fill(a, lengths, np.random.default_rng(1))
    _fill(b, lengths, np.random.default_rng(1))
    k = mx.array(rng.standard_normal((len(lengths), H, width, D)).astype(np.float32))
    v = mx.array(rng.standard_normal((len(lengths), H, width, D)).astype(np.float32))
    a.prepare(lengths=keep)
    a.update_and_fetch(k, v)
    a.finalize()
    memo: dict = {}
    b.append_columns(k, v, np.array(keep), memo)
    assert a.num_tokens == b.num_tokens
    for i in range(len(lengths)):
        pa, ba = _row_state(a, i)
        pb, bb = _row_state(b, i)
        assert pa == pb
        for x, y in zip(ba, bb, strict=True):
            np.testing.assert_array_equal(x, y)
    # the layout decodes on as before (one more plain column)
    k1 = mx.array(rng.standard_normal((len(lengths), H, 1, D)).astype(np.float32))
    ka, _ = a.update_and_fetch(k1, k1)
    kb, _ = b.update_and_fetch(k1, k1)
    assert a.num_tokens == b.num_tokens


@given(
    rows=st.integers(1, 5),
    width=st.integers(1, 9),
    vocab=st.sampled_from([5, 64]),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=60, deadline=None, derandomize=True)
def test_host_greedy_verdict_equals_the_device_one(rows, width, vocab, seed):
    rng = np.random.default_rng(seed)
    logits = mx.array(rng.standard_normal((rows, width, vocab)).astype(np.float32))
    plain = np.array(mx.argmax(logits, axis=-1))
    K = width - 1
    drafts = plain[:, :K].copy()  # mostly right, some wrong
    flip = rng.random((rows, K)) < 0.3
    drafts[flip] = (drafts[flip] + 1) % vocab
    num = rng.integers(0, K + 1, rows)
    state = SamplerState.from_params([_greedy()] * rows, [[1]] * rows, vocab, list(range(rows)))
    ref = verify(logits, [state], mx.array(drafts.astype(np.int32)),
                 mx.array(num.astype(np.int32)))
    acc, last = greedy_verdict_host(plain, drafts, num)
    np.testing.assert_array_equal(acc, np.array(ref.num_accepted))
    np.testing.assert_array_equal(last, np.array(ref.last))


def _greedy():
    from engine.api import SamplingParams

    return SamplingParams(temperature=0.0)


def _spec_engine_outputs(lm, spec, reqs):
    from engine.core import Engine, EngineConfig
    from engine.scheduler import SchedulerConfig
    from tests.tiny_models import submit

    eng = Engine(lm, EngineConfig(SchedulerConfig(prefill_chunk=32), spec=spec))
    dec = eng.spec
    fresh = eng.stats()
    eng.start()
    try:
        outs = {r.req_id: submit(eng, r) for r in reqs}
        for r in reqs:
            assert outs[r.req_id].done.wait(300), r.req_id
        stats = eng.stats()
    finally:
        eng.stop()
    assert stats.num_running == 0 and stats.kv_bytes == 0
    return {k: v.tokens for k, v in outs.items()}, stats.spec, fresh, dec


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_warm_up_leaves_nothing_behind_and_outputs_stay_exact(method):
    """`SpecConfig(warmup=True)` forces the GPU start-up rounds on a CPU: one round per verify
    width on a throwaway row; afterwards the engine holds no rows and no KV, its statistics
    are untouched, and greedy speculative output still equals plain output."""
    from engine.spec import SpecConfig
    from tests.test_spec_engine import _perturbed, _repetitive_prompts
    from tests.tiny_models import assert_same_greedy, greedy, loaded, on_gpu, tiny_model

    model, cfg = tiny_model("llama")
    lm = loaded(model, cfg)
    prompts = _repetitive_prompts(cfg["vocab_size"], 3, seed=3)
    reqs = [greedy(f"r{i}", p, max_tokens=30 + 7 * i) for i, p in enumerate(prompts)]
    want, _, _, _ = _spec_engine_outputs(lm, None, reqs)
    draft = _perturbed(model, cfg, 0.01, seed=1) if method == "draft" else None
    K = 3
    outs = {}
    for warm in (False, True):
        spec = SpecConfig(method, draft_model=draft, num_draft_tokens=K, adaptive=False,
                          warmup=warm)
        got, st, fresh, dec = _spec_engine_outputs(lm, spec, reqs)
        for r in reqs:
            assert_same_greedy(lm, r, got[r.req_id], want[r.req_id], (method, warm, r.req_id))
        outs[warm] = st
        assert st.method == method
        assert fresh.num_running == 0 and fresh.kv_bytes == 0
        if warm:
            assert dec.warmup_seconds > 0
            assert sorted(st.warmup_ms_by_width) == [str(w) for w in range(2, K + 2)]
        else:
            assert dec.warmup_seconds == 0 and st.warmup_s == 0 and not st.warmup_ms_by_width
    if on_gpu():
        return  # GPU near-ties may change the rounds; the counts below hold on the CPU
    for key in ("spec_steps", "drafted_tokens", "accepted_tokens", "expected_tokens_per_round"):
        assert getattr(outs[True], key) == getattr(outs[False], key), key
    if method == "draft":
        assert outs[True].drafter["fed_tokens"] == outs[False].drafter["fed_tokens"]


def test_warm_up_is_off_on_a_cpu_by_default():
    from engine.core import Engine, EngineConfig
    from engine.scheduler import SchedulerConfig
    from engine.spec import SpecConfig
    from kernels.common import gpu_backend
    from tests.tiny_models import loaded, tiny_model

    if gpu_backend() is not None:
        pytest.skip("a GPU is the default device")
    model, cfg = tiny_model("llama")
    eng = Engine(loaded(model, cfg), EngineConfig(SchedulerConfig(), spec=SpecConfig("ngram")))
    assert eng.spec.warmup_seconds == 0 and not eng.spec.warmup_ms


def test_warm_up_on_a_tiny_vocabulary():
    """The warm-up's prompt stays inside the vocabulary (8 tokens here)."""
    from engine.spec import SpecConfig
    from tests.test_spec_engine import _perturbed
    from tests.tiny_models import greedy, loaded, tiny_model

    model, cfg = tiny_model("llama", vocab_size=8)
    lm = loaded(model, cfg)
    reqs = [greedy("r0", [1, 2, 3, 1, 2, 3, 1, 2], max_tokens=12)]
    want, _, _, _ = _spec_engine_outputs(lm, None, reqs)
    for method in ("ngram", "draft"):
        draft = _perturbed(model, cfg, 0.01, seed=1) if method == "draft" else None
        spec = SpecConfig(method, draft_model=draft, num_draft_tokens=3, adaptive=False,
                          warmup=True)
        got, st, _, dec = _spec_engine_outputs(lm, spec, reqs)
        assert dec.warmup_ms and len(got["r0"]) == 12
