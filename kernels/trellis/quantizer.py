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
from functools import lru_cache

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


_hadamard_ok: dict[str, bool] = {}


def _device_hadamard_ok() -> bool:
    """Whether mx.hadamard_transform runs on the default device (probed once per device)."""
    dev = str(mx.default_device())
    if dev not in _hadamard_ok:
        try:
            mx.eval(mx.hadamard_transform(mx.ones((2, 384)), 1.0))
            _hadamard_ok[dev] = True
        except Exception:
            _hadamard_ok[dev] = False
    return _hadamard_ok[dev]


@lru_cache(maxsize=16)
def hadamard_matrix(n: int) -> mx.array:
    """The matrix of h (h(v) = v @ it), built on the CPU."""
    return mx.hadamard_transform(mx.eye(n, dtype=mx.float32), 1.0 / math.sqrt(n), stream=mx.cpu)


def rotate(x: mx.array, signs: mx.array) -> mx.array:
    """x~ = h(s * x) along the last axis, in float32."""
    n = x.shape[-1]
    # float32 signs (TrellisLinear caches them) make this one op, which also promotes x
    xs = x * signs if signs.dtype == mx.float32 else x.astype(mx.float32) * signs.astype(mx.float32)
    if _device_hadamard_ok():
        return mx.hadamard_transform(xs, 1.0 / math.sqrt(n))
    return xs @ hadamard_matrix(n)  # same map through a dense matmul where the op is missing


def quantize_weight(
    weight: mx.array,
    spec: TrellisSpec,
    key: mx.array | None = None,
    progress: Callable[[int], None] | None = None,
    rows_per_step: int | None = None,
    hessian: mx.array | None = None,
) -> TrellisWeight:
    """Quantize W (n_out, n_in). ``progress(n)`` is called with the number of weights done.

    hessian: optional E[x x^T] (n_in, n_in) of the layer's inputs. With it, blocks of T columns
    are quantized in order with error feedback (BlockLDLQ, see ``ldlq.py``) and the row scales
    minimise the output error rather than the weight error.
    """
    check_code(spec.code)
    n_out, n_in = weight.shape
    block = spec.block_for(n_in)
    if block is None or not hadamard_ok(n_in):
        raise ValueError(f"cannot trellis-quantize a row of {n_in} weights")
    check_params(spec.bits, spec.L, block)
    key = mx.random.key(0) if key is None else key
    signs = random_signs(n_in, key)
    cb = codebook(spec.L, spec.code) * (CODE_GAIN.get(spec.bits, 1.0) / CODE_RMS[spec.code])
    if hessian is not None:
        from .ldlq import quantize_rows_ldlq

        packed, scales = quantize_rows_ldlq(rotate(weight, signs), rotate_hessian(hessian, signs), cb, spec, block, progress)
    else:
        packed, scales = _quantize_rows_plain(weight, signs, cb, spec, block, progress, rows_per_step)
    return TrellisWeight(
        packed=packed,
        scales=scales.astype(mx.float16),
        signs=signs,
        bits=spec.bits,
        L=spec.L,
        block=block,
        code=spec.code,
    )


def rotate_hessian(hessian: mx.array, signs: mx.array) -> mx.array:
    """E[x~ x~^T] for x~ = h(s*x): rotate rows and columns."""
    h1 = rotate(hessian, signs)  # H S h
    return rotate(mx.contiguous(h1.T), signs)  # h^T S H S h


def encode_rows(target: mx.array, rms: mx.array, cb: mx.array, spec: TrellisSpec, block: int) -> mx.array:
    """States (rows, n) for rows of ``target`` divided by their ``rms`` (rows, 1)."""
    rows, n = target.shape
    seqs = (target / rms).reshape(-1, block)
    return encode_tail_biting(seqs, cb, spec.L, spec.bits, spec.wrap_window).reshape(rows, n)


def pack_states(states: mx.array, spec: TrellisSpec, block: int) -> mx.array:
    rows, n = states.shape
    syms = symbols_from_states(states, spec.L, spec.bits).reshape(rows, n // block, block)
    return pack_symbols(syms, spec.bits).reshape(rows, -1)


def row_rms(rows: mx.array) -> mx.array:
    rms = mx.sqrt(mx.mean(mx.square(rows), axis=1, keepdims=True))
    return mx.where(rms > 0, rms, 1.0)


def _quantize_rows_plain(weight, signs, cb, spec, block, progress, rows_per_step):
    n_out, n_in = weight.shape
    budget = (1 << 22) if mx.default_device() == mx.gpu else (1 << 17)  # weights per encode call
    rows_per_step = rows_per_step or max(1, budget // n_in)
    packed_parts, scale_parts = [], []
    for lo in range(0, n_out, rows_per_step):
        rows = rotate(weight[lo : lo + rows_per_step], signs)
        states = encode_rows(rows, row_rms(rows), cb, spec, block)
        packed_parts.append(pack_states(states, spec, block))
        # Least-squares row scale for the chosen codes (never worse than rms * code scale).
        values = decode_states(states, spec.code)
        num = mx.sum(values * rows, axis=1)
        den = mx.sum(values * values, axis=1)
        scale_parts.append(mx.where(den > 0, num / mx.maximum(den, 1e-30), 0.0))
        mx.eval(packed_parts[-1], scale_parts[-1])
        if progress is not None:
            progress(rows.shape[0] * n_in)
    return mx.concatenate(packed_parts, axis=0), mx.concatenate(scale_parts, axis=0)


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
    return (wt @ hadamard_matrix(n).T) * w.signs.astype(mx.float32)


def matmul_ref(x: mx.array, w: TrellisWeight) -> mx.array:
    """y = x W^T through the rotated reference: h(s*x) @ W~^T, float32."""
    return rotate(x, w.signs) @ dequantize_rotated_ref(w).T
