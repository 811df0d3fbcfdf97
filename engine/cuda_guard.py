"""A guard against a launch failure of MLX-CUDA (0.32.4) that a serving batch can reach.

**The failure.** On the H200, `mx.fast.rope` on a `[256, 4, 1, 16]` float32 input with per-row
offsets (a `[256]` int32 array, what the engine's KV layouts pass) fails at launch with
`cudaGraphAddKernelNode ... invalid argument` (`cudaLaunchKernelExC` with
`MLX_USE_CUDA_GRAPHS=0`), and with it the whole step: every request of the batch ends in an
error. MLX has closed bugs with the same message for other launch grids (ml-explore/mlx#3659,
RoPE over very large inputs; #3666, non-contiguous copies); this one, at a small size, still
fails in the 0.32.4 wheel. Measured boundary (one child process per shape, per-row offsets):
one query per row (MLX's "single" kernel) with head dim 16 fails from 512 rows (batch x heads)
on, in float32 and bfloat16, with array or int offsets; 256 rows launch. Head dim 64 launched at
every size tried (up to 3,072 rows), and so did 9 queries per row (up to 27,648 rows) and a
512-token prefill.

**The guard.** `install(model)` (CUDA only; engine/loader.py calls it for every model it loads)
gives the model's RoPE modules a guarded subclass, the way engine/fewrow.py swaps `nn.Linear`:
`mx.fast.rope` itself is never replaced, so code outside mlxd's models is not affected. A RoPE
module is one whose `__call__(x, offset, ...)` calls `mx.fast.rope` itself: `mlx.nn.RoPE`, the
variants of `mlx_lm.models.rope_utils` (Llama 3, YaRN, SuScaled, ...) and the model files' own
(DeepSeek-V2, Hunyuan, InternLM3). A model that calls `mx.fast.rope` inside its attention
(no RoPE module) is not covered.

A guarded module sends a one-query input with a head dim under `SMALL_HEAD` (64) and more than
`ROWS` (256) rows through the module's own call in slices of whole batch rows, at most `ROWS`
rows each (shapes that launch), and concatenates the results. RoPE is applied row by row, so
the result equals the unsliced call bit for bit. Every other call (most real models' head dims
are 64-256, and prefill chunks carry many queries a row) goes straight to the module's call.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine.modswap import swap_classes
from kernels.common import gpu_backend

ROWS = 256  # most rows (batch x heads) of one-query RoPE that launched (512 failed)
SMALL_HEAD = 64  # head dims below this are affected (16 failed, 64 never did)

_GUARDED: dict[type, type] = {}  # RoPE module class -> its guarded subclass


def applies() -> bool:
    """Whether the guard is needed here: on an MLX-CUDA GPU."""
    return gpu_backend() == "cuda"


def batch_rows(x: mx.array, offset: Any) -> int:
    """How many leading (batch) rows of x one slice may hold, or 0 when x goes through whole:
    x is one query per row with a small head and more than `ROWS` rows, and a per-row offset
    (if any) has one entry per batch row."""
    if x.ndim < 3 or x.shape[-2] != 1 or x.shape[-1] >= SMALL_HEAD:
        return 0
    rows = x.size // x.shape[-1]
    if rows <= ROWS:
        return 0
    if isinstance(offset, mx.array) and offset.size > 1 and offset.shape != (x.shape[0],):
        return 0
    per_row = rows // x.shape[0]
    return max(1, ROWS // per_row) if per_row <= ROWS else 0


def sliced_call(call: Callable[..., mx.array], x: mx.array, offset: Any, step: int, *args: Any,
                **kwargs: Any) -> mx.array:
    """call(x, offset, ...) over slices of `step` batch rows, concatenated."""
    per_row = isinstance(offset, mx.array) and offset.size > 1
    outs = [
        call(x[i : i + step], offset[i : i + step] if per_row else offset, *args, **kwargs)
        for i in range(0, x.shape[0], step)
    ]
    return mx.concatenate(outs, axis=0)


def is_rope_module(cls: type) -> bool:
    """Whether modules of `cls` are RoPE modules the guard can take (see the module doc)."""
    code = getattr(inspect.getattr_static(cls, "__call__", None), "__code__", None)
    if code is None or cls in _GUARDED.values():
        return False
    names = code.co_varnames[: code.co_argcount]
    return "fast" in code.co_names and "rope" in code.co_names and names[1:3] == ("x", "offset")


def guarded_class(cls: type) -> type:
    """The subclass of RoPE module class `cls` whose call slices inputs that would not launch."""
    hit = _GUARDED.get(cls)
    if hit is None:
        base = cls.__call__

        def __call__(self: Any, x: mx.array, offset: Any = 0, *args: Any, **kwargs: Any) -> mx.array:
            step = batch_rows(x, offset)
            if step:
                return sliced_call(partial(base, self), x, offset, step, *args, **kwargs)
            return base(self, x, offset, *args, **kwargs)

        hit = type(f"Guarded{cls.__name__}", (cls,), {"__call__": __call__, "__module__": __name__})
        _GUARDED[cls] = hit
    return hit


def install(model: nn.Module | None = None, force: bool = False) -> int:
    """Give the RoPE modules of `model` their guarded subclass on MLX-CUDA (`force`: anywhere,
    for tests); returns how many were swapped. Idempotent; `model` None swaps nothing."""
    if model is None or not (force or applies()):
        return 0
    classes = {type(m) for _, m in model.named_modules()}
    return swap_classes(model, {cls: guarded_class(cls) for cls in classes if is_rope_module(cls)})
