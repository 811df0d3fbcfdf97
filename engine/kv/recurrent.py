"""Batched recurrent state (conv + SSM / gated-DeltaNet state) for hybrid models.

`RecurrentLayout` is what mlx-lm's linear-attention mixers expect from an `ArraysCache`:
`cache[0]` (conv tail `[B, K-1, C]`), `cache[1]` (state `[B, Hv, Dv, Dk]`), `cache.lengths`,
`cache.advance(S)` and `make_mask(S)` (`[B, S]` bool, True = real token).

Padding. `prepare(left_padding=..., lengths=...)` has the same meaning as for the KV layouts:
`left_padding[b]` pads, then `lengths[b]` real tokens. The mask is False on every pad, and the
mixers (qwen3_next, qwen3_5) zero masked inputs before the conv and skip masked steps in the
recurrence, so a pad never updates the state. Right pads are exact for any row; `cache.lengths`
(end of the real tokens in the chunk) makes the conv tail end at the last real token. Left
pads are exact only for a row with no state yet (they act like the zero initial conv tail), so
`prepare` refuses left padding on a row that already has state.

Worked example: rows A (state after 7 tokens) and B (fresh) take one chunk of width 4,
`prepare(lengths=[2, 4])`: mask = [[1 1 0 0], [1 1 1 1]]; A's state absorbs 2 tokens and its
conv tail is taken ending at column 2; B absorbs 4.

Speculation (the choice made here). A recurrence cannot be "un-applied", so rollback needs the
state after every draft position. `checkpoint()` starts capturing: every `advance()` records a
snapshot (the arrays are immutable, so a snapshot is a list of references). Mixers made
*stepping* by `install_stepping()` (the registry does it for the hybrid architectures) run a
multi-token chunk one token at a time while capturing, which yields one snapshot per position
with no recomputation: the same work as the batched call, in k+1 smaller steps, and the same
arithmetic as plain one-token decoding. `rollback(accepted)` then picks, per row, the snapshot
after `accepted[b]` columns. Cost: (k+1) state copies per recurrent layer per round.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np

from engine.kv.geometry import UNBOUNDED

if TYPE_CHECKING:  # types only: this module does not depend on the attention layouts
    from engine.kv.attention import RowMove


class RecurrentLayout:
    kind = "recurrent"

    def __init__(self, num_rows: int = 0, size: int = 2) -> None:
        self.cache: list[mx.array | None] = [None] * size
        self._n = np.zeros(num_rows, dtype=np.int64)
        self._skip = np.zeros(num_rows, dtype=np.int64)
        self._remaining = np.full(num_rows, UNBOUNDED, dtype=np.int64)
        self._ckpt_n: np.ndarray | None = None
        self._snaps: list[tuple[int, list[mx.array | None]]] | None = None

    # ---------------------------------------------------------------- model side

    def __getitem__(self, idx: int) -> mx.array | None:
        return self.cache[idx]

    def __setitem__(self, idx: int, value: mx.array | None) -> None:
        self.cache[idx] = value

    @property
    def num_rows(self) -> int:
        return int(self._n.shape[0])

    @property
    def num_tokens(self) -> list[int]:
        return self._n.tolist()

    @property
    def offset(self) -> mx.array:
        return mx.array(self._n - self._skip, dtype=mx.int32)

    @property
    def lengths(self) -> mx.array | None:
        """End (exclusive) of each row's real tokens within the current chunk, or None."""
        if (self._remaining >= UNBOUNDED).all():
            return None
        end = self._skip + np.minimum(self._remaining, 1 << 30)
        return mx.array(end, dtype=mx.int32)

    def make_mask(self, N: int, **_: Any) -> mx.array | None:
        if not self._skip.any() and (self._remaining >= UNBOUNDED).all():
            return None
        pos = np.arange(N)[None]
        mask = (pos >= self._skip[:, None]) & (pos < (self._skip + self._remaining)[:, None])
        return mx.array(mask)

    def advance(self, N: int) -> None:
        skip = np.minimum(self._skip, N)
        real = np.clip(np.minimum(N - skip, self._remaining), 0, None)
        self._n = self._n + real
        self._skip = self._skip - skip
        self._remaining = np.where(self._remaining >= UNBOUNDED, UNBOUNDED, self._remaining - real)
        if self._snaps is not None:
            self._snaps.append((self._snaps[-1][0] + N, list(self.cache)))

    @property
    def state(self) -> list[mx.array]:
        return [c for c in self.cache if c is not None]

    @property
    def nbytes(self) -> int:
        return sum(int(c.nbytes) for c in self.cache if c is not None)

    def bytes_per_row(self) -> int | None:
        if any(c is None for c in self.cache) or self.num_rows == 0:
            return None
        return self.nbytes // self.num_rows

    def empty(self) -> bool:
        return self.cache[0] is None

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
        del right_padding
        if left_padding is not None:
            lp = np.asarray(left_padding, dtype=np.int64)
            if ((lp > 0) & (self._n > 0)).any():
                raise ValueError(
                    "left padding on a row with recurrent state would corrupt it; pad on the right"
                )
            self._skip = lp.copy()
        if lengths is not None:
            self._remaining = np.asarray(lengths, dtype=np.int64).copy()

    def finalize(self) -> None:
        self._skip = np.zeros_like(self._n)
        self._remaining = np.full_like(self._n, UNBOUNDED)

    # ---------------------------------------------------------------- speculation

    @property
    def capturing(self) -> bool:
        return self._snaps is not None

    def checkpoint(self) -> None:
        self._ckpt_n = self._n.copy()
        self._snaps = [(0, list(self.cache))]

    def commit(self) -> None:
        self._ckpt_n = self._snaps = None

    def rollback(self, accepted: Sequence[int] | np.ndarray | mx.array) -> None:
        """Each row keeps the state after `accepted[b]` of the columns since `checkpoint()`."""
        if self._snaps is None or self._ckpt_n is None:
            raise RuntimeError("rollback() without checkpoint()")
        acc = np.asarray(accepted, dtype=np.int64).reshape(-1)
        counts = {c: i for i, (c, _) in enumerate(self._snaps)}
        missing = sorted({int(a) for a in acc if int(a) not in counts})
        if missing:
            raise ValueError(
                f"no recurrent snapshot after {missing} columns (have {sorted(counts)}); "
                "make the mixers stepping (engine.models.prepare_model) before speculating"
            )
        pick = [counts[int(a)] for a in acc]
        if len(set(pick)) == 1:
            self.cache = list(self._snaps[pick[0]][1])
        else:
            rows = mx.arange(self.num_rows)
            sel = mx.array(pick, dtype=mx.int32)
            new: list[mx.array | None] = []
            for e in range(len(self.cache)):
                ref = next((s[e] for _, s in self._snaps if s[e] is not None), None)
                if ref is None:
                    new.append(None)
                    continue
                stack = mx.stack([_or_zeros(s[e], ref) for _, s in self._snaps])
                new.append(stack[sel, rows])
            self.cache = new
        # columns the row did not accept were real or pads; either way they are gone now
        self._n = self._ckpt_n + np.minimum(acc, self._n - self._ckpt_n)
        self._ckpt_n = self._snaps = None

    # ---------------------------------------------------------------- batch side

    def empty_like(self, num_rows: int = 0) -> RecurrentLayout:
        return RecurrentLayout(num_rows, size=len(self.cache))

    def same_kind(self, other: Any) -> bool:
        return isinstance(other, RecurrentLayout) and len(other.cache) == len(self.cache)

    def filter(
        self, keep: Sequence[int] | np.ndarray | mx.array, moves: list[RowMove] | None = None
    ) -> None:
        """Keep these rows, in this order (gathered: a state is small). `moves` is
        `KVLayout.filter`'s; nothing is ever deferred here."""
        idx = np.asarray(keep, dtype=np.int64).reshape(-1)
        idx_mx = mx.array(idx, dtype=mx.int32)
        self.cache = [c[idx_mx] if c is not None else None for c in self.cache]
        self._n, self._skip, self._remaining = self._n[idx], self._skip[idx], self._remaining[idx]
        if self._snaps is not None and self._ckpt_n is not None:
            self._ckpt_n = self._ckpt_n[idx]
            self._snaps = [
                (c, [a[idx_mx] if a is not None else None for a in s]) for c, s in self._snaps
            ]

    def extend(self, other: RecurrentLayout) -> None:
        self._concat_rows([other])

    def merge(self, rows: Sequence[Any]) -> RecurrentLayout:
        """Admit rows (RecurrentLayouts or mlx-lm one-row ArraysCaches) after ours.

        An mlx-lm ArraysCache does not count tokens; its row is recorded as 1 token when it has
        state (enough for the left-padding guard), so prefer our own layouts for prefill.
        """
        self._concat_rows([self._adopt(r) for r in rows])
        return self

    def _adopt(self, row: Any) -> RecurrentLayout:
        if isinstance(row, RecurrentLayout):
            return row
        out = self.empty_like(1)
        out.cache = list(row.cache)
        if len(out.cache) != len(self.cache):
            raise ValueError("recurrent state sizes differ")
        out._n = np.array([0 if out.cache[0] is None else 1], dtype=np.int64)
        return out

    def _concat_rows(self, others: Sequence[RecurrentLayout]) -> None:
        parts = [p for p in [self, *others] if p.num_rows > 0]
        for o in others:
            if not self.same_kind(o):
                raise ValueError("cannot join recurrent layouts of different sizes")
        new: list[mx.array | None] = []
        for e in range(len(self.cache)):
            ref = next((p.cache[e] for p in parts if p.cache[e] is not None), None)
            if ref is None:
                new.append(None)
                continue
            pieces = [_or_zeros(p.cache[e], ref, p.num_rows) for p in parts]
            new.append(mx.concatenate(pieces) if len(pieces) > 1 else pieces[0])
        self.cache = new
        self._n = np.concatenate([self._n, *(o._n for o in others)])
        self._skip = np.concatenate([self._skip, *(o._skip for o in others)])
        self._remaining = np.concatenate([self._remaining, *(o._remaining for o in others)])
        self._ckpt_n = self._snaps = None

    def extract(self, i: int) -> RecurrentLayout:
        out = self.empty_like(1)
        out.cache = [mx.contiguous(c[i : i + 1]) if c is not None else None for c in self.cache]
        out._n = self._n[i : i + 1].copy()
        return out

    def describe(self) -> str:
        return f"RecurrentLayout(size={len(self.cache)})"

    def __repr__(self) -> str:
        return f"<{self.describe()} rows={self.num_tokens}>"


class _SteppingMixer:
    """Mixin: while the cache captures snapshots, feed a chunk one token at a time."""

    def __call__(self, x: mx.array, mask: mx.array | None = None, cache: Any = None) -> mx.array:
        call = super().__call__  # type: ignore[misc]
        if x.shape[1] == 1 or not isinstance(cache, RecurrentLayout) or not cache.capturing:
            return call(x, mask, cache)
        outs = [
            call(x[:, t : t + 1], None if mask is None else mask[:, t : t + 1], cache)
            for t in range(x.shape[1])
        ]
        return mx.concatenate(outs, axis=1)


_STEPPING_CLASSES: dict[type, type] = {}


def install_stepping(module: Any) -> None:
    """Make a recurrent mixer module stepping (in place; parameters and names unchanged)."""
    cls = type(module)
    if issubclass(cls, _SteppingMixer):
        return
    if cls not in _STEPPING_CLASSES:
        _STEPPING_CLASSES[cls] = type(f"Stepping{cls.__name__}", (_SteppingMixer, cls), {})
    module.__class__ = _STEPPING_CLASSES[cls]


def is_stepping(module: Any) -> bool:
    """Whether `install_stepping` made this mixer feed a captured chunk one token at a time."""
    return isinstance(module, _SteppingMixer)


def _or_zeros(x: mx.array | None, ref: mx.array, num_rows: int | None = None) -> mx.array:
    """`x`, or zeros shaped as `ref` (with `num_rows` rows, when given) where it is missing."""
    if x is not None:
        return x
    if num_rows is None:
        return mx.zeros_like(ref)
    return mx.zeros((num_rows, *ref.shape[1:]), ref.dtype)
