"""Move rows between layouts and from mlx-lm's single-sequence caches into ours.

Every conversion goes through one neutral form, `RowKV`: the positions a row holds (sorted),
their encoded buffers `[1, H, P, d]` and the codec, plus the row's length. `place()` then lays
those positions out in any target geometry (full or ring) and re-encodes only if the codecs
differ. Positions a ring cannot hold, or that are outside every future query's window, are
dropped; positions a ring needs but the source lacks stay empty and are never attended, because
they are older than the window of any later query.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as mlc

from engine.kv.attention import KVLayout
from engine.kv.codec import Codec, PlainCodec, QuantizedCodec


@dataclass(slots=True)
class RowKV:
    num_tokens: int
    positions: np.ndarray  # [P] ascending
    bufs: list[mx.array] | None  # each [1, H, P, d]
    codec: Codec


def row_of_layout(layout: KVLayout, i: int = 0) -> RowKV:
    n = int(layout._n[i])
    if layout._bufs is None:
        return RowKV(n, np.zeros(0, np.int64), None, layout.codec)
    pos, cols = layout.row_positions(i)
    idx = mx.array(cols, dtype=mx.int32)
    bufs = [b[i : i + 1][:, :, idx, :] for b in layout._bufs]
    return RowKV(n, pos, bufs, layout.codec)


def row_of_mlx(cache: Any) -> RowKV:
    """One row from mlx-lm's KVCache / QuantizedKVCache / RotatingKVCache (batch size 1)."""
    if isinstance(cache, mlc.QuantizedKVCache):
        codec: Codec = QuantizedCodec(bits=cache.bits, group_size=cache.group_size)
        n = int(cache.offset)
        if cache.keys is None:
            return RowKV(n, np.zeros(0, np.int64), None, codec)
        bufs = [x[..., :n, :] for x in (*cache.keys, *cache.values)]
        return RowKV(n, np.arange(n), bufs, codec)
    if isinstance(cache, mlc.RotatingKVCache):
        n = int(cache.offset)
        if cache.keys is None:
            return RowKV(n, np.zeros(0, np.int64), None, PlainCodec())
        k = cache._temporal_order(cache.keys)
        v = cache._temporal_order(cache.values)
        held = k.shape[2]
        if n <= held:
            return RowKV(n, np.arange(n), [k[..., :n, :], v[..., :n, :]], PlainCodec())
        keep = cache.keep
        pos = np.concatenate([np.arange(keep), np.arange(n - (held - keep), n)])
        return RowKV(n, pos, [k, v], PlainCodec())
    if isinstance(cache, mlc.KVCache):
        n = int(cache.offset)
        if cache.keys is None:
            return RowKV(n, np.zeros(0, np.int64), None, PlainCodec())
        return RowKV(
            n, np.arange(n), [cache.keys[..., :n, :], cache.values[..., :n, :]], PlainCodec()
        )
    raise TypeError(f"cannot convert {type(cache).__name__} into a KV layout row")


def _recode(bufs: list[mx.array], src: Codec, dst: Codec) -> list[mx.array]:
    if src == dst:
        return bufs
    k, v = src.decode(bufs)
    return dst.encode(k, v)


def place(target: KVLayout, row: RowKV) -> KVLayout:
    """A one-row layout of `target`'s kind holding `row`."""
    out = target.empty_like(1)
    out._n = np.array([row.num_tokens], dtype=np.int64)
    if row.bufs is None or row.num_tokens == 0:
        return out
    bufs = _recode(row.bufs, row.codec, target.codec)
    n = row.num_tokens
    if target.ring_size is None:
        if not np.array_equal(row.positions, np.arange(n)):
            raise ValueError("a full-attention layout needs every position of the row")
        out._bufs = [mx.contiguous(b) for b in bufs]
        return out
    width = min(n, target.ring_size)
    want = target._positions(np, np.arange(width)[None], np.array([[n]]))[0]
    src = np.searchsorted(row.positions, want)
    src_c = np.clip(src, 0, len(row.positions) - 1)
    have = (want >= 0) & (row.positions[src_c] == want)
    if target.window is not None:
        horizon = n - (target.window - target.keep) + 1  # oldest non-sink position needed next
        needed = (want >= 0) & ((want < target.keep) | (want >= horizon))
        missing = needed & ~have
        if missing.any():
            raise ValueError(
                f"source row lacks positions {want[missing][:8].tolist()} the window needs"
            )
    idx = mx.array(src_c, dtype=mx.int32)
    sel = mx.array(have)[None, None, :, None]
    out._bufs = [mx.contiguous(mx.where(sel, b[:, :, idx, :], 0).astype(b.dtype)) for b in bufs]
    return out


def adopt(target: KVLayout, cache: Any) -> KVLayout:
    """`cache` as rows of `target`'s kind (returned as is when it already is one)."""
    if isinstance(cache, KVLayout):
        if target.same_kind(cache):
            return cache
        if cache.num_rows != 1:
            raise ValueError("only one-row layouts convert between kinds")
        return place(target, row_of_layout(cache))
    return place(target, row_of_mlx(cache))
