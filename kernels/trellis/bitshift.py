"""The bitshift trellis: states, tail-biting bitstreams and packing into uint32 words.

A block of T weights is stored as a cyclic bitstream of T*K bits. The state of weight t is the
L-bit window that starts at bit t*K (wrapping around the block's end), read most significant bit
first. So consecutive states overlap in L - K bits,

    state[t+1] = ((state[t] << K) | next K bits) mod 2^L,

and, because the stream is cyclic ("tail-biting"), state[0] also overlaps state[T-1]. The stream is
exactly the top K bits of every state, in order, so a block costs K bits per weight with no start
state to store (QTIP, arXiv 2406.11235, section 3).

Worked example, L = 4, K = 2, T = 4, stream ``10 01 11 00``:
state[0] = 1001, state[1] = 0111, state[2] = 1100, state[3] = 00|10 = 0010 (wraps to the start).
state[3] & 0b11 = 0b10 = state[0] >> 2: the wrap overlap.

Words are big-endian in bits: bit p of the block stream is bit (31 - p % 32) of word p // 32, so a
32-bit window at bit p is ``(w[q] << off) | (w[q+1] >> (32 - off))`` with q = p // 32, off = p % 32.
"""

from __future__ import annotations

import mlx.core as mx

BLOCK_SIZES = (256, 128, 64, 32)


def block_size_for(n_in: int, max_block: int = 256) -> int | None:
    """Largest block length T <= max_block (a power of two, >= 32) that divides n_in."""
    for t in BLOCK_SIZES:
        if t <= max_block and n_in % t == 0:
            return t
    return None


def check_params(bits: int, L: int, block: int) -> None:
    if bits not in (1, 2, 3, 4, 5, 6, 7, 8):
        raise ValueError(f"bits must be in 1..8, got {bits}")
    if not bits < L <= 16:
        raise ValueError(f"need bits < L <= 16, got bits={bits}, L={L}")
    if block % 32 or block * bits < L:
        raise ValueError(f"block length {block} must be a multiple of 32 with block*bits >= L")


def words_per_block(bits: int, block: int) -> int:
    return block * bits // 32


def states_from_symbols(symbols: mx.array, L: int, K: int) -> mx.array:
    """Cyclic L-bit states of K-bit symbols along the last axis (length T)."""
    num_syms = -(-L // K)  # symbols that cover one L-bit window
    acc = mx.zeros(symbols.shape, dtype=mx.uint32)
    sym = symbols.astype(mx.uint32)
    for i in range(num_syms):
        acc = (acc << K) | mx.roll(sym, -i, -1)
    return (acc >> (num_syms * K - L)) & mx.array(2**L - 1, mx.uint32)


def symbols_from_states(states: mx.array, L: int, K: int) -> mx.array:
    """Top K bits of each state: the block's bitstream, K bits per weight."""
    return states.astype(mx.uint32) >> (L - K)


def is_tail_biting(states: mx.array, L: int, K: int) -> mx.array:
    """True where every consecutive pair of states (including last -> first) overlaps."""
    low = states.astype(mx.uint32) & mx.array(2 ** (L - K) - 1, mx.uint32)
    nxt = mx.roll(states.astype(mx.uint32), -1, -1) >> K
    return mx.all(low == nxt, axis=-1)


def pack_symbols(symbols: mx.array, K: int) -> mx.array:
    """Pack K-bit symbols (..., T) into big-endian uint32 words (..., T*K/32)."""
    *lead, T = symbols.shape
    if (T * K) % 32:
        raise ValueError(f"T*K must be a multiple of 32, got T={T}, K={K}")
    sym = symbols.astype(mx.uint32)
    shifts = mx.arange(K - 1, -1, -1, dtype=mx.uint32)
    bits = (sym[..., None] >> shifts) & mx.array(1, mx.uint32)  # (..., T, K), MSB first
    bits = bits.reshape(*lead, T * K // 32, 32)
    weights = mx.array(1, mx.uint32) << mx.arange(31, -1, -1, dtype=mx.uint32)
    return mx.sum(bits * weights, axis=-1).astype(mx.uint32)


def unpack_symbols(words: mx.array, K: int) -> mx.array:
    """Inverse of ``pack_symbols``: uint32 words (..., W) to K-bit symbols (..., W*32/K)."""
    *lead, W = words.shape
    shifts = mx.arange(31, -1, -1, dtype=mx.uint32)
    bits = (words.astype(mx.uint32)[..., None] >> shifts) & mx.array(1, mx.uint32)
    bits = bits.reshape(*lead, W * 32 // K, K)
    weights = mx.array(1, mx.uint32) << mx.arange(K - 1, -1, -1, dtype=mx.uint32)
    return mx.sum(bits * weights, axis=-1).astype(mx.uint32)


def states_from_packed(packed: mx.array, n_in: int, K: int, L: int, block: int) -> mx.array:
    """States (n_out, n_in) of a packed weight matrix (n_out, n_in*K/32), by unpacking symbols.

    Slow but obviously correct: the definition the other decoders are tested against.
    """
    n_out = packed.shape[0]
    symbols = unpack_symbols(packed, K).reshape(n_out, n_in // block, block)
    return states_from_symbols(symbols, L, K).reshape(n_out, n_in)


def window_indices(n_in: int, K: int, block: int) -> tuple[mx.array, mx.array, mx.array]:
    """For each column j: word index of its window, index of the following word, bit offset.

    The following word wraps to the block's first word at the block end (tail-biting).
    """
    j = mx.arange(n_in, dtype=mx.uint32)
    wpb = words_per_block(K, block)
    blk, t = j // block, j % block
    bit = t * K
    q = bit // 32
    word = blk * wpb + q
    nxt = blk * wpb + (q + 1) % wpb
    return word, nxt, bit % 32


def states_from_windows(packed: mx.array, n_in: int, K: int, L: int, block: int) -> mx.array:
    """States (n_out, n_in) read as 32-bit windows straight from the words (the kernels' way)."""
    word, nxt, off = window_indices(n_in, K, block)
    w0 = mx.take(packed, word, axis=1)
    w1 = mx.take(packed, nxt, axis=1)
    # (w1 >> 1) >> (31 - off) is w1 >> (32 - off) without the undefined shift by 32 at off = 0.
    window = (w0 << off) | ((w1 >> 1) >> (31 - off))
    return window >> (32 - L)
