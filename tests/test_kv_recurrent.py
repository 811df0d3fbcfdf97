"""Recurrent state layout: padding never touches the state; rollback == never saw the rejects.

Drives one gated-DeltaNet mixer (qwen3_next's `linear_attn`) directly with random inputs and
compares the layout's `[conv, state]` with one-row layouts fed only the real / accepted tokens.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.kv import RecurrentLayout, install_stepping
from tests.tiny_archs import tiny_model

SETTINGS = settings(
    max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)


@pytest.fixture(scope="module", autouse=True)
def _no_compile():
    mx.disable_compile()
    yield
    mx.enable_compile()


_MIXER: list = []


def mixer():
    if not _MIXER:
        model = tiny_model("qwen3_next", seed=3)
        m = model.layers[0].linear_attn
        install_stepping(m)
        _MIXER.append(m)
    return _MIXER[0]


def feed(layout: RecurrentLayout, x: mx.array) -> mx.array:
    out = mixer()(x, layout.make_mask(x.shape[1]), layout)
    mx.eval(out, layout.state)
    return out


def feed_alone(row: RecurrentLayout, xs: np.ndarray) -> None:
    for t in range(xs.shape[0]):  # one token at a time, like decoding
        feed(row, mx.array(xs[None, t : t + 1]))


def assert_state_equal(batch: RecurrentLayout, i: int, row: RecurrentLayout) -> None:
    for a, b in zip(batch.extract(i).cache, row.cache, strict=True):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-5)


def hidden(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal((*shape, 64)).astype(np.float32)


@SETTINGS
@given(
    st.lists(st.integers(1, 6), min_size=2, max_size=3),
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 9)), min_size=1, max_size=4),
    st.integers(0, 2**16),
)
def test_rollback_then_update_equals_never_seen(prefix, rounds, seed):
    rng = np.random.default_rng(seed)
    b = len(prefix)
    batch = RecurrentLayout(b)
    alone = [RecurrentLayout(1) for _ in range(b)]
    width = max(prefix)
    x = hidden(rng, b, width)
    batch.prepare(lengths=prefix)  # right padding: rows of different lengths
    feed(batch, mx.array(x))
    batch.finalize()
    for i, n in enumerate(prefix):
        feed_alone(alone[i], x[i, :n])
    for k, acc_seed in rounds:
        batch.checkpoint()
        x = hidden(rng, b, k + 1)
        feed(batch, mx.array(x))
        accepted = [(acc_seed + 3 * i) % (k + 2) for i in range(b)]  # 0..k+1
        batch.rollback(accepted)
        for i, a in enumerate(accepted):
            feed_alone(alone[i], x[i, :a])
        assert batch.num_tokens == [r.num_tokens[0] for r in alone]
        x = hidden(rng, b, 1)
        feed(batch, mx.array(x))
        for i in range(b):
            feed_alone(alone[i], x[i])
    for i in range(b):
        assert_state_equal(batch, i, alone[i])


@SETTINGS
@given(
    st.lists(st.tuples(st.integers(0, 4), st.integers(1, 6)), min_size=2, max_size=3),
    st.integers(0, 2**16),
)
def test_padding_never_updates_the_state(rows, seed):
    """Left pads (fresh rows) and right pads (any row) leave the state as the real tokens made it."""
    rng = np.random.default_rng(seed)
    b = len(rows)
    width = max(lp + n for lp, n in rows) + 1
    batch = RecurrentLayout(b)
    alone = [RecurrentLayout(1) for _ in range(b)]
    x = hidden(rng, b, width)
    batch.prepare(left_padding=[lp for lp, _ in rows], lengths=[n for _, n in rows])
    for s in range(0, width, 3):  # chunked, pads spanning chunks
        feed(batch, mx.array(x[:, s : s + 3]))
    batch.finalize()
    for i, (lp, n) in enumerate(rows):
        feed_alone(alone[i], x[i, lp : lp + n])
    for i in range(b):
        assert_state_equal(batch, i, alone[i])
    # now every row has state: right padding is still exact, left padding is refused
    x = hidden(rng, b, 3)
    batch.prepare(lengths=[1, 3] + [2] * (b - 2))
    feed(batch, mx.array(x))
    batch.finalize()
    for i, n in enumerate([1, 3] + [2] * (b - 2)):
        feed_alone(alone[i], x[i, :n])
        assert_state_equal(batch, i, alone[i])
    with pytest.raises(ValueError, match="left padding"):
        batch.prepare(left_padding=[1] + [0] * (b - 1))


def test_rollback_needs_snapshots_per_position():
    """Without the stepping mixer a k+1 chunk leaves only the final state: rollback refuses."""
    model = tiny_model("qwen3_next", seed=3)
    plain = model.layers[0].linear_attn  # not made stepping
    layout = RecurrentLayout(1)
    layout.checkpoint()
    plain(mx.array(hidden(np.random.default_rng(0), 1, 3)), None, layout)
    layout.rollback([3])  # all accepted: the final state is there
    layout.checkpoint()
    plain(mx.array(hidden(np.random.default_rng(1), 1, 3)), None, layout)
    with pytest.raises(ValueError, match="snapshot"):
        layout.rollback([1])


def test_merge_filter_extract_round_trip():
    rng = np.random.default_rng(5)
    rows = [RecurrentLayout(1) for _ in range(3)]
    for r, n in zip(rows, (2, 5, 1), strict=True):
        feed_alone(r, hidden(rng, n))
    batch = RecurrentLayout(0).merge(rows)
    assert batch.num_tokens == [2, 5, 1]
    for i, r in enumerate(rows):
        assert_state_equal(batch, i, r)
    batch.filter([2, 0])
    assert batch.num_tokens == [1, 2]
    assert_state_equal(batch, 0, rows[2])
    assert_state_equal(batch, 1, rows[0])
    fresh = RecurrentLayout(1)  # a row with no state yet joins as zeros
    batch.extend(fresh)
    assert batch.num_tokens == [1, 2, 0]
    assert all(float(mx.abs(c[2]).max()) == 0 for c in batch.state)
