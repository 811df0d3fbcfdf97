"""MLX's CPU backend with its exponentials on NumPy: attention and SwiGLU.

MLX's CPU backend computes `exp` (and with it softmax, sigmoid, SiLU) in scalar code: on the
x86 CI machine (mlx 0.32.4, mlx[cpu]) `mx.exp` over 8.9 M float32 values takes 120 ms (13 ns an
element) against 7.7 ms for NumPy's (AVX2/AVX-512 loops). A float32 forward of a small model
spends much of its time there: for tinycoder-16m, a 192-token prefill chunk's SwiGLU costs
3.2 ms a layer against 4.7 ms for all of the layer's matmuls (OpenBLAS), and attention over a
long context most of a step. Both are computed here with the exponentials on NumPy, on a
zero-copy view of an evaluated MLX array.

Attention. MLX's CPU backend has no fused attention: `mx.fast.scaled_dot_product_attention`
falls back to a matmul, a masked softmax and a second matmul, and the softmax is four fifths of
it (a 431-token chunk over 3,431 keys, 6 query and 2 KV heads: 148 ms, 30 of them matmuls).

`attention(q, k, v, scale, mask)` computes the same function with the scores in MLX (one
matmul per KV head, its query heads stacked: grouped-query attention without repeating k),
evaluated, then masked and soft-maxed in place through a zero-copy NumPy view of the scores'
buffer (NumPy 2's `copy=False` raises rather than copy, so a write can never land in a copy),
and multiplied by v in MLX. The same shapes take about a third of the time (148 → 54 ms above;
16 decode rows over 3,400 keys 14.8 → 4.8 ms). The price is a synchronisation per call: the
graph up to the scores is evaluated there, so it is taken only where the scores are big enough
(`MIN_SCORES`) and only for float32 (NumPy has no bfloat16; mlxd runs float32 on a CPU, where
bfloat16 skips BLAS).

Differences from the fallback: a query that sees no key gets zeros instead of NaN; otherwise
the results agree to float32 rounding. Inside `mx.compile` or `mx.vmap` nothing can be evaluated:
both kernels raise `InTransform` there and the engine's route calls MLX's op instead.

SwiGLU. `swiglu(gate, x)` = silu(gate) * x (mlx-lm's `activations.swiglu`, which 77 of its
model files use) as `x * gate / (1 + exp(-gate))` in NumPy, for float32 inputs of at least
`MIN_SWIGLU` elements: 3.2 → 0.19 ms for the 192 x 1,024 chunk above.

The engine routes a model's calls here on a CPU (engine/cuda_guard.py, `install_attention`).
Tests: tests/test_cpu_kernels.py, against MLX's own ops.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from kernels.common import mask_5d

MIN_SCORES = 1 << 13  # below this many scores (B x H x L x K) MLX's fallback is as fast
MIN_SWIGLU = 1 << 12  # below this many elements MLX's SwiGLU is as fast


class InTransform(Exception):
    """MLX refused to evaluate: the call is being traced (inside `mx.compile` or `mx.vmap`),
    where these kernels cannot run; the caller takes MLX's own op instead."""


def evaluate(*arrays: mx.array) -> None:
    """mx.eval, raising InTransform where a transformation is tracing the call."""
    try:
        mx.eval(*arrays)
    except ValueError as e:
        if "transformations" in str(e):
            raise InTransform(str(e)) from None
        raise


def takes(q: mx.array, k: Any, v: Any, mask: Any, sinks: Any = None) -> bool:
    """Whether `attention` computes this call: float32 arrays (no quantized KV tuples, no
    attention sinks), grouped heads, a mask it understands, scores of at least `MIN_SCORES`."""
    if sinks is not None or not isinstance(k, mx.array) or not isinstance(v, mx.array):
        return False
    if not (q.dtype == k.dtype == v.dtype == mx.float32) or q.ndim != 4 or k.ndim != 4:
        return False
    B, H, L, _ = q.shape
    known = mask is None or isinstance(mask, mx.array) or (isinstance(mask, str) and mask == "causal")
    if H % k.shape[1] or not known:
        return False
    return B * H * L * k.shape[2] >= MIN_SCORES


def attention(q: mx.array, k: mx.array, v: mx.array, scale: float,
              mask: mx.array | str | None) -> mx.array:
    """softmax(q k^T * scale + mask) v: `q` `[B, H, L, D]`, `k`/`v` `[B, Hkv, K, D]` (H a
    multiple of Hkv; query head h reads KV head h // (H / Hkv)); `mask` None, "causal" (the last
    L of K positions) or an array, boolean (True = attend) or additive, broadcastable to
    `[B, H, L, K]`. float32; see `takes`."""
    B, H, L, D = q.shape
    Hkv, K = k.shape[1], k.shape[2]
    rep = H // Hkv
    scores = (q * scale).reshape(B, Hkv, rep * L, D) @ k.swapaxes(-1, -2)
    if isinstance(mask, mx.array):
        if mask.dtype != mx.bool_:
            mask = mask.astype(mx.float32)
        evaluate(scores, mask)
    else:
        evaluate(scores)
    s = np.array(scores, copy=False).reshape(B, Hkv, rep, L, K)  # a view: written in place
    if mask is not None:
        if isinstance(mask, str):  # "causal": the queries are the last L of K positions
            pos = np.arange(K)
            m = pos[None, :] <= pos[K - L:, None]
        else:
            m = np.asarray(mask)
        m = mask_5d(m, H, Hkv)
        if m.dtype == np.bool_:
            np.copyto(s, np.float32(-np.inf), where=~m)
        else:
            s += m
    top = s.max(axis=-1, keepdims=True)
    top[~np.isfinite(top)] = 0.0  # a query that sees nothing: exp(-inf) = 0 below
    s -= top
    np.exp(s, out=s)
    total = s.sum(axis=-1, keepdims=True)
    total[total == 0.0] = 1.0
    s *= np.float32(1.0) / total
    out = scores @ v  # the scores' buffer now holds the probabilities
    return out.reshape(B, H, L, v.shape[-1])


def swiglu_takes(gate: mx.array, x: mx.array) -> bool:
    """Whether `swiglu` computes this call: float32, one shape, at least `MIN_SWIGLU`."""
    return (gate.dtype == x.dtype == mx.float32 and gate.shape == x.shape
            and gate.size >= MIN_SWIGLU)


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """silu(gate) * x = x * gate / (1 + exp(-gate)), float32 (see `swiglu_takes`)."""
    evaluate(gate, x)
    g = np.array(gate, copy=False)
    out = np.negative(g)
    np.exp(out, out=out)
    out += np.float32(1.0)
    np.divide(g, out, out=out)
    out *= np.array(x, copy=False)
    return mx.array(out)
