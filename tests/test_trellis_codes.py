"""Trellis codes and the bitshift trellis: code statistics, state overlaps, packing."""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.trellis import bitshift, codes

# ---- codes ------------------------------------------------------------------------------------


def test_1mad_rms_is_one():
    values = np.array(codes.codebook(16, "1mad"))
    assert abs(np.sqrt(np.mean(values**2)) - 1.000) < 2e-3
    assert abs(values.mean()) < 5e-3


def test_3inst_rms_matches_qtip():
    values = np.array(codes.codebook(16, "3inst"))
    assert abs(np.sqrt(np.mean(values**2)) - 1.2437) < 1e-3
    assert abs(values.mean()) < 5e-3


def test_1mad_matches_its_definition_with_python_ints():
    # Independent scalar definition: LCG in Python ints, bytes summed one by one.
    rng = np.random.default_rng(0)
    states = rng.integers(0, 2**16, size=200)
    got = np.array(codes.decode_states(mx.array(states.astype(np.uint32)), "1mad"))
    for s, v in zip(states, got, strict=True):
        x = (int(s) * 34038481 + 76625530) % 2**32
        expect = (sum((x >> (8 * i)) & 0xFF for i in range(4)) - 510) / 147.800537109375
        assert v == pytest.approx(expect, abs=1e-6)


def test_3inst_matches_its_definition_with_numpy_halves():
    states = np.arange(0, 2**16, 97, dtype=np.uint64)
    x = ((states * 89226354 + 64248484) % 2**32).astype(np.uint32)
    m = (x & np.uint32(0x8FFF8FFF)) ^ np.uint32(0x3B603B60)
    halves = m.view(np.float16).astype(np.float32).reshape(-1, 2)  # little-endian: low half first
    got = np.array(codes.decode_states(mx.array(states.astype(np.uint32)), "3inst"))
    np.testing.assert_array_equal(got, halves[:, 0] + halves[:, 1])


def test_3inst_values_bounded_by_pinned_exponent():
    # Each half has exponent 2^-3..2^0 and |mantissa| < 2: |value| < 4, never 0, never inf.
    values = np.array(codes.codebook(16, "3inst"))
    assert np.all(np.isfinite(values)) and np.max(np.abs(values)) < 4.0


def test_unknown_code_rejected():
    with pytest.raises(ValueError):
        codes.decode_states(mx.arange(4), "hyb")


# ---- bitshift trellis -------------------------------------------------------------------------


def test_worked_example_from_docstring():
    syms = mx.array([[0b10, 0b01, 0b11, 0b00]], dtype=mx.uint32)
    states = np.array(bitshift.states_from_symbols(syms, 4, 2))[0]
    assert list(states) == [0b1001, 0b0111, 0b1100, 0b0010]


LK = st.sampled_from([(4, 2), (8, 2), (12, 2), (12, 3), (12, 4), (16, 2), (16, 3), (16, 4), (9, 4)])


@settings(max_examples=40, deadline=None)
@given(lk=LK, n_blocks=st.integers(1, 3), seed=st.integers(0, 2**31 - 1), t32=st.sampled_from([32, 64, 128]))
def test_consecutive_states_share_L_minus_K_bits_including_wrap(lk, n_blocks, seed, t32):
    L, K = lk
    rng = np.random.default_rng(seed)
    syms = rng.integers(0, 2**K, size=(n_blocks, t32)).astype(np.uint32)
    states = np.array(bitshift.states_from_symbols(mx.array(syms), L, K)).astype(np.int64)
    low = states & (2 ** (L - K) - 1)
    nxt = np.roll(states, -1, axis=1) >> K  # last -> first is the wrap
    np.testing.assert_array_equal(low, nxt)
    assert bool(mx.all(bitshift.is_tail_biting(mx.array(states.astype(np.uint32)), L, K)))
    # and the stream is exactly the states' top K bits
    np.testing.assert_array_equal(states >> (L - K), syms)


def test_broken_wrap_is_detected():
    syms = mx.array([[1, 2, 3, 0, 1, 2, 3, 0]], dtype=mx.uint32)
    states = bitshift.states_from_symbols(syms, 6, 2)
    bad = mx.concatenate([states[:, :-1], (states[:, -1:] ^ 1)], axis=1)  # flip a low bit of the last
    assert bool(bitshift.is_tail_biting(states, 6, 2)[0])
    assert not bool(bitshift.is_tail_biting(bad, 6, 2)[0])


@settings(max_examples=40, deadline=None)
@given(K=st.integers(1, 8), words=st.integers(1, 6), rows=st.integers(1, 3), seed=st.integers(0, 2**31 - 1))
def test_pack_unpack_round_trip(K, words, rows, seed):
    T = words * 32  # T*K is then a multiple of 32 for every K
    rng = np.random.default_rng(seed)
    syms = rng.integers(0, 2**K, size=(rows, T)).astype(np.uint32)
    packed = bitshift.pack_symbols(mx.array(syms), K)
    assert packed.dtype == mx.uint32 and packed.shape == (rows, T * K // 32)
    np.testing.assert_array_equal(np.array(bitshift.unpack_symbols(packed, K)), syms)


@settings(max_examples=20, deadline=None)
@given(K=st.integers(1, 8), seed=st.integers(0, 2**31 - 1))
def test_unpack_pack_round_trip_on_arbitrary_words(K, seed):
    words = np.random.default_rng(seed).integers(0, 2**32, size=(2, K * 3), dtype=np.uint64).astype(np.uint32)
    back = bitshift.pack_symbols(bitshift.unpack_symbols(mx.array(words), K), K)
    np.testing.assert_array_equal(np.array(back), words)


def test_pack_is_big_endian_msb_first():
    syms = mx.array([[0b11] + [0] * 15], dtype=mx.uint32)  # T=16, K=2: one word
    assert int(bitshift.pack_symbols(syms, 2)[0, 0]) == 0xC0000000


@pytest.mark.parametrize("L,K,block", [(12, 2, 32), (12, 3, 128), (16, 4, 64), (16, 3, 256), (8, 4, 32)])
def test_window_reads_equal_symbol_unpacking(L, K, block):
    rng = np.random.default_rng(L * 100 + K)
    n_in = 2 * block
    words = rng.integers(0, 2**32, size=(3, n_in * K // 32), dtype=np.uint64).astype(np.uint32)
    a = bitshift.states_from_packed(mx.array(words), n_in, K, L, block)
    b = bitshift.states_from_windows(mx.array(words), n_in, K, L, block)
    np.testing.assert_array_equal(np.array(a), np.array(b))


def test_block_size_choice():
    assert bitshift.block_size_for(4096) == 256
    assert bitshift.block_size_for(384) == 128  # tinycoder: 384 = 3 * 128
    assert bitshift.block_size_for(96) == 32
    assert bitshift.block_size_for(4096, max_block=128) == 128
    assert bitshift.block_size_for(100) is None


@pytest.mark.parametrize("L,K", list(itertools.product([12, 16], [2, 3, 4])))
def test_params_accept_issue_configs(L, K):
    bitshift.check_params(K, L, 128)
    bitshift.check_params(K, L, 256)
