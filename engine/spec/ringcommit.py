"""A verify round on sliding-window rings without ring slack: write only the accepted columns.

Why. Rolling a ring back after a round needs `slack >= K` spare columns (engine/kv/attention.py),
so a ring of `window + slack` columns holds `slack` positions that are outside every query's
window. Plain decode steps then need an array mask for those columns on every sliding layer,
and on MLX-CUDA an array mask takes single-query attention off its vector kernel (cuDNN or the
unfused fallback instead). With one row and a full ring the plain engine passes no mask at all,
so a speculative engine's *plain* steps were not the plain engine's steps. Here the target's
rings keep the plain engine's shape (no slack), and a round never needs to roll them back:

    views = RingRound(caches, width)     # before the verify forward
    model(tokens, cache=views.model_caches)
    views.finish(accepted + 1)           # after the verdict

`model_caches` hands the forward, for each ring that a `width`-column chunk would write past
its slack, a view over a shallow copy of the layout: the forward attends over [ring, chunk]
exactly as the layout itself does for a chunk wider than its slack (engine.kv.geometry), the
copy takes the writes, and the view records the chunk's keys and values. `finish(keep)` drops
the copies and writes each row's first `keep[b]` columns into the real ring
(`KVLayout.append_columns`: what `prepare(lengths=keep)` + the chunk would leave, as one column
write per buffer, its plan shared by every ring of the round), so the ring ends exactly as if
only the kept tokens had ever been decoded. Every other layout (full
attention, recurrent, a ring whose slack covers the round) is checkpointed and rolled back as
before.

Worked example (window 4, no slack, one row that has seen 10 tokens: columns hold positions
[8 9 6 7]). A round of width 3 (positions 10, 11, 12): the forward attends over the 4 ring
columns and the 3 new ones (position 12 sees 9..12, position 10 sees 7..10). One draft
accepted: keep 2, so positions 10 and 11 are written (columns 2, 3): the ring holds
[8 9 10 11], what plain decoding of those two tokens would have left. Position 12's keys are
dropped; the columns of positions 6 and 7, still needed by position 10's query during the
round, were never overwritten in the real ring.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from engine.kv import batch as kvb


def defers(layout: Any, width: int) -> bool:
    """Whether a round of `width` columns writes `layout` deferred (a ring without the slack
    to roll it back; its own multi-column path never writes the real buffers in place)."""
    return bool(getattr(layout, "is_ring", False)) and width > int(layout.slack) + 1


class _Deferred:
    """The model-side face of a ring for one verify forward: a shallow copy takes the write
    (announced as 0 real columns a row, and the layout's wide-chunk path rebinds rather than
    mutates, so the real layout is untouched) and the chunk's keys and values are kept for
    `RingRound.finish`."""

    __slots__ = ("shadow", "keys", "values")

    def __init__(self, layout: Any) -> None:
        self.shadow = _shallow_copy(layout)
        # the shadow keeps nothing of the chunk (0 real columns a row): the forward still
        # attends over [ring, chunk], and no fold-in is built on the host for nothing
        self.shadow.prepare(lengths=[0] * layout.num_rows)
        self.keys: mx.array | None = None
        self.values: mx.array | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.shadow, name)

    @property
    def offset(self) -> mx.array:
        return self.shadow.offset

    @property
    def state(self) -> list[mx.array]:
        return self.shadow.state

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        if self.keys is not None:
            raise RuntimeError("a deferred ring takes one chunk per round")
        self.keys, self.values = keys, values
        return self.shadow.update_and_fetch(keys, values)


def _shallow_copy(layout: Any) -> Any:
    """`copy.copy` without the reduce protocol (a round makes one per ring layer)."""
    if not hasattr(layout, "__dict__"):
        return copy.copy(layout)
    out = object.__new__(type(layout))
    out.__dict__.update(layout.__dict__)
    return out


class RingRound:
    """One verify round over the target's layouts (see the module docstring)."""

    __slots__ = ("layouts", "model_caches", "_deferred", "_others")

    def __init__(self, layouts: list[Any], width: int) -> None:
        self.layouts = layouts
        self.model_caches: list[Any] = []
        self._deferred: list[tuple[Any, _Deferred]] = []
        self._others: list[Any] = []
        for layout in layouts:
            if defers(layout, width):
                view = _Deferred(layout)
                self._deferred.append((layout, view))
                self.model_caches.append(view)
            else:
                self._others.append(layout)
                self.model_caches.append(layout)
        kvb.checkpoint(self._others)

    def finish(self, keep: Sequence[int] | np.ndarray) -> None:
        """Row b keeps the first `keep[b]` columns of the round."""
        keep = np.asarray(keep, dtype=np.int64)
        kvb.rollback(self._others, keep)
        memo: dict = {}  # one write plan for every ring of the same geometry
        for layout, view in self._deferred:
            if view.keys is None or view.values is None:
                raise RuntimeError("the verify forward never reached a deferred ring")
            layout.append_columns(view.keys, view.values, keep, memo)  # kept columns only
        self._deferred = []
