"""Work-arounds for launch failures of MLX-CUDA (0.32.4) that a serving batch can reach.

**RoPE over many rows.** On the H200, `mx.fast.rope` on a `[256, 4, 1, 16]` float32 input with
per-row offsets (a `[256]` int32 array, what our layouts pass) fails at launch with
`cudaGraphAddKernelNode ... invalid argument` (`cudaLaunchKernelExC` with
`MLX_USE_CUDA_GRAPHS=0`), and with it the whole step: every request of the engine ended in an
error (bench/results/h200-session5/: `probe_ops.py` evaluated every op as it was made and named
`fast.rope` as the first failing one). MLX has closed bugs with the same message for other
launch grids (ml-explore/mlx#3659, RoPE over very large inputs; #3666, non-contiguous copies);
this one, at a small size, still fails in the wheel here. Attention, copies and masks of the
same batch launch fine (`probe_grid.py`).

The H200 boundary (`probe_rope.py`, per-row offsets, one child process per shape): one query
per row (MLX's "single" kernel) with head dim 16 fails from 512 rows (batch x heads) on, in
float32 and bfloat16, with array or int offsets; 256 rows launch. Head dim 64 launched at every
size tried (up to 3,072 rows), and so did 9 queries per row at every size (up to 27,648 rows)
and a 512-token prefill.

`install()` (CUDA only; called by the `Runner`, so every engine is covered, models built in
tests too) replaces `mx.fast.rope` with `rope`, which sends one-query inputs with a
head dim under 64 and more than `ROWS` rows through `rope_reference` — the same rotation in plain
MLX ops (a few element-wise kernels), equal up to float rounding — and every other call to MLX's
kernel unchanged (most real models' head dims are 64-256: their decode steps never take the detour).
`MLXD_ROPE_ROWS` sets `ROWS` (default 256; 0: every one-query small-head call through the
reference).
"""

from __future__ import annotations

import math
import os
from typing import Any

import mlx.core as mx

ROWS = int(os.environ.get("MLXD_ROPE_ROWS", "256"))
SMALL_HEAD = 64  # head dims below this are affected (16 failed, 64 never did)

_ORIGINAL: list[Any] = []  # mx.fast.rope before install()


def rope_reference(
    x: mx.array,
    dims: int,
    *,
    traditional: bool,
    base: float | None,
    scale: float,
    offset: int | mx.array,
    freqs: mx.array | None = None,
) -> mx.array:
    """`mx.fast.rope` in plain MLX ops: x `[..., N, D]`; offset an int, a scalar array or one
    offset per leading row (`[x.shape[0]]`); the first `dims` features rotate, the rest pass.

    Angles as MLX's kernels compute them: position (offset + n) * scale times the inverse
    frequency base^(-2i/dims) (or 1 / freqs[i]), in float32."""
    N = x.shape[-2]
    half = dims // 2
    if freqs is not None:
        inv = 1.0 / freqs.astype(mx.float32)
    else:
        inv = mx.power(mx.array(2.0), -(mx.arange(half, dtype=mx.float32) / half) * math.log2(base))
    pos = mx.arange(N, dtype=mx.float32)
    if isinstance(offset, mx.array) and offset.size > 1:
        lead = (x.shape[0],) + (1,) * (x.ndim - 3)  # one offset per leading row
        pos = offset.astype(mx.float32).reshape(*lead, 1) + pos  # [B, 1.., N]
    else:
        pos = pos + (offset.astype(mx.float32) if isinstance(offset, mx.array) else float(offset))
    theta = (pos * scale)[..., None] * inv  # [..., N, half]
    cos, sin = mx.cos(theta), mx.sin(theta)
    xf = x.astype(mx.float32)
    if traditional:
        x1, x2 = xf[..., 0:dims:2], xf[..., 1:dims:2]
    else:
        x1, x2 = xf[..., :half], xf[..., half:dims]
    r1 = x1 * cos - x2 * sin
    r2 = x1 * sin + x2 * cos
    if traditional:
        rot = mx.stack([r1, r2], axis=-1).reshape(*r1.shape[:-1], dims)
    else:
        rot = mx.concatenate([r1, r2], axis=-1)
    if dims < x.shape[-1]:
        rot = mx.concatenate([rot, xf[..., dims:]], axis=-1)
    return rot.astype(x.dtype)


def _rows(x: mx.array) -> int:
    return x.size // max(x.shape[-1], 1)


def rope(
    a: mx.array,
    dims: int,
    *,
    traditional: bool,
    base: float | None,
    scale: float,
    offset: int | mx.array,
    freqs: mx.array | None = None,
    stream: Any = None,
) -> mx.array:
    """`mx.fast.rope`, through `rope_reference` where MLX-CUDA's kernel fails to launch
    (one query per row, a head dim under 64, more than `ROWS` rows: see the module doc)."""
    batched = isinstance(offset, mx.array) and offset.size > 1
    if (
        a.ndim >= 3
        and a.shape[-2] == 1
        and a.shape[-1] < SMALL_HEAD
        and _rows(a) > ROWS
        and (not batched or offset.shape == (a.shape[0],))
    ):
        return rope_reference(
            a, dims, traditional=traditional, base=base, scale=scale, offset=offset, freqs=freqs
        )
    kw = {} if stream is None else {"stream": stream}
    return _ORIGINAL[0](
        a, dims, traditional=traditional, base=base, scale=scale, offset=offset, freqs=freqs, **kw
    )


def install(force: bool = False) -> bool:
    """Put `rope` in place of `mx.fast.rope` on MLX-CUDA (`force`: anywhere, for tests).
    Idempotent; returns whether the guard is in place."""
    if not _ORIGINAL:
        from kernels.common import gpu_backend

        if not force and gpu_backend() != "cuda":
            return False
        _ORIGINAL.append(mx.fast.rope)
        mx.fast.rope = rope
    return True


def uninstall() -> None:
    if _ORIGINAL:
        mx.fast.rope = _ORIGINAL.pop()
