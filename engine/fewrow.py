"""Few-row matmuls on CUDA as one gathered gemv: x with `MIN_ROWS`..`MAX_ROWS` rows times a weight.

MLX-CUDA multiplies by its gemv kernel only when x has one row; from two rows on it calls
cuBLASLt, which costs 2-3x the gemv per call at decode sizes (H200, bf16: 16-28 µs against
6-8 µs at 384-1024 wide). A small model's step has ~60 matmuls, so a plain decode step of 4 rows
or a verify of 2-9 columns cost 2-2.5x a one-row step, although the arithmetic barely grows.

`mx.gather_mm(x[m, 1, K], W.T[1, K, N], lhs=arange(m), rhs=zeros(m))` is a built-in op whose
CUDA path (one row per gathered matrix, a transposed right-hand side) is MLX's `gemv_gather`
kernel: m gemvs in one launch, each row computed by the same code as the one-row gemv (so a
row's result does not depend on how many rows share the call), with the weight read once per
row from L2. One call, and no custom-kernel dispatch cost (a fused custom kernel measured
slower than cuBLASLt for that reason).

`FewRowLinear` / `FewRowEmbedding.as_linear` (a tied lm_head) route x with `MIN_ROWS`..`MAX_ROWS`
(3..16) rows in all (leading dims flattened) through `gather_matmul` when x and the weight share a
float dtype, K % 32 == 0, the rows times the weight's bytes are at most `MAX_BYTES` (8 MiB: each
row reads the whole weight, so a large weight or many rows make it memory-bound) and the default
device is the GPU; everything else (one row, two rows, prefill chunks, large weights such as
tinycoder's 8192 x 384 lm_head at 6 MB a row, other dtypes) goes to the plain matmul.

Measured on the H200 (bf16, µs per call in a chain of 56 calls, cuBLASLt / gathered): 384 x 384
at 3..16 rows 21.9-22.7 / 18.7-20.6; 1024 x 1024 at 3..16 rows 22.6-27.5 / 20.0-22.9; but 2 rows
21.5 / 37.7 and 28.5 / 47.0 (hence `MIN_ROWS` = 3), and 4096 x 4096 at 8 rows 33.0 / 54.3 (hence
the byte cap). In whole tinycoder-16m steps a plain decode step of 4 rows went from 3.20 to
1.78 ms. `install(model)` swaps the class of every plain `nn.Linear` / `nn.Embedding` (exact
types only: quantized and trellis layers are untouched); engine/loader.py calls it for target
and draft models. It does nothing unless the backend is CUDA (or `force`).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from kernels.common import gpu_backend, swap_classes

MIN_ROWS = 3  # 2 rows measured slower gathered than through cuBLASLt (module doc)
MAX_ROWS = 16  # more rows (a prefill chunk) go to cuBLASLt
MAX_BYTES = 8 << 20  # rows x weight bytes: above it the gathered rows are memory-bound
_FLOATS = (mx.float16, mx.bfloat16, mx.float32)

ANY_DEVICE = False  # tests: take the gathered path on the CPU too
# rows -> (lhs indices arange(rows), rhs indices zeros(rows)), uint32, built once per row count
_INDICES: dict[int, tuple[mx.array, mx.array]] = {}


def enabled() -> bool:
    """On a CUDA GPU only (elsewhere matmuls have no one-row cliff)."""
    return gpu_backend() == "cuda"


def _indices(m: int) -> tuple[mx.array, mx.array]:
    hit = _INDICES.get(m)
    if hit is None:
        hit = (mx.arange(m, dtype=mx.uint32), mx.zeros((m,), dtype=mx.uint32))
        mx.eval(*hit)
        _INDICES[m] = hit
    return hit


def takes(x: mx.array, w: mx.array) -> bool:
    """Whether x @ w.T goes through `gather_matmul` (see the module doc)."""
    if x.ndim == 0 or x.shape[-1] != w.shape[-1] or x.shape[-1] % 32:
        return False
    m = x.size // x.shape[-1]
    return (
        MIN_ROWS <= m <= MAX_ROWS
        and m * w.nbytes <= MAX_BYTES
        and x.dtype == w.dtype
        and x.dtype in _FLOATS
        and w.ndim == 2
        and (ANY_DEVICE or mx.default_device() == mx.gpu)
    )


def gather_matmul(x: mx.array, w: mx.array) -> mx.array:
    """x @ w.T for x `[..., K]` and w `[N, K]` as one gathered gemv (`mx.gather_mm`)."""
    K = x.shape[-1]
    m = x.size // K
    lhs, rhs = _indices(m)
    y = mx.gather_mm(x.reshape(m, 1, K), w.T[None], lhs, rhs)  # [m, 1, N]
    return y.reshape(*x.shape[:-1], w.shape[0])


class FewRowLinear(nn.Linear):
    def __call__(self, x: mx.array) -> mx.array:
        w = self["weight"]
        if not takes(x, w):
            return super().__call__(x)
        y = gather_matmul(x, w)
        return y + self["bias"] if "bias" in self else y


class FewRowEmbedding(nn.Embedding):
    def as_linear(self, x: mx.array) -> mx.array:
        w = self["weight"]
        return gather_matmul(x, w) if takes(x, w) else super().as_linear(x)


def install(model: Any, force: bool = False) -> int:
    """Swap the plain Linear / Embedding modules of `model` to the few-row dispatch; returns
    how many (0 unless `enabled()` or `force`)."""
    if not (force or enabled()):
        return 0
    return swap_classes(model, {nn.Linear: FewRowLinear, nn.Embedding: FewRowEmbedding})


def uninstall(model: Any) -> int:
    """Back to the plain classes (for A/B measurements); returns how many."""
    return swap_classes(model, {FewRowLinear: nn.Linear, FewRowEmbedding: nn.Embedding})
