"""Quantize a dense weight matrix to trellis codes, and the plain-MLX reference decode.

Format of one quantized (n_out, n_in) matrix W, with block length T (see ``bitshift.py``):

- ``signs``  (n_in,) int8, +-1: random signs of the incoherence transform.
- ``packed`` (n_out, n_in*K/32) uint32: each row is n_in/T tail-biting blocks of T*K bits.
- ``scales`` (n_out,) float16: per-row scale; the raw code value of a state times it is the weight.

Incoherence (QuIP#/QTIP's random Hadamard transform, applied on the input side only here): with
h(v) = hadamard_transform(v, 1/sqrt(n)) an orthogonal map, W x = (W S h^T)(h(S x)), so we quantize
W~ whose rows are h(s * w_r) and at run time feed the kernel x~ = h(s * x). The rotated rows are
close to Gaussian, which is what the trellis codes are built for; the per-row scales take out the
differing row norms, so the output side needs no transform.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from .bitshift import (
    block_size_for,
    check_params,
    pack_symbols,
    states_from_packed,
    states_from_windows,
    symbols_from_states,
)
from .codes import CODE_RMS, check_code, codebook, decode_states
from .viterbi import encode_tail_biting

# Code scale (in units of the code RMS) per bit width for a unit-variance source: a slightly wider
# code lowers MSE at 3-4 bits (measured on N(0,1) at L = 12, see docs/trellis.md).
CODE_GAIN = {2: 1.0, 3: 1.05, 4: 1.1}
_HADAMARD_BASES = (1, 12, 20, 28)


@dataclass(frozen=True, slots=True)
class TrellisSpec:
    """How to quantize: K bits per weight, L-bit states, the code, the largest block length."""

    bits: int = 4
    L: int = 16
    code: str = "1mad"
    max_block: int = 256
    wrap_window: int | None = 64

    def block_for(self, n_in: int) -> int | None:
        return block_size_for(n_in, self.max_block)


@dataclass(slots=True)
class TrellisWeight:
    packed: mx.array
    scales: mx.array
    signs: mx.array
    bits: int
    L: int
    block: int
    code: str

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.packed.shape[0]), int(self.signs.shape[0])


def hadamard_ok(n: int) -> bool:
    """mx.hadamard_transform handles n = m * 2^k with m in {1, 12, 20, 28}."""
    for m in _HADAMARD_BASES:
        if n % m == 0:
            q = n // m
            if q & (q - 1) == 0:
                return True
    return False


def can_quantize(n_in: int, spec: TrellisSpec) -> bool:
    return hadamard_ok(n_in) and spec.block_for(n_in) is not None


def random_signs(n: int, key: mx.array) -> mx.array:
    return (2 * mx.random.bernoulli(0.5, (n,), key=key).astype(mx.int8) - 1).astype(mx.int8)


def rotate(x: mx.array, signs: mx.array) -> mx.array:
    """x~ = h(s * x) along the last axis, in float32."""
    n = x.shape[-1]
    return mx.hadamard_transform(x.astype(mx.float32) * signs.astype(mx.float32), 1.0 / math.sqrt(n))


def quantize_weight(
    weight: mx.array,
    spec: TrellisSpec,
    key: mx.array | None = None,
    progress: Callable[[int], None] | None = None,
    rows_per_step: int | None = None,
) -> TrellisWeight:
    """Quantize W (n_out, n_in). ``progress(n)`` is called with the number of weights done."""
    check_code(spec.code)
    n_out, n_in = weight.shape
    block = spec.block_for(n_in)
    if block is None or not hadamard_ok(n_in):
        raise ValueError(f"cannot trellis-quantize a row of {n_in} weights")
    check_params(spec.bits, spec.L, block)
    key = mx.random.key(0) if key is None else key
    signs = random_signs(n_in, key)
    cb = codebook(spec.L, spec.code) * (CODE_GAIN.get(spec.bits, 1.0) / CODE_RMS[spec.code])
    rows_per_step = rows_per_step or max(1, (1 << 17) // n_in)
    packed_parts, scale_parts = [], []
    for lo in range(0, n_out, rows_per_step):
        rows = rotate(weight[lo : lo + rows_per_step], signs)
        rms = mx.sqrt(mx.mean(mx.square(rows), axis=1, keepdims=True))
        rms = mx.where(rms > 0, rms, 1.0)
        seqs = (rows / rms).reshape(-1, block)
        states = encode_tail_biting(seqs, cb, spec.L, spec.bits, spec.wrap_window)
        r = rows.shape[0]
        packed_parts.append(pack_symbols(symbols_from_states(states, spec.L, spec.bits), spec.bits).reshape(r, -1))
        # Least-squares row scale for the chosen codes (never worse than rms * code scale).
        values = decode_states(states, spec.code).reshape(r, n_in)
        num = mx.sum(values * rows, axis=1)
        den = mx.sum(values * values, axis=1)
        scale_parts.append(mx.where(den > 0, num / mx.maximum(den, 1e-30), 0.0))
        mx.eval(packed_parts[-1], scale_parts[-1])
        if progress is not None:
            progress(r * n_in)
    return TrellisWeight(
        packed=mx.concatenate(packed_parts, axis=0),
        scales=mx.concatenate(scale_parts, axis=0).astype(mx.float16),
        signs=signs,
        bits=spec.bits,
        L=spec.L,
        block=block,
        code=spec.code,
    )


def dequantize_rotated_ref(w: TrellisWeight) -> mx.array:
    """W~ (n_out, n_in) float32 by unpacking every symbol: the reference definition."""
    n_out, n_in = w.shape
    states = states_from_packed(w.packed, n_in, w.bits, w.L, w.block)
    return decode_states(states, w.code) * w.scales.astype(mx.float32)[:, None]


def dequantize_rotated(w: TrellisWeight) -> mx.array:
    """W~ (n_out, n_in) float32 from 32-bit windows of the packed words (the fallback path)."""
    n_out, n_in = w.shape
    states = states_from_windows(w.packed, n_in, w.bits, w.L, w.block)
    return decode_states(states, w.code) * w.scales.astype(mx.float32)[:, None]


def dequantize(w: TrellisWeight) -> mx.array:
    """The dense W (n_out, n_in) float32 that the quantized matrix stands for (undoes rotation)."""
    wt = dequantize_rotated(w)
    n = wt.shape[-1]
    # W = W~ h S, i.e. row r of W is s * h^T(row r of W~); h^T is h^-1.
    eye = mx.eye(n, dtype=mx.float32)
    h = mx.hadamard_transform(eye, 1.0 / math.sqrt(n))  # row i = h(e_i), so h(v) = v @ h
    return (wt @ h.T) * w.signs.astype(mx.float32)


def matmul_ref(x: mx.array, w: TrellisWeight) -> mx.array:
    """y = x W^T through the rotated reference: h(s*x) @ W~^T, float32."""
    return rotate(x, w.signs) @ dequantize_rotated_ref(w).T
