"""Stable key widths for multi-token forwards on CUDA (the verify forward, a draft's first step).

MLX's CUDA backend runs attention with more than one query through cuDNN and caches one cuDNN
graph per (q, k, v, mask) shape. A verify forward over `[next, d_1..d_k]` sees keys as wide as
the longest row, which grows with every accepted token, so without care every speculative step
builds new graphs (tens of ms each: the first H200 run of bench/spec.py spent ~90 ms per
verify step on it, 20x a plain decode step). `wide(caches)` gives the model views of the
layouts that widen the keys, values and mask to the layout's allocated capacity (a multiple of
256 columns, or the ring), so the shapes repeat for 256 tokens at a time; the extra columns
are masked out and no data is copied (they are slices of the layout's own buffers).

Worked example: a full-attention row of 300 tokens verifies 5 columns. The layout returns
305 key columns and a `[B, 1, 5, 305]` mask; the view returns the buffer's first 512 columns
and the mask padded with False to 512, the same shapes as for every width from 257 to 512.

Since mlxd sets `MLX_CUDA_USE_CUDNN_SDPA=0` by default (engine/__init__.py), attention over
several queries runs MLX's plain-op attention with no per-shape graph; the views stay for
`MLX_CUDA_USE_CUDNN_SDPA=1` and cost only the masked columns.

Only plain-codec attention layouts are widened (quantized ones attend through
quantized matmuls, recurrent ones have no keys). Elsewhere (CPU, Metal) attention with several
queries has no per-shape setup, so `wide` returns the layouts unchanged unless forced.
"""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx

from engine.kv.attention import PlainLayout, RotatingLayout
from kernels.common import gpu_backend

STEP = 256  # the layouts allocate columns in multiples of this
_FORCE = os.environ.get("MLXD_WIDE_KV", "") == "1"  # tests: exercise the views on a CPU


def wide_enabled() -> bool:
    return _FORCE or gpu_backend() == "cuda"


def wide(caches: list[Any], force: bool = False) -> list[Any]:
    """The model-side views to pass as `cache=` for a forward of several tokens per row."""
    if not (force or wide_enabled()):
        return caches
    return [_Wide(c) if type(c) in (PlainLayout, RotatingLayout) else c for c in caches]


class LayoutView:
    """What a model sees of a layout: everything delegated to it, for subclasses to override a
    method or two (`_Wide` here, `evalpoints._EvalPoint`)."""

    __slots__ = ("layout",)

    def __init__(self, layout: Any) -> None:
        self.layout = layout

    def __getattr__(self, name: str) -> Any:
        return getattr(self.layout, name)

    @property
    def offset(self) -> mx.array:
        return self.layout.offset

    @property
    def state(self) -> list[mx.array]:
        return self.layout.state


class _Wide(LayoutView):
    """`offset`, `make_mask` and `update_and_fetch` of a layout, keys widened (see above)."""

    __slots__ = ()

    def _target(self, width: int, num_new: int) -> int:
        lay = self.layout
        if lay.is_ring and num_new > lay.slack + 1:
            return width  # the layout attends over [ring, chunk]: not a slice of its buffer
        target = -(-width // STEP) * STEP
        if lay.ring_size is not None:
            target = min(target, lay.ring_size)
        return max(target, width)

    def make_mask(
        self, N: int, window_size: int | None = None, return_array: bool = False, **kw: Any
    ) -> mx.array:
        del return_array  # an array is needed to mask the extra columns
        mask = self.layout.make_mask(N, window_size=window_size, return_array=True, **kw)
        width = mask.shape[-1]
        target = self._target(width, N)
        if target == width:
            return mask
        pad = mx.zeros((*mask.shape[:-1], target - width), dtype=mx.bool_)
        return mx.concatenate([mask, pad], axis=-1)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        num_new = keys.shape[2]
        k, v = self.layout.update_and_fetch(keys, values)
        width = k.shape[2]
        target = self._target(width, num_new)
        if target == width:
            return k, v
        kb, vb = self.layout.state
        if kb.shape[2] >= target:
            return kb[..., :target, :], vb[..., :target, :]
        pad = [(0, 0), (0, 0), (0, target - width), (0, 0)]
        return mx.pad(k, pad), mx.pad(v, pad)
