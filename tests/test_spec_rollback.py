"""Rollback properties of every KV layout speculation uses, in the patterns it uses them.

For random rounds on tiny models (window 8, so rings wrap within a few rounds):

* target pattern — one forward over `[B, W]` (rows with fewer drafts padded), then each row
  keeps `accepted[b] + 1` columns (`rollback`);
* draft-model pattern — a right-padded first step (1..4 pending tokens per row), K - 1
  one-token steps, then each row keeps `pending[b] + min(accepted[b], K - 1)` columns;

after which every row's next logits equal those of a fresh one-row cache that was only ever fed
the kept tokens. Layouts: plain + rotating (llama: full and sliding layers), quantized plain +
quantized rotating (llama, 8-bit KV), recurrent + plain (qwen3_next, stepping mixers).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.kv import batch as kvb
from engine.models import make_batch_layouts, prepare_model
from tests.tiny_archs import tiny_model

SETTINGS = settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
MAX_K = 3
CASES = {  # name -> (architecture, KV bits)
    "plain+rotating": ("llama", 16),
    "quantized+rotating_quantized": ("llama", 8),
    "recurrent+plain": ("qwen3_next", 16),
}
_MODELS: dict[str, object] = {}


@pytest.fixture(scope="module", autouse=True)
def _no_compile():
    mx.disable_compile()  # compiled helpers JIT per shape on a CPU; same answers without
    yield
    mx.enable_compile()


@pytest.fixture(autouse=True)
def _quantized_kv_needs_quantized_attention(request):
    """MLX-CUDA 0.32.4 has no quantized_matmul for attention's shapes (the server refuses
    --kv-bits 8/4 there at start-up: engine.kv.batch.check_supported), so the quantized case
    runs on CPUs (and Metal) only."""
    from kernels.common import gpu_backend

    case = getattr(request.node, "callspec", None) and request.node.callspec.params.get("case")
    if case and CASES[case][1] < 16 and gpu_backend() == "cuda":
        pytest.skip("MLX-CUDA has no quantized attention (quantized_matmul shapes)")


def _model(arch: str):
    if arch not in _MODELS:
        model = tiny_model(arch, seed=3)
        prepare_model(model)
        _MODELS[arch] = model
    return _MODELS[arch]


def _layouts(model, rows: int, bits: int, slack: int):
    return make_batch_layouts(model, rows, kv_bits=bits, kv_group_size=32, max_draft=slack)


def _next_logits(model, cache, tokens: list[int]) -> np.ndarray:
    return np.array(model(mx.array([tokens]), cache=cache)[:, -1, :].astype(mx.float32))


def _check_against_fresh(model, bits, batch, histories, rng, quantized_tol=3e-2):
    """Float tolerance (2e-3) for plain KV. Quantized KV allows a few quantization steps: the
    batch's keys and values come out of a batched forward, the fresh row's out of its own, and
    a last-bit difference rounds some 8-bit codes the other way (up to 1.1e-2 on a logit with
    OpenBLAS). The number of kept columns is checked exactly."""
    tol = quantized_tol if bits < 16 else 2e-3
    probe = [int(t) for t in rng.integers(1, 256, len(histories))]
    got = np.array(model(mx.array(probe)[:, None], cache=batch)[:, -1, :].astype(mx.float32))
    assert kvb.num_tokens(batch) == [len(h) + 1 for h in histories]
    for b, hist in enumerate(histories):
        fresh = _layouts(model, 1, bits, 0)
        model(mx.array([hist]), cache=fresh)
        want = _next_logits(model, fresh, [probe[b]])[0]
        np.testing.assert_allclose(got[b], want, rtol=tol, atol=tol)


rounds = st.lists(
    st.tuples(st.integers(1, MAX_K), st.lists(st.integers(0, 99), min_size=3, max_size=3)),
    min_size=1,
    max_size=5,
)


@pytest.mark.parametrize("case", sorted(CASES))
@SETTINGS
@given(
    prompt_lengths=st.lists(st.integers(2, 12), min_size=3, max_size=3),
    rounds=rounds,
    seed=st.integers(0, 2**16),
)
def test_target_rounds_keep_exactly_the_accepted_columns(case, prompt_lengths, rounds, seed):
    arch, bits = CASES[case]
    model = _model(arch)
    rng = np.random.default_rng(seed)
    histories = [rng.integers(1, 256, n).tolist() for n in prompt_lengths]
    rows = [_layouts(model, 1, bits, MAX_K) for _ in histories]
    for row, hist in zip(rows, histories, strict=True):
        model(mx.array([hist]), cache=row)
    batch = kvb.merge_rows(None, rows)
    for k, raw in rounds:
        num_drafts = [r % (k + 1) for r in raw]  # some rows without drafts: padding columns
        accepted = [r % (n + 1) for r, n in zip(raw[::-1], num_drafts, strict=True)]
        cols = rng.integers(1, 256, (len(histories), k + 1))
        kvb.checkpoint(batch)
        model(mx.array(cols), cache=batch)
        kvb.rollback(batch, [a + 1 for a in accepted])
        for b, a in enumerate(accepted):
            histories[b] = histories[b] + cols[b, : a + 1].tolist()
    _check_against_fresh(model, bits, batch, histories, rng)


@pytest.mark.parametrize("case", sorted(CASES))
@SETTINGS
@given(
    prompt_lengths=st.lists(st.integers(2, 12), min_size=3, max_size=3),
    rounds=rounds,
    seed=st.integers(0, 2**16),
)
def test_draft_rounds_keep_pending_and_accepted_drafts(case, prompt_lengths, rounds, seed):
    arch, bits = CASES[case]
    model = _model(arch)
    recurrent = arch == "qwen3_next"  # recurrent drafts take pending tokens one at a time
    rng = np.random.default_rng(seed)
    histories = [rng.integers(1, 256, n).tolist() for n in prompt_lengths]
    rows = [_layouts(model, 1, bits, MAX_K + 4) for _ in histories]
    for row, hist in zip(rows, histories, strict=True):
        model(mx.array([hist]), cache=row)
    batch = kvb.merge_rows(None, rows)
    for k, raw in rounds:
        pending = [1 if recurrent else 1 + r % 4 for r in raw]
        accepted = [r % (k + 1) for r in raw[::-1]]
        P = max(pending)
        first = rng.integers(1, 256, (len(histories), P))
        kvb.checkpoint(batch)
        if P > 1:
            kvb.prepare(batch, lengths=pending)
        model(mx.array(first), cache=batch)
        kvb.finalize(batch)
        drafts = rng.integers(1, 256, (len(histories), max(k - 1, 0)))
        for j in range(k - 1):
            model(mx.array(drafts[:, j : j + 1]), cache=batch)
        keep = [p + min(a, k - 1) for p, a in zip(pending, accepted, strict=True)]
        kvb.rollback(batch, keep)
        for b in range(len(histories)):
            kept = first[b, : pending[b]].tolist() + drafts[b, : min(accepted[b], k - 1)].tolist()
            histories[b] = histories[b] + kept
    _check_against_fresh(model, bits, batch, histories, rng)


@pytest.mark.parametrize("case", sorted(CASES))
@SETTINGS
@given(
    prompt_lengths=st.lists(st.integers(2, 12), min_size=3, max_size=3),
    rounds=rounds,
    seed=st.integers(0, 2**16),
)
def test_target_rounds_on_rings_without_slack_write_only_the_kept_columns(
    case, prompt_lengths, rounds, seed
):
    """The engine's target pattern (engine/spec/ringcommit.py): rings have no slack, the verify
    forward writes into shadow copies, and only each row's kept columns reach the real ring."""
    from engine.spec.ringcommit import RingRound, defers

    arch, bits = CASES[case]
    model = _model(arch)
    rng = np.random.default_rng(seed)
    histories = [rng.integers(1, 256, n).tolist() for n in prompt_lengths]
    rows = [_layouts(model, 1, bits, 0) for _ in histories]
    for row, hist in zip(rows, histories, strict=True):
        model(mx.array([hist]), cache=row)
    batch = kvb.merge_rows(None, rows)
    has_ring = any(getattr(layer, "is_ring", False) for layer in batch)
    for k, raw in rounds:
        num_drafts = [r % (k + 1) for r in raw]
        accepted = [r % (n + 1) for r, n in zip(raw[::-1], num_drafts, strict=True)]
        cols = rng.integers(1, 256, (len(histories), k + 1))
        ring_round = RingRound(batch, k + 1)
        assert any(defers(layer, k + 1) for layer in batch) == has_ring
        model(mx.array(cols), cache=ring_round.model_caches)
        ring_round.finish([a + 1 for a in accepted])
        for b, a in enumerate(accepted):
            histories[b] = histories[b] + cols[b, : a + 1].tolist()
    # 8-bit KV: a cache fed token by token and one prefilled at once differ by up to ~5e-3 in
    # a few logits (with OpenBLAS, e.g. prompt_lengths [2, 2, 2], seed 93 — the slack
    # rollback pattern above too); a wrong kept column moves them by far more
    _check_against_fresh(model, bits, batch, histories, rng, quantized_tol=1e-2)


