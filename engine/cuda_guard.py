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

**Attention over a few queries.** MLX-CUDA runs `mx.fast.scaled_dot_product_attention` with one
query per row in its vector kernel and with more than one through cuDNN (a cuDNN graph per
shape, executed through cuDNN's CUDA-graph API inside MLX's stream capture). For a verify
forward (2-9 queries a row) that costs far more than the arithmetic: on the H200 a 1x2 step of
tinycoder-16m took 2.48 ms against 1.11 ms for 1x1, and 1x9 2.57 ms (session 5,
docs/speculative.md), the width cliff that keeps speculation from paying there. The two MLX
aborts seen (`cudaStreamEndCapture ... previous error during capture`) also came in runs of
forced wide steps. `sdpa` can send calls with 2..`PLAIN_MAX` queries per row and no attention
sinks through `sdpa_reference`: the same attention in plain MLX ops (scale, one batched matmul per
GQA group, the mask, a float32 softmax, a second matmul: what MLX's own fallback computes), no
per-shape setup, no capture. Prefill chunks (more queries) keep cuDNN's flash attention, and one
query per row keeps the vector kernel.

**Off by default: it did not pay.** Measured on the H200 (session 6, `bench.step_costs --guard
ab`: the same process, guard off and on alternating), tinycoder-16m bf16 steps cost 0.85-1.11x
with the plain attention (median about 1.04x; 1x2 2.87 vs 2.77 ms, 1x9 2.77 vs 2.53 ms, 4x9 2.87
vs 2.59 ms). The width cliff is not attention: a plain batch of 4 rows at one query each costs
what a 1x9 verify does (2.71 ms against 1.13 ms for 1x1), so it comes with more than one row
in the matmuls (cuBLASLt instead of the gemv kernel, docs/kernels.md). `MLXD_SDPA_PLAIN_MAX=16`
turns it on; 0 (the default) or 1 leaves every call to MLX's kernel. Since mlxd turns cuDNN's
attention off altogether by default (`MLX_CUDA_USE_CUDNN_SDPA=0`, engine/__init__.py: the capture
abort came with it), MLX's own plain-op attention already serves these calls; this path matters
only with `MLX_CUDA_USE_CUDNN_SDPA=1`, to keep verify forwards off cuDNN while prefill uses it.
"""

from __future__ import annotations

import math
import os
from typing import Any

import mlx.core as mx

ROWS = int(os.environ.get("MLXD_ROPE_ROWS", "256"))
SMALL_HEAD = 64  # head dims below this are affected (16 failed, 64 never did)
PLAIN_MAX = int(os.environ.get("MLXD_SDPA_PLAIN_MAX", "0"))  # 2..this queries a row: plain attention

_ORIGINAL: dict[str, Any] = {}  # mx.fast functions before install()


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
    return _ORIGINAL["rope"](
        a, dims, traditional=traditional, base=base, scale=scale, offset=offset, freqs=freqs, **kw
    )


def sdpa_reference(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float,
    mask: None | str | mx.array = None,
) -> mx.array:
    """`mx.fast.scaled_dot_product_attention` in plain MLX ops: q `[B, Hq, N, D]`, k and v
    `[B, Hk, K, D]` with Hq a multiple of Hk (GQA: k and v are not tiled), mask None,
    `"causal"` (lower-right aligned: the last query sees the last key), a boolean array (True =
    attend) or an additive one, broadcastable to `[B, Hq, N, K]`. Scores in the inputs' dtype,
    softmax in float32, as MLX computes them."""
    B, Hq, N, D = q.shape
    Hk, K = k.shape[1], k.shape[2]
    rep = Hq // Hk
    # one batched matmul per KV head: the rep query heads of a group become rows
    qg = (q * mx.array(scale, dtype=q.dtype)).reshape(B, Hk, rep * N, D)
    scores = (qg @ mx.swapaxes(k, -1, -2)).reshape(B, Hk, rep, N, K)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unsupported mask {mask!r}")
        qi = mx.arange(N)[:, None] + (K - N)
        mask = mx.arange(K)[None, :] <= qi  # [N, K]
    if mask is not None:
        m = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape)) if mask.ndim < 4 else mask
        if m.shape[1] == 1:
            m = m[:, :, None]  # [B', 1, 1, N', K']
        else:
            m = m.reshape(m.shape[0], Hk, rep, m.shape[2], m.shape[3])
        if m.dtype == mx.bool_:
            scores = mx.where(m, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
        else:
            scores = scores + m.astype(scores.dtype)
    probs = mx.softmax(scores, axis=-1, precise=True)
    out = probs.reshape(B, Hk, rep * N, K) @ v
    return out.reshape(B, Hq, N, v.shape[-1])


def sdpa(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float,
    mask: None | str | mx.array = None,
    sinks: mx.array | None = None,
    **kw: Any,
) -> mx.array:
    """`mx.fast.scaled_dot_product_attention`, through `sdpa_reference` for 2..`PLAIN_MAX`
    queries per row without sinks (MLX-CUDA would run those through cuDNN: see the module
    doc; `PLAIN_MAX` is 0 by default, so none); every other call unchanged."""
    if (
        sinks is None
        and not kw.get("force_fused")
        and q.ndim == 4
        and 1 < q.shape[2] <= PLAIN_MAX
        and q.shape[1] % k.shape[1] == 0
        and (mask is None or isinstance(mask, (str, mx.array)))
    ):
        return sdpa_reference(q, k, v, scale=scale, mask=mask)
    return _ORIGINAL["sdpa"](q, k, v, scale=scale, mask=mask, sinks=sinks, **kw)


def install(force: bool = False) -> bool:
    """Put `rope` in place of `mx.fast.rope` and `sdpa` in place of
    `mx.fast.scaled_dot_product_attention` on MLX-CUDA (`force`: anywhere, for tests).
    Idempotent; returns whether the guard is in place."""
    if not _ORIGINAL:
        from kernels.common import gpu_backend

        if not force and gpu_backend() != "cuda":
            return False
        _ORIGINAL["rope"] = mx.fast.rope
        mx.fast.rope = rope
        _ORIGINAL["sdpa"] = mx.fast.scaled_dot_product_attention
        mx.fast.scaled_dot_product_attention = sdpa
    return True


def uninstall() -> None:
    if _ORIGINAL:
        mx.fast.rope = _ORIGINAL.pop("rope")
        mx.fast.scaled_dot_product_attention = _ORIGINAL.pop("sdpa")
