"""Skinny matmuls on CUDA: a few rows of x times a weight through MLX's gemv kernel.

MLX-CUDA multiplies by its own gemv kernel only when x has one row; from two rows on it calls
cuBLASLt, which costs tens of µs of setup per call. A small model's forward has ~60 matmuls,
so a decode step of 2+ rows or a speculative verify of 2–9 columns costs about twice a one-row
step on the H200 (bench/step_costs.py), although the arithmetic barely grows.

`rows_matmul` views x[M, K] as M batches of one row, laid out so that MLX neither copies it nor
folds the batches back into M (shape [M, 1, K], strides (K, 1, 1): each batch is a one-row
"transposed" matrix), and multiplies by the shared W.T: one batched gemv launch that reads W
once per row. That trade — M reads of W against one cuBLASLt setup — pays while the extra
reads are cheap: `max_rows` allows it only while (M − 1) · bytes(W) stays under
`MLXD_SKINNY_BYTES` (default 64 MiB, ~15 µs of H200 bandwidth), and never beyond
`MLXD_SKINNY_ROWS` rows (16). Large models keep cuBLASLt.

`install(model)` swaps the class of every plain `nn.Linear` (and of a tied embedding's
`as_linear`) for a subclass with that dispatch; parameters, names and saving are unchanged.
It is a no-op unless the default device is a CUDA GPU (or `force`); bench/small_m.py measures
the per-call costs and tests/test_skinny.py checks that results equal the plain matmul.
"""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx
import mlx.nn as nn

MAX_ROWS = int(os.environ.get("MLXD_SKINNY_ROWS", "16"))
MAX_EXTRA_BYTES = int(os.environ.get("MLXD_SKINNY_BYTES", str(64 << 20)))


def enabled() -> bool:
    if os.environ.get("MLXD_SKINNY", "") == "0":
        return False
    cuda = getattr(mx, "cuda", None)
    return mx.default_device().type == mx.gpu and cuda is not None and bool(cuda.is_available())


def max_rows(weight: mx.array) -> int:
    """The most rows of x for which the batched gemv beats cuBLASLt on this weight."""
    if weight.ndim != 2 or weight.shape[1] % 32:
        return 0  # MLX's gemv needs K % 32 == 0 here
    return min(MAX_ROWS, 1 + MAX_EXTRA_BYTES // max(1, weight.nbytes))


def rows_matmul(x: mx.array, weight: mx.array) -> mx.array:
    """x @ weight.T as one batched gemv (see the module docstring)."""
    k = x.shape[-1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    y = mx.swapaxes(x2[:, :, None], 1, 2) @ weight.T
    return y.reshape(*lead, weight.shape[0])


def _rows(x: mx.array) -> int:
    return x.size // x.shape[-1] if x.ndim else 0


class SkinnyLinear(nn.Linear):
    def __call__(self, x: mx.array) -> mx.array:
        w = self["weight"]
        m = _rows(x)
        if 2 <= m <= max_rows(w):
            y = rows_matmul(x, w)
            return y + self["bias"] if "bias" in self else y
        return super().__call__(x)


class SkinnyEmbedding(nn.Embedding):
    def as_linear(self, x: mx.array) -> mx.array:
        w = self["weight"]
        m = _rows(x)
        if 2 <= m <= max_rows(w):
            return rows_matmul(x, w)
        return super().as_linear(x)


def install(model: Any, force: bool = False) -> int:
    """Swap plain Linear / Embedding modules of `model` to the skinny dispatch; returns how many."""
    if not (force or enabled()):
        return 0
    count = 0
    for _, module in model.named_modules():
        if type(module) is nn.Linear:
            module.__class__ = SkinnyLinear
            count += 1
        elif type(module) is nn.Embedding:
            module.__class__ = SkinnyEmbedding
            count += 1
    return count
