"""Where each position lives, what each query sees, and the plan for the next write.

A `Geometry` is full (`window=None`: position p at column p) or a ring of `window + slack`
columns whose first `keep` hold the sink tokens: `col(p) = p if p < keep else keep + (p -
keep) % (window + slack - keep)`. `Step` is everything about the next `update_and_fetch` that
depends only on the rows' lengths and padding; all layers of one kind share those, so a step is
planned once per forward (`plan_step` memoizes it) and `make_mask` and every layer's update
agree on it by construction. A step also carries the rows' lengths after it (read-only arrays
every layer takes as its own), so the next step's layers hold the very same arrays and find
their plan by identity, without hashing the lengths again: a decode step of a 32-layer model
plans ~64 times.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

UNBOUNDED = np.iinfo(np.int64).max // 4  # "no right padding announced"
_NUMPY_MASK_MAX = 1 << 18  # masks up to this many entries are built on the host


def round_up(x: int, step: int) -> int:
    return (x + step - 1) // step * step


def ring_positions(xp: Any, cols: Any, ends: Any, keep: int, ring: int) -> Any:
    """Position held by each column of a ring for rows that have written positions `< ends`.

    `cols` is `[K]` (or `[1, K]`), `ends` `[B, 1]`; returns `[B, K]` with -1 where the column
    holds nothing. Works with numpy or mlx (`xp`).
    """
    sink = (cols < keep) & (cols < ends)
    j = cols - keep
    t = ends - 1 - keep - j
    valid = (cols >= keep) & (t >= 0)
    t = xp.maximum(t, 0)
    recent = keep + j + ring * (t // ring)
    return xp.where(sink, cols, xp.where(valid, recent, -1))


@dataclass(frozen=True, slots=True)
class Geometry:
    window: int | None
    keep: int = 0
    slack: int = 0

    @property
    def ring_size(self) -> int | None:
        return None if self.window is None else self.window + self.slack

    def col_of(self, positions: np.ndarray) -> np.ndarray:
        if self.window is None:
            return positions
        ring = self.window + self.slack - self.keep
        return np.where(
            positions < self.keep, positions, self.keep + (positions - self.keep) % ring
        )

    def positions(self, xp: Any, cols: Any, ends: Any) -> Any:
        """`[B, K]` position held by each column (-1: nothing) for rows written up to `ends`."""
        if self.window is None:
            return xp.where(cols < ends, cols, -1)
        ring = self.window + self.slack - self.keep
        return ring_positions(xp, cols, ends, self.keep, ring)


@dataclass(slots=True)
class Step:
    direct: bool  # write in place (else: attend over [ring, chunk] and fold the chunk in)
    skip: np.ndarray  # left pads in this chunk, per row (read-only: shared by all layers)
    real: np.ndarray  # real tokens in this chunk, per row (read-only)
    cap: int  # columns needed after the update
    num_old: int  # old columns returned in front of the chunk (fold-in path)
    width: int  # columns returned to attention
    uniform: bool  # full layout, equal rows, no left pads: mlx-lm's own masks apply
    roll: mx.array | None  # gather index that moves left pads to the end
    write_start: int | None  # every row writes columns [write_start, write_start + S)
    write_idx: mx.array | None  # else: scatter index [B, 1, S, 1]
    # the rows' state after the step (read-only, shared by every layer that takes the step)
    n_after: np.ndarray  # n + real
    skip_after: np.ndarray  # left pads still to come
    remaining_after: np.ndarray  # real tokens still announced (UNBOUNDED: none announced)


_STEPS: dict[tuple, Step] = {}
_OFFSETS: dict[tuple, mx.array] = {}
# the last plans by identity: (id(geometry), id(n), capacity, num_new) -> (geometry, n, skip,
# remaining, step); the entries hold their arrays, so an id is not reused while it is a key
_RECENT: dict[tuple[int, int, int, int], tuple[Geometry, np.ndarray, np.ndarray, np.ndarray, Step]] = {}
_RECENT_OFFSETS: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, mx.array]] = {}
_GEOMETRIES: dict[Geometry, Geometry] = {}


def clear_plans() -> None:
    """Forget the memoized step plans (a benchmark's runs then each start as a fresh process
    would, instead of the second of two identical runs finding every plan made)."""
    _STEPS.clear()
    _OFFSETS.clear()
    _RECENT.clear()
    _RECENT_OFFSETS.clear()


def shared(geo: Geometry) -> Geometry:
    """The one instance of `geo`'s value (layouts of one kind share it, and with it their
    plans by identity)."""
    return _GEOMETRIES.setdefault(geo, geo)


def plan_step(
    geo: Geometry,
    n: np.ndarray,
    skip_left: np.ndarray,
    remaining: np.ndarray,
    capacity: int,
    num_new: int,
) -> Step:
    """The plan for writing `num_new` columns into rows of lengths `n` (memoized: by the
    arrays' identity, then by their values)."""
    fast = (id(geo), id(n), capacity, num_new)
    hit = _RECENT.get(fast)
    if hit is not None and hit[0] is geo and hit[1] is n and hit[2] is skip_left and hit[3] is remaining:
        return hit[4]
    key = (num_new, geo, capacity, n.tobytes(), skip_left.tobytes(), remaining.tobytes())
    step = _STEPS.get(key)
    if step is None:
        if len(_STEPS) > 512:
            _STEPS.clear()
        step = _STEPS[key] = _make_step(geo, n, skip_left, remaining, capacity, num_new)
    if len(_RECENT) > 64:
        _RECENT.clear()
    _RECENT[fast] = (geo, n, skip_left, remaining, step)
    return step


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def _make_step(
    geo: Geometry,
    n: np.ndarray,
    skip_left: np.ndarray,
    remaining: np.ndarray,
    capacity: int,
    num_new: int,
) -> Step:
    rows = n.shape[0]
    skip = np.minimum(skip_left, num_new)
    real = np.clip(np.minimum(num_new - skip, remaining), 0, None)
    skip.flags.writeable = real.flags.writeable = False
    after = (
        _frozen(n + real),
        _frozen(skip_left - skip) if skip.any() else _frozen(skip_left.copy()),
        _frozen(np.where(remaining >= UNBOUNDED, UNBOUNDED, remaining - real))
        if (remaining < UNBOUNDED).any() else _frozen(remaining.copy()),
    )
    top = int(n.max()) if rows else 0
    R = geo.ring_size
    roll = None
    if skip.any():
        idx = (np.arange(num_new)[None] + skip[:, None]) % num_new
        roll = mx.array(idx, dtype=mx.int32)[:, None, :, None]
    # trailing pads (a right-padded chunk) keep the causal form: a real query sees no column
    # past its own, so it never sees them, and the pads' own outputs are thrown away
    uniform = R is None and rows > 0 and not skip.any() and bool((n == n[0]).all())
    if R is None or num_new <= geo.slack + 1:
        # write all columns in place (pads included: they land on free/out-of-window slots)
        cap = top + num_new if R is None else min(R, top + num_new)
        cols = geo.col_of(n[:, None] + np.arange(num_new)[None])
        write_start, write_idx = None, None
        c0 = int(cols[0, 0]) if cols.size else 0
        if cols.size and bool((cols == c0 + np.arange(num_new)[None]).all()):
            write_start = c0
        elif cols.size:
            write_idx = mx.array(cols, dtype=mx.int32)[:, None, :, None]
        return Step(True, skip, real, cap, 0, cap, uniform, roll, write_start, write_idx, *after)
    # chunk wider than the slack: attend over [ring, new chunk], then fold the chunk in
    num_old = min(R, top, capacity)
    cap = min(R, int((n + real).max()) if rows else 0)
    return Step(False, skip, real, cap, num_old, num_old + num_new, uniform, roll, None, None, *after)


def row_offsets(n: np.ndarray, skip_left: np.ndarray) -> mx.array:
    """`[B]` int32 RoPE position of the next chunk's first column (memoized: by the arrays'
    identity, then by their values)."""
    hit = _RECENT_OFFSETS.get((id(n), id(skip_left)))
    if hit is not None and hit[0] is n and hit[1] is skip_left:
        return hit[2]
    key = (n.tobytes(), skip_left.tobytes())
    off = _OFFSETS.get(key)
    if off is None:
        if len(_OFFSETS) > 512:
            _OFFSETS.clear()
        off = _OFFSETS[key] = mx.array(n - skip_left, dtype=mx.int32)
    if len(_RECENT_OFFSETS) > 64:
        _RECENT_OFFSETS.clear()
    _RECENT_OFFSETS[(id(n), id(skip_left))] = (n, skip_left, off)
    return off


def build_mask(
    geo: Geometry,
    n: np.ndarray,
    step: Step,
    N: int,
    span: int | None,
    return_array: bool,
) -> mx.array | str | None:
    """Boolean `[B, 1, N, K]`: query j of row b (position `n[b] - skip[b] + j`) sees column c
    iff the column holds a position p <= q with p < keep or p > q - (span - keep)."""
    if step.uniform:
        n0 = int(n[0])
        if span is None and not return_array:
            return "causal" if N > 1 else None
        rinds = mx.arange(n0 + N)[None]
        linds = mx.arange(n0, n0 + N)[:, None]
        mask = linds >= rinds
        if span is not None:
            mask = mask & (linds < rinds + span)
        return mask
    nc = n[:, None]
    q = np.maximum(nc - step.skip[:, None] + np.arange(N)[None], nc)  # pads see real columns
    if (step.direct and geo.window is None and span is None
            and len(n) * N * step.width > _NUMPY_MASK_MAX):
        # a full layout's column c holds position c (or nothing, past the row's end): query q
        # sees exactly c <= q. Built on the device from q alone, not from [B, K] host positions
        # (a decode step of 64 rows over 16k columns: 2.6 ms of host work a forward otherwise)
        cols = mx.arange(step.width, dtype=mx.int32)[None, None, :]
        return (cols <= mx.array(q, dtype=mx.int32)[:, :, None])[:, None]
    if step.direct:
        pos = geo.positions(np, np.arange(step.width)[None], nc + N)
    else:
        old = geo.positions(np, np.arange(step.num_old)[None], nc)
        pos = np.concatenate([old, nc + np.arange(N)[None]], axis=1)
    xp: Any = np if pos.shape[0] * N * pos.shape[1] <= _NUMPY_MASK_MAX else mx
    if xp is mx:
        pos, q = mx.array(pos, dtype=mx.int32), mx.array(q, dtype=mx.int32)
    pos, q = pos[:, None, :], q[:, :, None]
    mask = (pos >= 0) & (pos <= q)
    if span is not None:
        mask = mask & ((pos > q - (span - geo.keep)) | (pos < geo.keep))
    if xp is np and not return_array and mask.all():
        return None  # every query sees every column (e.g. one row on a full ring): no mask
    return mx.array(mask[:, None]) if xp is np else mask[:, None]
