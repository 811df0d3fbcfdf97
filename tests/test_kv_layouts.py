"""Property tests of the attention layouts against a naive reference over the full history.

The reference keeps every row's whole history (float64) and attends, for the query at position
q, to the positions p <= q with p < keep or p > q - (window - keep): exactly the semantics the
layouts promise. Each step feeds random K/V/Q through `make_mask` + `update_and_fetch` + mlx-lm's
SDPA (the quantized path for quantized layouts), as a model would.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.models.base import scaled_dot_product_attention

from engine.kv import (
    KVLayout,
    PlainLayout,
    QuantizedLayout,
    QuantizedRotatingLayout,
    RotatingLayout,
)
from engine.kv.convert import row_of_layout

H, D = 2, 32
SETTINGS = settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)


def make_layout(
    kind: str, window: int, keep: int, slack: int, bits: int, num_rows: int = 0
) -> KVLayout:
    keep = min(keep, window - 1)
    if kind == "plain":
        if bits == 16:
            return PlainLayout(num_rows)
        return QuantizedLayout(num_rows, bits=bits, group_size=32)
    ring = dict(window=window, keep=keep, slack=slack)
    if bits == 16:
        return RotatingLayout(num_rows, **ring)
    return QuantizedRotatingLayout(num_rows, bits=bits, group_size=32, **ring)


def stored(layout: KVLayout, x: mx.array) -> np.ndarray:
    """What the layout will hold for `x` (quantize/dequantize round trip for quantized codecs)."""
    k, _ = layout.codec.decode(layout.codec.encode(x, x))
    return np.array(k, dtype=np.float64)


@dataclass
class RefRow:
    keys: list[np.ndarray] = field(default_factory=list)  # per position [H, D]
    values: list[np.ndarray] = field(default_factory=list)

    def attend(self, q: np.ndarray, pos: int, window: int | None, keep: int) -> np.ndarray:
        vis = [p for p in range(pos + 1) if window is None or p < keep or p > pos - (window - keep)]
        k = np.stack([self.keys[p] for p in vis], axis=1)  # [H, P, D]
        v = np.stack([self.values[p] for p in vis], axis=1)
        s = np.einsum("hd,hpd->hp", q, k) / np.sqrt(D)
        w = np.exp(s - s.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        return np.einsum("hp,hpd->hd", w, v)


def step(layout: KVLayout, k: mx.array, v: mx.array, q: mx.array) -> np.ndarray:
    """One model-style attention call; returns [B, H, S, D] outputs."""
    mask = layout.make_mask(k.shape[2], window_size=layout.window)
    keys, values = layout.update_and_fetch(k, v)
    out = scaled_dot_product_attention(q, keys, values, cache=layout, scale=D**-0.5, mask=mask)
    return np.array(out, dtype=np.float64)


def rand(rng: np.random.Generator, b: int, s: int) -> mx.array:
    return mx.array(rng.standard_normal((b, H, s, D)).astype(np.float32))


def check_chunk(
    layout: KVLayout,
    refs: list[RefRow],
    rng: np.random.Generator,
    width: int,
    real: list[int],
    skip: list[int] | None = None,
) -> None:
    """Feed a chunk of `width` columns (row b: skip[b] pads, real[b] tokens, then pads)."""
    b = len(refs)
    skip = skip or [0] * b
    k, v, q = rand(rng, b, width), rand(rng, b, width), rand(rng, b, width)
    qn = np.array(q, dtype=np.float64)  # before SDPA: the quantized path scales q in place
    start = layout.num_tokens
    if any(skip) or any(r < width for r in real):
        layout.prepare(left_padding=skip, lengths=real)
    out = step(layout, k, v, q)
    layout.finalize()
    ks, vs = stored(layout, k), stored(layout, v)
    for i, ref in enumerate(refs):
        for j in range(skip[i], skip[i] + real[i]):
            ref.keys.append(ks[i, :, j])
            ref.values.append(vs[i, :, j])
            pos = start[i] + j - skip[i]
            want = ref.attend(qn[i, :, j], pos, layout.window, layout.keep)
            np.testing.assert_allclose(out[i, :, j], want, rtol=2e-4, atol=2e-4)
    assert layout.num_tokens == [s + r for s, r in zip(start, real, strict=True)]


geometry = st.tuples(
    st.sampled_from(["plain", "ring"]),
    st.integers(3, 9),  # window
    st.integers(0, 2),  # keep
    st.integers(0, 4),  # slack
    st.sampled_from([16, 8]),
)


@SETTINGS
@given(geometry, st.lists(st.integers(1, 12), min_size=1, max_size=8), st.integers(0, 2**16))
def test_ring_equals_sliding_window_over_full_history(geo, chunks, seed):
    kind, window, keep, slack, bits = geo
    layout = make_layout(kind, window, keep, slack, bits, num_rows=1)
    rng = np.random.default_rng(seed)
    refs = [RefRow()]
    for width in chunks:
        check_chunk(layout, refs, rng, width, [width])


@SETTINGS
@given(
    geometry,
    st.lists(st.tuples(st.integers(0, 4), st.integers(0, 5)), min_size=1, max_size=6),
    st.integers(0, 2**16),
)
def test_rollback_then_update_equals_never_seen(geo, rounds, seed):
    """Rounds of k+1 columns, keep `accepted`; later queries see exactly the accepted history."""
    kind, window, keep, slack, bits = geo
    max_draft = slack  # the ring's slack is what a round may append beyond one column
    layout = make_layout(kind, window, keep, slack, bits, num_rows=2)
    rng = np.random.default_rng(seed)
    refs = [RefRow(), RefRow()]
    check_chunk(layout, refs, rng, 5, [5, 3])  # rows of different lengths
    for k_raw, acc_raw in rounds:
        k = min(k_raw, max_draft)
        accepted = [1 + acc_raw % (k + 1), 1 + (acc_raw * 7 + 3) % (k + 1)]
        layout.checkpoint()
        kk, vv, qq = rand(rng, 2, k + 1), rand(rng, 2, k + 1), rand(rng, 2, k + 1)
        qn = np.array(qq, np.float64)
        start = layout.num_tokens
        out = step(layout, kk, vv, qq)
        layout.rollback(accepted)
        assert layout.num_tokens == [s + a for s, a in zip(start, accepted, strict=True)]
        ks, vs = stored(layout, kk), stored(layout, vv)
        for i, ref in enumerate(refs):
            for j in range(accepted[i]):  # accepted columns saw the right history
                ref.keys.append(ks[i, :, j])
                ref.values.append(vs[i, :, j])
                want = ref.attend(qn[i, :, j], start[i] + j, layout.window, layout.keep)
                np.testing.assert_allclose(out[i, :, j], want, rtol=2e-4, atol=2e-4)
        check_chunk(layout, refs, rng, 1, [1, 1])  # a plain decode step after the rollback
    check_chunk(layout, refs, rng, 3, [3, 3])


@SETTINGS
@given(geometry, st.lists(st.integers(1, 20), min_size=1, max_size=4), st.integers(0, 2**16))
def test_merge_then_extract_round_trips(geo, lengths, seed):
    kind, window, keep, slack, bits = geo
    template = make_layout(kind, window, keep, slack, bits)
    rng = np.random.default_rng(seed)
    rows = []
    for n in lengths:
        row = template.empty_like(1)
        for s in range(0, n, 7):  # prefill in chunks (wide chunks take the fold-in path)
            w = min(7, n - s)
            row.update_and_fetch(rand(rng, 1, w), rand(rng, 1, w))
        rows.append(row)
    batch = template.empty_like(0).merge(rows)
    assert batch.num_tokens == lengths
    for i, row in enumerate(rows):
        back = batch.extract(i)
        assert back.num_tokens == row.num_tokens
        a, b = row_of_layout(row), row_of_layout(back)
        np.testing.assert_array_equal(a.positions, b.positions)
        for x, y in zip(a.bufs or [], b.bufs or [], strict=True):
            assert mx.array_equal(x, y)
    # filter keeps the chosen rows intact
    keep = list(range(len(lengths)))[::-1][: max(1, len(lengths) - 1)]
    batch.filter(keep)
    assert batch.num_tokens == [lengths[i] for i in keep]
    for j, i in enumerate(keep):
        a, b = row_of_layout(rows[i]), row_of_layout(batch.extract(j))
        for x, y in zip(a.bufs or [], b.bufs or [], strict=True):
            assert mx.array_equal(x, y)


@SETTINGS
@given(
    geometry,
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 9), st.integers(0, 6)), min_size=2, max_size=4
    ),
    st.integers(0, 2**16),
)
def test_padding_never_changes_a_rows_results(geo, rows, seed):
    """A batch with left pads, right pads and rows of different lengths == every row alone."""
    kind, window, keep, slack, bits = geo
    layout = make_layout(kind, window, keep, slack, bits, num_rows=len(rows))
    rng = np.random.default_rng(seed)
    refs = [RefRow() for _ in rows]
    # history of different lengths first (each row alone-equivalent: right padding only)
    hist = [h for _, _, h in rows]
    if max(hist) > 0:
        check_chunk(layout, refs, rng, max(hist), hist)
    skip = [s for s, _, _ in rows]
    real = [r for _, r, _ in rows]
    width = max(s + r for s, r in zip(skip, real, strict=True)) + 1
    check_chunk(layout, refs, rng, width, real, skip)
    check_chunk(layout, refs, rng, 1, [1] * len(rows))


def test_ring_rollback_beyond_slack_is_refused():
    layout = RotatingLayout(1, window=4, keep=0, slack=1)
    rng = np.random.default_rng(0)
    layout.update_and_fetch(rand(rng, 1, 6), rand(rng, 1, 6))
    layout.checkpoint()
    layout.update_and_fetch(rand(rng, 1, 2), rand(rng, 1, 2))
    layout.update_and_fetch(rand(rng, 1, 2), rand(rng, 1, 2))
    with pytest.raises(ValueError, match="slack"):
        layout.rollback([0])


def test_offset_and_mask_shapes_follow_padding():
    layout = PlainLayout(2)
    rng = np.random.default_rng(1)
    layout.prepare(lengths=[3, 1])
    # trailing pads only: the causal form (no real query sees a column past its own)
    assert layout.make_mask(3) == "causal"
    assert layout.make_mask(3, return_array=True).shape == (3, 3)
    layout.update_and_fetch(rand(rng, 2, 3), rand(rng, 2, 3))
    layout.finalize()
    assert layout.num_tokens == [3, 1]
    assert layout.offset.tolist() == [3, 1]
    layout.prepare(left_padding=[0, 2])
    assert layout.offset.tolist() == [3, -1]  # RoPE position of column 0 (a pad for row 1)
    mask = layout.make_mask(3)
    assert mask.shape == (2, 1, 3, 6)
    assert mask[1, 0, 2].tolist() == [True, True, False, False, False, False]


def test_rows_merged_into_a_batch_are_not_aliased():
    """Writes into the batch (in-place column updates) never change the row merged into it."""
    rng = np.random.default_rng(2)
    row = RotatingLayout(1, window=4, keep=0, slack=1)
    row.update_and_fetch(rand(rng, 1, 5), rand(rng, 1, 5))
    before = [np.array(b) for b in row.state]
    batch = RotatingLayout(0, window=4, keep=0, slack=1).merge([row])
    for _ in range(3):
        batch.update_and_fetch(rand(rng, 1, 1), rand(rng, 1, 1))
    for a, b in zip(before, row.state, strict=True):
        np.testing.assert_array_equal(a, np.array(b))


@pytest.mark.parametrize("seed", range(4))
def test_large_full_layout_masks_built_on_the_device_equal_the_host_rule(monkeypatch, seed):
    """A full layout's mask above the host-size limit is built on the device from the queries'
    positions alone; it equals the general rule (columns' positions against each query's),
    for decode steps and right-padded chunks alike."""
    from engine.kv import geometry

    rng = np.random.default_rng(seed)
    B, N = int(rng.integers(1, 9)), int(rng.choice([1, 3, 40]))
    n = rng.integers(0, 300, size=B).astype(np.int64)
    skip = np.minimum(rng.integers(0, N, size=B), N - 1).astype(np.int64) if N > 1 \
        else np.zeros(B, np.int64)
    geo = geometry.Geometry(None, 0, 0)
    step = geometry.plan_step(geo, n, skip, np.full(B, geometry.UNBOUNDED, np.int64),
                              int(n.max()) + N, N)
    monkeypatch.setattr(geometry, "_NUMPY_MASK_MAX", 0)  # every mask takes the device path
    fast = geometry.build_mask(geo, n, step, N, None, True)
    monkeypatch.setattr(geometry, "_NUMPY_MASK_MAX", 1 << 40)  # the general host rule
    slow = geometry.build_mask(geo, n, step, N, None, True)
    assert isinstance(fast, mx.array) and isinstance(slow, mx.array)
    if step.uniform:
        return  # equal rows take mlx-lm's own forms either way
    assert fast.shape == slow.shape and bool(mx.all(fast == slow))


@SETTINGS
@given(
    geometry,
    st.lists(st.tuples(st.sampled_from(["decode", "leave", "join", "chunk"]), st.integers(0, 99)),
             min_size=4, max_size=24),
    st.integers(0, 2**16),
)
def test_rows_leaving_and_joining_through_free_slots_equal_the_reference(geo, ops, seed):
    """Rows leave (`filter` in `compact_order`: their slots stay free) and join (`extend`,
    written into free slots) between decode steps and wide chunks; every query still sees
    exactly its own row's history, and joining rows did land in free slots."""
    from engine.batch import compact_order

    kind, window, keep, slack, bits = geo
    template = make_layout(kind, window, keep, slack, bits)
    rng = np.random.default_rng(seed)

    def new_row(n: int) -> tuple[KVLayout, RefRow]:
        row, ref = template.empty_like(1), RefRow()
        check_chunk(row, [ref], rng, n, [n])
        return row, ref

    rows = [new_row(3 + i) for i in range(6)]
    layout = template.empty_like(0).merge([r for r, _ in rows])
    refs = [ref for _, ref in rows]

    def leave(drop: set[int]) -> None:
        nonlocal refs
        order = compact_order(len(refs), drop)
        layout.filter(order)
        refs = [refs[i] for i in order]

    def join(n: int) -> bool:
        """Whether the row was written into a free slot (the buffers were not rebuilt)."""
        row, ref = new_row(n)
        free = layout.slots - layout.num_rows
        layout.extend(row)
        refs.append(ref)
        return free > 0 and layout.slots - layout.num_rows == free - 1

    for op, arg in [("decode", 0), *ops, ("join", 2), ("join", 3)]:
        if op == "decode":
            check_chunk(layout, refs, rng, 1, [1] * len(refs))
        elif op == "chunk":
            check_chunk(layout, refs, rng, 3, [1 + (arg + i) % 3 for i in range(len(refs))])
        elif op == "leave" and len(refs) > 1:
            drop = {arg % len(refs), (arg // 10) % len(refs)}
            leave(drop if len(drop) < len(refs) else {0})
        elif op == "join":
            join(1 + arg % 6)
        assert layout.num_rows == len(refs) <= layout.slots
    while layout.slots > layout.num_rows:  # rows join the free slots earlier leaves kept
        assert join(4)
    # then the first row leaves: its slot stays free and the next row is written into it
    assert layout.num_rows >= 3
    leave({0})
    assert layout.slots == layout.num_rows + 1
    assert join(5)
    check_chunk(layout, refs, rng, 1, [1] * len(refs))
    check_chunk(layout, refs, rng, 3, [3] * len(refs))


def test_rows_moved_in_place_across_layers_are_evaluated_once(monkeypatch):
    """`filter_rows` moves rows in place in every layer of the batch, evaluating all layers'
    copies at once (one wait for the step in flight, not one per layer); each kept row still
    holds exactly its own history, and the slots it left are free."""
    from engine.batch import compact_order
    from engine.kv.batch import filter_rows

    rng = np.random.default_rng(3)
    templates = [make_layout("plain", 0, 0, 0, 16), make_layout("ring", 16, 2, 4, 16),
                 make_layout("plain", 0, 0, 0, 8)]
    layers, before = [], []
    for t in templates:
        rows = []
        for n in range(3, 9):
            row = t.empty_like(1)
            row.update_and_fetch(rand(rng, 1, n), rand(rng, 1, n))
            rows.append(row)
        layers.append(t.empty_like(0).merge(rows))
        before.append([row_of_layout(r) for r in rows])
    order = compact_order(6, {1})
    slots = [layer.slots for layer in layers]
    evals = []
    real_eval = mx.eval
    monkeypatch.setattr(mx, "eval", lambda *a: evals.append(1) or real_eval(*a))
    filter_rows(layers, order)
    monkeypatch.setattr(mx, "eval", real_eval)
    assert len(evals) == 1
    assert [layer.slots for layer in layers] == slots  # nothing gathered into new buffers
    for layer, rows in zip(layers, before, strict=True):
        assert layer.num_rows == 5
        for j, i in enumerate(order):
            a, b = rows[i], row_of_layout(layer.extract(j))
            np.testing.assert_array_equal(a.positions, b.positions)
            for x, y in zip(a.bufs or [], b.bufs or [], strict=True):
                assert mx.array_equal(x, y)
