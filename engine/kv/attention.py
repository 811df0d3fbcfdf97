"""Batched KV layouts for attention layers: full or ring (sliding window), plain or quantized.

Every row keeps its own length, so rows never need to be aligned with each other.

Storage. Each buffer is `[B, H, C, d]` (C = allocated columns). Row `b` holds `n[b]` tokens;
token position `p` lives at column `col(p)`:

* full layouts (`PlainLayout`, `QuantizedLayout`): `col(p) = p`. Columns `>= n[b]` are free
  (this is the row's padding: it sits on the right and the mask never lets a query see it).
* ring layouts (`RotatingLayout`, `QuantizedRotatingLayout`): `R = window + slack` columns;
  the first `keep` are sink tokens, the rest a ring of `M = R - keep`:
  `col(p) = p if p < keep else keep + (p - keep) % M`.
  Column `c` holds the latest position `p < n[b]` with `col(p) == c`.

Attention semantics (the same for every layout, prefill or decode): the query at position `q`
sees positions `p <= q` with `p < keep` or `p > q - (window - keep)`; full layouts have no
window. With `keep == 0` that is mlx-lm's sliding window of `window` tokens (RotatingKVCache
decode and prefill), with `keep > 0` mlx-lm's decode-time "sinks + recent" rule.

Worked example (ring, window=4, keep=0, slack=2, so R = M = 6). A row that has seen 8 tokens
holds positions [6 7 2 3 4 5] in columns 0..5. Decoding position 8 writes column 2
(8 % 6) and the query sees positions 5..8 (columns 5, 0, 1, 2): position 4 (column 4) is
outside the window and masked. A speculative round writes positions 8, 9, 10 (columns 2, 3, 4);
if only one column is accepted, `n` goes back to 9: columns 3 and 4 now hold the rejected
positions 9 and 10, the layout reads them as positions 3 and 4, and those lie outside the
window of every later query (>= 9 - 4 + 1 = 6), so they are never seen and later writes
replace them. This is why `slack >= max_draft` makes rollback exact across the wrap.

Padding. `prepare(left_padding=..., lengths=...)` announces padded multi-token input: row `b`'s
next columns are `left_padding[b]` pads, then `lengths[b]` real tokens (spread over one or
more chunks), then pads. Left pads are rotated out before writing, real tokens are written at
positions `n[b]...`, and only real tokens advance `n[b]`, so pads never become visible to a
real query (pad queries see only real columns, to keep their outputs finite). `offset` is the
RoPE position of the chunk's first column, `n[b] - left_padding[b]`.

Worked example (full layout): rows A (n=5) and B (n=2) take a chunk of 3 columns with
`prepare(left_padding=[0, 1], lengths=[3, 1])`. `offset` is [5, 1], so B's real token (input
column 1) gets RoPE position 2. A writes positions 5, 6, 7 (columns 5..7). B's chunk is rotated
to [real, pad, pad] and written at positions 2, 3, 4; only the real token counts, so n becomes
[8, 3] and B's columns 3 and 4 are free again. B's real query sees columns 0..2 only.

Speculation. `checkpoint()` records `n`; `rollback(accepted)` sets `n = n_ckpt + accepted`.
Nothing is copied: rejected columns become free (full) or out-of-window (ring).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from engine.kv.codec import Codec, PlainCodec, QuantizedCodec
from engine.kv.geometry import (
    UNBOUNDED,
    Geometry,
    Step,
    build_mask,
    plan_step,
    round_up,
    row_offsets,
    shared,
)


@dataclass(slots=True)
class RowMove:
    """Rows to copy into other slots of a layout's buffers, in place (`KVLayout.filter`)."""

    bufs: list[mx.array]
    dst: list[int]
    moving: list[mx.array]  # per buffer, the source rows in `dst`'s order (not yet evaluated)


def apply_moves(moves: Sequence[RowMove]) -> None:
    """Write the moved rows into their slots. The copies are evaluated first, all layers'
    at once: a buffer that a pending read still refers to cannot be written in place, so MLX
    would copy all of it."""
    mx.eval([m for mv in moves for m in mv.moving])
    for mv in moves:
        for b, m in zip(mv.bufs, mv.moving, strict=True):
            for i, d in enumerate(mv.dst):
                b[d : d + 1] = m[i : i + 1]


class KVLayout:
    """Common machinery for the four attention layouts. See the module docstring."""

    step = 256
    kind = "kv"

    def __init__(
        self,
        num_rows: int = 0,
        *,
        codec: Codec,
        window: int | None = None,
        keep: int = 0,
        slack: int = 0,
    ) -> None:
        if window is not None and not 0 <= keep < window:
            raise ValueError(f"need 0 <= keep < window (keep={keep}, window={window})")
        self.codec = codec
        self.window = window
        self.keep = keep if window is not None else 0
        self.slack = slack if window is not None else 0
        self.geometry = shared(Geometry(window, self.keep, self.slack))
        self._bufs: list[mx.array] | None = None
        self._n = np.zeros(num_rows, dtype=np.int64)
        self._skip = np.zeros(num_rows, dtype=np.int64)
        self._remaining = np.full(num_rows, UNBOUNDED, dtype=np.int64)
        self._ckpt: np.ndarray | None = None  # n at checkpoint()
        self._decoded = False  # the last update_and_fetch was one column a row, keys at [0, n)
        self._high: np.ndarray | None = None  # highest position written since checkpoint()

    # ---------------------------------------------------------------- geometry

    @property
    def is_ring(self) -> bool:
        return self.window is not None

    @property
    def ring_size(self) -> int | None:
        """Columns of a ring (`window + slack`), None for full layouts."""
        return self.geometry.ring_size

    @property
    def num_rows(self) -> int:
        return int(self._n.shape[0])

    @property
    def num_tokens(self) -> list[int]:
        """Tokens each row has seen (its next position)."""
        return self._n.tolist()

    @property
    def capacity(self) -> int:
        return 0 if self._bufs is None else int(self._bufs[0].shape[2])

    @property
    def slots(self) -> int:
        """Rows the buffers hold: the live rows first, then free slots that joining rows are
        written into (`filter`, `extend`)."""
        return self.num_rows if self._bufs is None else int(self._bufs[0].shape[0])

    def spare_bytes(self) -> int:
        """Bytes the free slots hold."""
        if self._bufs is None or self.slots == self.num_rows:
            return 0
        return self.nbytes // self.slots * (self.slots - self.num_rows)

    def _live(self) -> list[mx.array]:
        """The buffers' live rows (views when free slots follow them)."""
        assert self._bufs is not None
        B = self.num_rows
        return [b if b.shape[0] == B else b[:B] for b in self._bufs]

    def col_of(self, positions: np.ndarray) -> np.ndarray:
        return self.geometry.col_of(positions)

    def _positions(self, xp: Any, cols: Any, ends: Any) -> Any:
        return self.geometry.positions(xp, cols, ends)

    def _step(self, num_new: int) -> Step:
        return plan_step(
            self.geometry, self._n, self._skip, self._remaining, self.capacity, num_new
        )

    # ---------------------------------------------------------------- model side

    @property
    def offset(self) -> mx.array:
        """Per-row RoPE position of the next chunk's first column, `[B]` int32."""
        return row_offsets(self._n, self._skip)

    def make_mask(
        self, N: int, window_size: int | None = None, return_array: bool = False, **_: Any
    ) -> mx.array | str | None:
        """Boolean mask `[B, 1, N, K]` for the next `update_and_fetch` of N columns.

        K is the number of columns that call will return. Full layouts with equal rows and no
        left padding return mlx-lm's own forms ("causal" / None / `[N, K]`), so a lone row
        matches mlx-lm bit for bit; trailing pads keep them (no real query sees a later column).
        """
        step = self._step(N)
        span = window_size if window_size is not None else self.window
        return build_mask(self.geometry, self._n, step, N, span, return_array)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        num_new = keys.shape[2]
        step = self._step(num_new)
        new = self.codec.encode(keys, values)
        if step.roll is not None:
            new = [mx.take_along_axis(b, step.roll, axis=2) for b in new]
        if self._bufs is None:
            self._bufs = [mx.zeros((*b.shape[:2], 0, b.shape[3]), b.dtype) for b in new]
        if step.direct:
            self._ensure_capacity(step.cap)
            self._write(new, step)
            width, B = step.width, self.num_rows
            out = [b if b.shape[2] == width and b.shape[0] == B else b[:B, :, :width, :]
                   for b in self._bufs]
            written = self._n + num_new if self._high is not None else None
        else:
            self._bufs = self._live()  # a wide chunk rebuilds the buffers: free slots go
            out = [
                mx.concatenate([b[..., : step.num_old, :], nb], axis=2)
                for b, nb in zip(self._bufs, new, strict=True)
            ]
            self._ensure_capacity(step.cap)
            self._fold_in(new, step.real)
            written = step.n_after
        self._advance(step, written)
        self._decoded = num_new == 1 and step.direct and self.window is None
        return self.codec.fetch(out)

    def decode_lengths(self) -> mx.array | None:
        """After a one-column `update_and_fetch` of a full layout: `[B]` int32, the keys each
        row's query sees (columns `[0, n[b])`: what the step's mask says), for attention that
        takes row lengths instead of a mask (kernels.attention.decode); None otherwise. The
        array is the next chunk's RoPE offsets (`row_offsets`, memoized): one for all layers."""
        if not self._decoded or self._skip.any():
            return None
        return row_offsets(self._n, self._skip)

    def _advance(self, step: Step, written: np.ndarray | None) -> None:
        if self._high is not None and written is not None:
            self._high = np.maximum(self._high, written)
        # the step's shared read-only arrays: the next step's plan is found by identity
        self._n, self._skip, self._remaining = step.n_after, step.skip_after, step.remaining_after

    def _ensure_capacity(self, cap: int) -> None:
        assert self._bufs is not None
        have = self._bufs[0].shape[2]
        if cap <= have:
            return
        new_cap = round_up(cap, self.step)
        if self.ring_size is not None:
            new_cap = min(new_cap, self.ring_size)
        # a copy of every row anyway: free slots are dropped with it
        self._bufs = [_pad_columns(b, new_cap) for b in self._live()]

    def _write(self, new: list[mx.array], step: Step) -> None:
        """Write the chunk's column j of row b at `col(n[b] + j)`."""
        assert self._bufs is not None
        if step.write_start is not None:
            self._write_slice(step.write_start, new)
        elif step.write_idx is not None:
            self._scatter_columns(step.write_idx, new)

    def _write_slice(self, c0: int, new: list[mx.array]) -> None:
        """Every live row writes the chunk at columns `[c0, c0 + S)` (in place)."""
        assert self._bufs is not None
        B, c1 = self.num_rows, c0 + new[0].shape[2]
        for b, nb in zip(self._bufs, new, strict=True):
            if b.shape[0] == B:
                b[..., c0:c1, :] = nb
            else:
                b[:B, :, c0:c1, :] = nb

    def _scatter_columns(self, idx: mx.array, new: list[mx.array]) -> None:
        """Row b writes the chunk's column j at column `idx[b, 0, j, 0]` (in place). Free slots
        take zeros at the live rows' first columns (one scatter over the whole buffer: a
        scatter into a slice of it would copy the slice)."""
        assert self._bufs is not None
        free = self.slots - self.num_rows
        if free:
            idx = _padded_index(idx, free)
            new = [mx.pad(nb, [(0, free), (0, 0), (0, 0), (0, 0)]) for nb in new]
        self._bufs = [
            mx.put_along_axis(b, idx, nb, axis=2) for b, nb in zip(self._bufs, new, strict=True)
        ]

    def _fold_in(self, new: list[mx.array], real: np.ndarray) -> None:
        """Ring only: after a wide chunk, each ring column takes the chunk's latest token for it."""
        assert self._bufs is not None
        if not real.any():  # nothing real in the chunk (a speculative round's shadow ring)
            return
        cap = self._bufs[0].shape[2]
        num_new = new[0].shape[2]
        ends = (self._n + real)[:, None]
        pos = self._positions(np, np.arange(cap)[None], ends)
        src = pos - self._n[:, None]
        take = (pos >= 0) & (src >= 0)
        if not take.any():
            return
        idx = mx.array(np.clip(src, 0, num_new - 1), dtype=mx.int32)[:, None, :, None]
        sel = mx.array(take)[:, None, :, None]
        self._bufs = [
            mx.where(sel, mx.take_along_axis(nb, idx, axis=2), b)
            for b, nb in zip(self._bufs, new, strict=True)
        ]

    def append_columns(
        self, keys: mx.array, values: mx.array, keep: np.ndarray, memo: dict | None = None
    ) -> None:
        """Row b appends the first `keep[b]` columns of the chunk `keys`/`values` ([B, H, W, D],
        already computed by a forward that attended over them) at its next positions; nothing is
        attended or returned. The result is the layout's own `prepare(lengths=keep)`,
        `update_and_fetch`, `finalize`, without the wide-chunk fold-in: one column write per
        buffer (a slice when every row writes the same columns, else one scatter in which a
        row's columns past `keep[b]` repeat its last kept column with the same value). The
        write plan depends only on the rows' lengths, `keep` and the geometry, so layers of one
        kind share it through `memo` (a dict the caller keeps for one round)."""
        keep = np.asarray(keep, dtype=np.int64).reshape(-1)
        W = int(keys.shape[2])
        M = None if self.ring_size is None else self.ring_size - self.keep
        if (
            self._bufs is None
            or keep.shape != self._n.shape
            or self._ckpt is not None
            or self._skip.any()
            or (self._remaining < UNBOUNDED).any()
            or not len(keep)
            or keep.min() < 1
            or keep.max() > W
            or (M is not None and keep.max() > M)
        ):  # the general path
            self.prepare(lengths=keep.tolist())
            self.update_and_fetch(keys, values)
            self.finalize()
            return
        key = (self.geometry, self._n.tobytes(), keep.tobytes())
        plan = None if memo is None else memo.get(key)
        if plan is None:
            plan = _append_plan(self.geometry, self._n, keep)
            if memo is not None:
                memo[key] = plan
        start, idx, src, cap = plan
        new = self.codec.encode(keys, values)
        kmax = int(keep.max())
        if src is not None:
            new = [mx.take_along_axis(nb, src, axis=2) for nb in new]
        elif kmax < W:
            new = [nb[..., :kmax, :] for nb in new]
        self._ensure_capacity(cap)
        if start is not None:
            self._write_slice(start, new)
        else:
            assert idx is not None
            self._scatter_columns(idx, new)
        self._n = self._n + keep

    @property
    def state(self) -> list[mx.array]:
        return list(self._bufs or [])

    @property
    def nbytes(self) -> int:
        return sum(int(b.nbytes) for b in self._bufs or [])

    def bytes_per_token(self) -> int | None:
        """Bytes one token costs in this layer (None before the first write)."""
        if self._bufs is None:
            return None
        return sum(int(b.shape[1] * b.shape[3] * b.dtype.size) for b in self._bufs)

    def empty(self) -> bool:
        return self._bufs is None

    def size(self) -> int:
        return int(self._n.max()) if self.num_rows else 0

    # ---------------------------------------------------------------- padding

    def prepare(
        self,
        *,
        left_padding: Sequence[int] | None = None,
        lengths: Sequence[int] | None = None,
        right_padding: Sequence[int] | None = None,
    ) -> None:
        """Announce padded input: `left_padding[b]` pads, then `lengths[b]` real tokens.

        `right_padding` is implied by `lengths` and accepted for mlx-lm compatibility.
        """
        del right_padding
        if left_padding is not None:
            self._skip = np.asarray(left_padding, dtype=np.int64).copy()
        if lengths is not None:
            self._remaining = np.asarray(lengths, dtype=np.int64).copy()

    def finalize(self) -> None:
        self._skip = np.zeros_like(self._n)
        self._remaining = np.full_like(self._n, UNBOUNDED)

    # ---------------------------------------------------------------- speculation

    def checkpoint(self) -> None:
        self._ckpt = self._n.copy()
        self._high = self._n.copy()

    def rollback(self, accepted: Sequence[int] | np.ndarray | mx.array) -> None:
        """Keep `accepted[b]` of the columns row b received since `checkpoint()`."""
        if self._ckpt is None:
            raise RuntimeError("rollback() without checkpoint()")
        acc = np.asarray(accepted, dtype=np.int64).reshape(-1)
        if acc.shape != self._n.shape or (acc < 0).any() or (self._ckpt + acc > self._n).any():
            raise ValueError(f"accepted {acc.tolist()} does not fit rows {self._n - self._ckpt}")
        target = self._ckpt + acc
        if self.is_ring and self._high is not None:
            overshoot = self._high - target
            if (overshoot > self.slack + 1).any():
                raise ValueError(
                    f"ring rollback of {int(overshoot.max())} columns exceeds slack+1 = {self.slack + 1}"
                )
        self._n = target
        self._ckpt = self._high = None

    def commit(self) -> None:
        """End a round with everything accepted."""
        self._ckpt = self._high = None

    # ---------------------------------------------------------------- batch side

    def _params(self) -> dict[str, Any]:
        raise NotImplementedError

    def empty_like(self, num_rows: int = 0) -> KVLayout:
        return type(self)(num_rows, **self._params())

    def same_kind(self, other: Any) -> bool:
        return type(other) is type(self) and other._params() == self._params()

    def filter(
        self, keep: Sequence[int] | np.ndarray | mx.array, moves: list[RowMove] | None = None
    ) -> None:
        """Keep these rows, in this order; the others are dropped.

        When few rows go (at most `free_slots(len(keep))` slots would be left free) and few
        rows move, the kept rows stay where they are, the moved ones are copied into their new
        slots in place, and the slots past the last kept row become free for rows that join
        later (`extend`): no copy of the whole batch. `engine.batch.compact_order` gives the
        order that moves the fewest rows. Otherwise the kept rows are gathered into new
        buffers.

        With `moves`, an in-place move is appended there instead of done: the caller
        evaluates every layer's moves at once and writes them (`apply_moves`), one wait
        for the whole model instead of one per layer."""
        idx = np.asarray(keep, dtype=np.int64).reshape(-1)
        k = len(idx)
        in_place = False
        if self._bufs is not None:
            moved = np.nonzero(idx != np.arange(k))[0]
            in_place = 0 < k and self.slots - k <= free_slots(k) and len(moved) < k
            if not in_place:
                idx_mx = mx.array(idx, dtype=mx.int32)
                self._bufs = [b[idx_mx] for b in self._bufs]
            elif len(moved):
                move = self._row_move(moved, idx[moved])
                if moves is None:
                    apply_moves([move])
                else:
                    moves.append(move)
        self._n, self._skip, self._remaining = self._n[idx], self._skip[idx], self._remaining[idx]
        if self._ckpt is not None and self._high is not None:
            self._ckpt, self._high = self._ckpt[idx], self._high[idx]
        if not in_place:
            self._shrink()

    def _row_move(self, dst: np.ndarray, src: np.ndarray) -> RowMove:
        """Slot `dst[i]` is to take a copy of slot `src[i]` (`apply_moves` does it)."""
        assert self._bufs is not None
        src_mx = mx.array(src, dtype=mx.int32)
        return RowMove(self._bufs, dst.tolist(), [b[src_mx] for b in self._bufs])

    def _shrink(self) -> None:
        if self._bufs is None:
            return
        need = int(self._n.max()) if self.num_rows else 0
        if self.ring_size is not None:
            need = min(need, self.ring_size)
        need = round_up(max(need, 1), self.step)
        if self.capacity - need >= self.step:
            self._bufs = [b[..., :need, :] for b in self._bufs]

    def extend(self, other: KVLayout) -> None:
        """Append the rows of `other` (same kind) after this layout's rows."""
        self._concat_rows([other])

    def merge(self, rows: Sequence[Any]) -> KVLayout:
        """Admit rows (our layouts of any kind, or mlx-lm single-row caches) after ours.

        Returns self. Rows from other layouts are converted (positions kept, codec re-encoded).
        """
        from engine.kv.convert import adopt

        self._concat_rows([adopt(self, r) for r in rows])
        return self

    @classmethod
    def from_rows(cls, rows: Sequence[KVLayout]) -> KVLayout:
        out = rows[0].empty_like(0)
        out._concat_rows(list(rows))
        return out

    def _concat_rows(self, others: Sequence[KVLayout]) -> None:
        parts = [self, *others]
        for o in others:
            if not self.same_kind(o):
                raise ValueError(f"cannot join {o.describe()} rows into {self.describe()}")
        if self._fits_in_place(others):
            self._write_rows(others)
        # each part's live rows (None: no rows, or rows with nothing written yet)
        elif any(live := [p._live() if p._bufs is not None and p.num_rows > 0 else None
                          for p in parts]):
            ref = next(x for x in live if x is not None)
            cap = max(p.capacity for p in parts if p._bufs is not None)
            bufs = []
            for j in range(len(ref)):
                pieces = []
                for p, rows in zip(parts, live, strict=True):
                    if p.num_rows == 0:
                        continue
                    if rows is None:
                        shape = (p.num_rows, ref[j].shape[1], cap, ref[j].shape[3])
                        pieces.append(mx.zeros(shape, ref[j].dtype))
                        continue
                    pieces.append(_pad_columns(rows[j], cap))
                # a lone piece still gets a new array object: in-place column writes into the
                # batch must never reach the layout the row came from
                bufs.append(
                    mx.concatenate(pieces, axis=0) if len(pieces) > 1 else mx.array(pieces[0])
                )
            self._bufs = bufs
        self._n = np.concatenate([p._n for p in parts])
        self._skip = np.concatenate([p._skip for p in parts])
        self._remaining = np.concatenate([p._remaining for p in parts])
        if any(p._ckpt is not None for p in parts):
            self._ckpt = np.concatenate([p._ckpt if p._ckpt is not None else p._n for p in parts])
            self._high = np.concatenate([p._high if p._high is not None else p._n for p in parts])

    def _fits_in_place(self, others: Sequence[KVLayout]) -> bool:
        """Whether `others`' rows fit this layout's free slots and columns."""
        if self._bufs is None or self.num_rows == 0:
            return False
        rows = sum(o.num_rows for o in others)
        return 0 < rows <= self.slots - self.num_rows and all(
            o._bufs is not None and o.capacity <= self.capacity for o in others
        )

    def _write_rows(self, others: Sequence[KVLayout]) -> None:
        """Write `others`' rows into the free slots after the live rows (in place); their
        columns past the row's own are zeros, as in a batch built by concatenation."""
        assert self._bufs is not None
        at, cap = self.num_rows, self.capacity
        for o in others:
            k = o.num_rows
            for b, ob in zip(self._bufs, o._live(), strict=True):
                b[at : at + k] = _pad_columns(ob, cap)
            at += k

    def extract(self, i: int) -> KVLayout:
        """Row `i` as a new one-row layout of the same kind (contiguous, trimmed)."""
        out = self.empty_like(1)
        out._n = self._n[i : i + 1].copy()
        if self._bufs is not None:
            n = int(self._n[i])
            width = n if self.ring_size is None else min(n, self.ring_size)
            out._bufs = [mx.contiguous(b[i : i + 1, :, :width, :]) for b in self._bufs]
        return out

    def row_positions(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(positions, columns) row `i` currently holds, sorted by position."""
        cap = self.capacity
        pos = self._positions(np, np.arange(cap)[None], self._n[i : i + 1, None])[0]
        cols = np.nonzero(pos >= 0)[0]
        order = np.argsort(pos[cols])
        return pos[cols][order], cols[order]

    def describe(self) -> str:
        extra = ", ".join(f"{k}={v}" for k, v in self._params().items())
        return f"{type(self).__name__}({extra})"

    def __repr__(self) -> str:
        return f"<{self.describe()} rows={self.num_tokens}>"


def _pad_columns(b: mx.array, cap: int) -> mx.array:
    """`b` ([B, H, C, d]) with zero columns after its own up to `cap`."""
    if b.shape[2] >= cap:
        return b
    return mx.concatenate([b, mx.zeros((*b.shape[:2], cap - b.shape[2], b.shape[3]), b.dtype)],
                          axis=2)


_PADDED: dict[tuple[int, int], tuple[mx.array, mx.array]] = {}


def _padded_index(idx: mx.array, free: int) -> mx.array:
    """A column scatter index `[B, 1, S, 1]` with `free` rows of zeros after it (memoized:
    every layer of a step writes the same columns)."""
    key = (id(idx), free)
    hit = _PADDED.get(key)
    if hit is None or hit[0] is not idx:
        if len(_PADDED) > 512:
            _PADDED.clear()
        hit = _PADDED[key] = (idx, mx.pad(idx, [(0, free), (0, 0), (0, 0), (0, 0)]))
    return hit[1]


def free_slots(rows: int) -> int:
    """The most free slots a layout of `rows` live rows keeps when rows leave (`filter`): an
    eighth of its rows, at least two. Free slots hold memory no row uses (the scheduler counts
    it as held) until rows join into them."""
    return max(2, rows // 8)


def _append_plan(
    geo: Geometry, n: np.ndarray, keep: np.ndarray
) -> tuple[int | None, mx.array | None, mx.array | None, int]:
    """(slice start or None, scatter index [B, 1, k, 1], source columns [B, 1, k, 1] or None,
    columns needed) for `KVLayout.append_columns` (k = keep.max())."""
    kmax = int(keep.max())
    j = np.arange(kmax)[None]
    src = None
    if not (keep == kmax).all():  # ragged: a row's extra columns repeat its last kept one
        j = np.minimum(j, keep[:, None] - 1)
        src = mx.array(j, dtype=mx.int32)[:, None, :, None]
    cols = geo.col_of(n[:, None] + j)
    end = int((n + keep).max())
    R = geo.ring_size
    cap = end if R is None else min(R, end)
    c0 = int(cols[0, 0])
    if src is None and bool((cols == c0 + np.arange(kmax)[None]).all()):
        return c0, None, None, cap
    return None, mx.array(cols, dtype=mx.int32)[:, None, :, None], src, cap


class PlainLayout(KVLayout):
    """Full attention, full precision."""

    kind = "plain"

    def __init__(self, num_rows: int = 0) -> None:
        super().__init__(num_rows, codec=PlainCodec())

    def _params(self) -> dict[str, Any]:
        return {}


class QuantizedLayout(KVLayout):
    """Full attention, MLX affine-quantized K/V (`bits`, `group_size` route mlx-lm's SDPA)."""

    kind = "quantized"

    def __init__(self, num_rows: int = 0, bits: int = 8, group_size: int = 64) -> None:
        super().__init__(num_rows, codec=QuantizedCodec(bits=bits, group_size=group_size))
        self.bits = bits
        self.group_size = group_size

    def _params(self) -> dict[str, Any]:
        return {"bits": self.bits, "group_size": self.group_size}


class RotatingLayout(KVLayout):
    """Sliding window of `window` tokens (`keep` of them sinks) in a ring of window + slack."""

    kind = "rotating"

    def __init__(self, num_rows: int = 0, window: int = 256, keep: int = 0, slack: int = 0) -> None:
        super().__init__(num_rows, codec=PlainCodec(), window=window, keep=keep, slack=slack)

    def _params(self) -> dict[str, Any]:
        return {"window": self.window, "keep": self.keep, "slack": self.slack}


class QuantizedRotatingLayout(KVLayout):
    """Ring layout with quantized K/V."""

    kind = "rotating_quantized"

    def __init__(
        self,
        num_rows: int = 0,
        window: int = 256,
        keep: int = 0,
        slack: int = 0,
        bits: int = 8,
        group_size: int = 64,
    ) -> None:
        codec = QuantizedCodec(bits=bits, group_size=group_size)
        super().__init__(num_rows, codec=codec, window=window, keep=keep, slack=slack)
        self.bits = bits
        self.group_size = group_size

    def _params(self) -> dict[str, Any]:
        return {
            "window": self.window,
            "keep": self.keep,
            "slack": self.slack,
            "bits": self.bits,
            "group_size": self.group_size,
        }
