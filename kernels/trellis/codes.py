"""Compute-based trellis codes: map an L-bit state to one pseudo-Gaussian value.

Both codes are defined in QTIP (Tseng et al., arXiv 2406.11235, section 3.1): a state is hashed by
one 32-bit linear-congruential step and the hash is turned into a roughly N(0, sigma^2) value
with a couple of bit operations, so a GPU decodes a weight in a handful of instructions instead
of reading a 2^L-entry lookup table.

- 1MAD: ``x = s * 34038481 + 76625530 (mod 2^32)``; value = (sum of x's four bytes - 510) /
  147.800537109375. The four bytes are close to independent uniforms on 0..255, so their sum has
  mean 510 and standard deviation sqrt(4 * (256^2 - 1) / 12) = 147.80: the code has RMS ~1.000.
- 3INST: ``x = s * 89226354 + 64248484 (mod 2^32)``; ``m = (x & 0x8FFF8FFF) ^ 0x3B603B60``; value =
  the sum of m's two 16-bit halves read as IEEE float16. The mask keeps sign, mantissa and the two
  low exponent bits; the xor pins the exponent to 2^-3..2^0. QTIP reports RMS 1.2437 over L = 16.

``decode_states`` is the plain-MLX definition; the fused kernels (``kernel_source.py``) implement the
same arithmetic with bit tricks and are tested against it.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

CODES = ("1mad", "3inst")

MAD_A, MAD_B = 34038481, 76625530
MAD_NORM = 147.800537109375
INST_A, INST_B = 89226354, 64248484
INST_MASK, INST_XOR = 0x8FFF8FFF, 0x3B603B60

# Code RMS over all states at L = 16 (measured by tests/test_trellis_codes.py; QTIP gives both).
CODE_RMS = {"1mad": 1.0, "3inst": 1.2437}


def check_code(code: str) -> str:
    code = code.lower()
    if code not in CODES:
        raise ValueError(f"unknown trellis code {code!r}; expected one of {CODES}")
    return code


def _lcg(states: mx.array, a: int, b: int) -> mx.array:
    # uint32 multiply/add wrap modulo 2^32, which is exactly the LCG step.
    s = states.astype(mx.uint32)
    return s * mx.array(a, mx.uint32) + mx.array(b, mx.uint32)


def decode_1mad(states: mx.array) -> mx.array:
    x = _lcg(states, MAD_A, MAD_B)
    mask = mx.array(0xFF, mx.uint32)
    total = (x & mask) + ((x >> 8) & mask) + ((x >> 16) & mask) + (x >> 24)
    return (total.astype(mx.float32) - 510.0) / MAD_NORM


def decode_3inst(states: mx.array) -> mx.array:
    x = _lcg(states, INST_A, INST_B)
    m = (x & mx.array(INST_MASK, mx.uint32)) ^ mx.array(INST_XOR, mx.uint32)
    lo = (m & mx.array(0xFFFF, mx.uint32)).astype(mx.uint16).view(mx.float16)
    hi = (m >> 16).astype(mx.uint16).view(mx.float16)
    return lo.astype(mx.float32) + hi.astype(mx.float32)


def decode_states(states: mx.array, code: str = "1mad") -> mx.array:
    """Values (float32, unnormalised) of integer trellis states under ``code``."""
    code = check_code(code)
    return decode_1mad(states) if code == "1mad" else decode_3inst(states)


@lru_cache(maxsize=16)
def _codebook_cached(L: int, code: str) -> mx.array:
    table = decode_states(mx.arange(2**L, dtype=mx.uint32), code)
    mx.eval(table)
    return table


def codebook(L: int, code: str = "1mad") -> mx.array:
    """All 2^L code values, indexed by state (float32)."""
    return _codebook_cached(int(L), check_code(code))
