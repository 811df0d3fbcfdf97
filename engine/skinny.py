"""Skinny matmuls on CUDA: a few rows of x times a weight through our fused kernel.

MLX-CUDA multiplies by its own gemv kernel only when x has one row; from two rows on it calls
cuBLASLt, which costs 2-3x the gemv per call at decode sizes (bench/small_m.py on the H200:
22 µs against 8 µs at 384x384, 30-35 µs against 15 µs at 4096x4096). A small model's forward
has ~60 matmuls, so a decode step of 2+ rows or a speculative verify of 2-9 columns cost ~1.7x
a one-row step (bench/step_costs.py), although the arithmetic barely grows.

`kernels.skinny.skinny_matmul` reads the weight once for all rows of x (docs/kernels.md).
`SkinnyLinear` / `SkinnyEmbedding.as_linear` (a tied lm_head) route x with 2..`MAX_ROWS` rows
in all (leading dims flattened) to it when it takes the call (same dtype for x and the weight,
float32/float16/bfloat16, K % 8 == 0) and the default device is the GPU; everything else goes
to the plain matmul. One row stays on MLX's gemv.

`install(model)` swaps the class of every plain `nn.Linear` and `nn.Embedding` (exact types:
nn.QuantizedLinear, TrellisLinear and other subclasses are untouched) for these subclasses;
parameters, names and saving are unchanged. engine/loader.py calls it at model load (target and
draft models); it is a no-op unless MLXD_SKINNY=1 and the default device is a CUDA GPU (or
`force`).

**Off by default.** Measured on the H200 (session 3, bench/results/h200-session3/skinny/): the
kernel is correct (62 of 63 CUDA cases; the one failure was cuBLASLt's own TF32 float32 matmul
used as the twin), but inside a graph an `mx.fast.cuda_kernel` call costs 27-57 µs against
15-35 µs for cuBLASLt, so the fused read of W never pays: MLX's per-call cost of a custom
kernel, not the arithmetic, decides. Decode steps of tinycoder-16m were no faster with it on.
It stays for the day MLX's custom-kernel dispatch gets cheaper (precompiled kernels did not
make it cheaper, session 4: docs/kernels.md), and as the measured answer to "why not a skinny
kernel".

Environment: MLXD_SKINNY=1 turns it on; MLXD_SKINNY_ROWS (default 8, at most 16) is the most
rows of x that take the kernel; MLXD_SKINNY_WARMUP=0 skips compiling every variant at install.
"""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine.modswap import swap_classes
from kernels.common import gpu_backend
from kernels.skinny import kernel as _sk

MAX_ROWS = max(1, min(_sk.MAX_ROWS, int(os.environ.get("MLXD_SKINNY_ROWS", "8"))))


def enabled() -> bool:
    """Opt-in (MLXD_SKINNY=1) and on a CUDA GPU: measured slower than cuBLASLt (docstring)."""
    return os.environ.get("MLXD_SKINNY", "") == "1" and gpu_backend() == "cuda"


# (x shape, x dtype, w shape, w dtype) -> the kernel's prepared launch, or None (plain matmul):
# one dict lookup a call once a shape has been seen
_PLAN: dict[tuple, tuple | None] = {}


def plan(x: mx.array, w: mx.array) -> tuple | None:
    """The kernel's prepared launch when it takes x @ w.T, else None."""
    key = (x.shape, x.dtype, w.shape, w.dtype)
    try:
        hit = _PLAN[key]
    except KeyError:
        m = x.size // x.shape[-1] if x.ndim and x.shape[-1] else 0
        hit = _sk.prepare(x, w) if 2 <= m <= MAX_ROWS and _sk.supported(x, w) else None
        if len(_PLAN) < 4096:
            _PLAN[key] = hit
    # the kernel is a GPU kernel: a forward placed on the CPU (mx.stream(mx.cpu)) takes the matmul
    return hit if hit is not None and _on_gpu() else None


def _on_gpu() -> bool:
    return mx.default_device() == mx.gpu


def matmul(x: mx.array, w: mx.array) -> mx.array:
    """x @ w.T, through the skinny kernel when it takes the call."""
    p = plan(x, w)
    return x @ w.T if p is None else _sk.launch(x, w, p)


class SkinnyLinear(nn.Linear):
    def __call__(self, x: mx.array) -> mx.array:
        w = self["weight"]
        p = plan(x, w)
        if p is None:
            return super().__call__(x)
        y = _sk.launch(x, w, p)
        return y + self["bias"] if "bias" in self else y


class SkinnyEmbedding(nn.Embedding):
    def as_linear(self, x: mx.array) -> mx.array:
        w = self["weight"]
        p = plan(x, w)
        return super().as_linear(x) if p is None else _sk.launch(x, w, p)


def install(model: Any, force: bool = False, warm: bool | None = None) -> int:
    """Swap plain Linear / Embedding modules of `model` to the skinny dispatch; returns how many.

    On a CUDA GPU it then compiles the kernel for every row count and weight layout the model
    will use (`warm_up`, unless MLXD_SKINNY_WARMUP=0), so no request pays the compiles later;
    if that fails, the model is put back to the plain classes (with a warning) and 0 returned."""
    if not (force or enabled()):
        return 0
    count = swap_classes(model, {nn.Linear: SkinnyLinear, nn.Embedding: SkinnyEmbedding})
    if warm is None:
        warm = enabled() and os.environ.get("MLXD_SKINNY_WARMUP", "1") != "0"
    if warm and count:
        try:
            warm_up(model)
        except Exception as exc:  # a kernel that does not build here must not stop the server
            import warnings

            warnings.warn(f"engine.skinny: kernel warm-up failed, using plain matmuls: {exc}", stacklevel=2)
            uninstall(model)
            return 0
    return count


def warm_up(model: Any, rows: range | None = None) -> int:
    """Run the kernel once for every (rows, layout, dtype) the model's skinny modules can take,
    so MLX compiles (or loads from its disk cache) each variant now; returns how many."""
    rows = rows or range(2, MAX_ROWS + 1)
    seen: set[tuple] = set()
    outs = []
    for _, module in model.named_modules():
        if type(module) not in (SkinnyLinear, SkinnyEmbedding):
            continue
        w = module["weight"]
        for m in rows:
            x = mx.zeros((m, w.shape[-1]), dtype=w.dtype)
            if not _sk.supported(x, w):
                continue
            lay = _sk.layout(m, w.shape[0], w.shape[1], w.dtype.size)
            key = (lay, w.dtype)
            if key not in seen:
                seen.add(key)
                outs.append(_sk.skinny_matmul(x, w))
    mx.eval(outs)
    return len(seen)


def uninstall(model: Any) -> int:
    """Back to the plain classes (for A/B measurements); returns how many."""
    return swap_classes(model, {SkinnyLinear: nn.Linear, SkinnyEmbedding: nn.Embedding})
