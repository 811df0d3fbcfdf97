"""Viterbi encoder: equals brute force on tiny trellises; reconstruction MSE on N(0, 1)."""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest

from kernels.trellis import bitshift, codes, ldlq
from kernels.trellis import viterbi as V
from kernels.trellis.quantizer import CODE_GAIN

# ---- brute force ------------------------------------------------------------------------------


def _all_paths(L: int, K: int, T: int) -> np.ndarray:
    """Every state path of length T (start state x K-bit inputs), (2^L * 2^(K(T-1)), T)."""
    paths = []
    for s0 in range(2**L):
        for inputs in itertools.product(range(2**K), repeat=T - 1):
            s, path = s0, [s0]
            for k in inputs:
                s = ((s << K) | k) & (2**L - 1)
                path.append(s)
            paths.append(path)
    return np.array(paths)


def _costs(x: np.ndarray, paths: np.ndarray, cb: np.ndarray) -> np.ndarray:
    return ((x[:, None, :] - cb[paths][None, :, :]) ** 2).sum(-1)  # (B, num_paths)


@pytest.mark.parametrize("L,K,T", [(4, 2, 5), (5, 2, 4), (6, 3, 3)])
def test_viterbi_equals_brute_force_unconstrained(L, K, T):
    rng = np.random.default_rng(L * 10 + K)
    cb = rng.normal(size=2**L).astype(np.float32)
    x = rng.normal(size=(6, T)).astype(np.float32)
    paths = _all_paths(L, K, T)
    best = _costs(x, paths, cb).min(axis=1)
    states = V.viterbi(mx.array(x.T), mx.array(cb), L, K)
    got = np.array(V.path_cost(mx.array(x.T), states, mx.array(cb)))
    np.testing.assert_allclose(got, best, rtol=1e-5)
    # the returned path is a trellis path: consecutive states overlap
    s = np.array(states).T.astype(np.int64)
    np.testing.assert_array_equal(s[:, 1:] >> K, s[:, :-1] & (2 ** (L - K) - 1))


@pytest.mark.parametrize("L,K,T", [(4, 2, 4), (6, 2, 4), (6, 3, 3)])
def test_tail_biting_viterbi_equals_brute_force(L, K, T):
    rng = np.random.default_rng(7 + L + K)
    cb = rng.normal(size=2**L).astype(np.float32)
    x = rng.normal(size=(5, T)).astype(np.float32)
    # every cyclic bitstream of T*K bits
    streams = np.array(list(itertools.product(range(2**K), repeat=T)), dtype=np.uint32)
    paths = np.array(bitshift.states_from_symbols(mx.array(streams), L, K))
    costs = _costs(x, paths, cb)
    exact = V.exact_tail_biting(mx.array(x), mx.array(cb), L, K)
    got = np.array(V.path_cost(mx.array(x.T), exact.T, mx.array(cb)))
    np.testing.assert_allclose(got, costs.min(axis=1), rtol=1e-5)
    assert bool(mx.all(bitshift.is_tail_biting(exact, L, K)))
    # constrained Viterbi for one overlap equals brute force restricted to that overlap
    o = 1
    mask = (paths[:, 0] >> K) == o
    states = V.viterbi(mx.array(x.T), mx.array(cb), L, K, mx.full((5,), o, mx.uint32), mx.full((5,), o, mx.uint32))
    got_o = np.array(V.path_cost(mx.array(x.T), states, mx.array(cb)))
    np.testing.assert_allclose(got_o, costs[:, mask].min(axis=1), rtol=1e-5)


def test_two_pass_tail_biting_is_valid_and_near_exact():
    L, K, T = 8, 2, 32
    cb = codes.codebook(L)
    x = mx.random.normal((64, T), key=mx.random.key(3))
    approx = V.encode_tail_biting(x, cb, L, K)
    exact = V.exact_tail_biting(x, cb, L, K)
    assert bool(mx.all(bitshift.is_tail_biting(approx, L, K)))
    a = np.array(V.path_cost(x.T, approx.T, cb))
    e = np.array(V.path_cost(x.T, exact.T, cb))
    assert np.all(a >= e - 1e-4)  # exact is optimal
    assert a.sum() <= 1.02 * e.sum()  # the two-pass choice of wrap overlap loses < 2 %


# ---- reconstruction MSE (QTIP Table 1 reports 0.0733 / 0.0198 / 0.0055) -------------------------


@pytest.mark.parametrize("K,bound", [(2, 0.078), (3, 0.021), (4, 0.0058)])
def test_mse_on_gaussian_at_L12(K, bound):
    L, T = 12, 128
    x = mx.random.normal((96, T), key=mx.random.key(K))
    cb = codes.codebook(L, "1mad") * CODE_GAIN[K]
    states = V.encode_tail_biting(x, cb, L, K)
    assert bool(mx.all(bitshift.is_tail_biting(states, L, K)))
    y = mx.take(cb, states)
    # one least-squares scale per sequence, as the quantizer does per row
    a = mx.sum(x * y, axis=1, keepdims=True) / mx.sum(y * y, axis=1, keepdims=True)
    mse = float(mx.mean(mx.square(x - a * y)))
    assert mse <= bound
    # and far better than scalar quantization at the same rate (Lloyd-Max: .118/.0345/.0095)
    assert mse < {2: 0.1175, 3: 0.03454, 4: 0.0095}[K] * 0.8


# ---- BlockLDLQ --------------------------------------------------------------------------------


def test_block_udu_factorisation():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(96, 64))
    h = a.T @ a / 96
    u = ldlq.block_udu(h, 32, damp=0.0)
    for lo in range(0, 64, 32):
        np.testing.assert_allclose(u[lo : lo + 32, lo : lo + 32], np.eye(32), atol=1e-9)
        assert np.allclose(u[lo + 32 :, lo : lo + 32], 0.0)  # block upper triangular
    d = np.linalg.inv(u) @ h @ np.linalg.inv(u).T
    off_block = d.copy()
    for lo in range(0, 64, 32):
        off_block[lo : lo + 32, lo : lo + 32] = 0.0
    assert np.abs(off_block).max() < 1e-8 * np.abs(h).max()  # D is block diagonal


def test_ldlq_lowers_output_error_on_correlated_inputs():
    from kernels.trellis.quantizer import TrellisSpec, dequantize, quantize_weight

    rng = np.random.default_rng(1)
    n = 128
    mix = rng.normal(size=(n, n)) * (0.8 ** np.abs(np.subtract.outer(np.arange(n), np.arange(n))))
    xs = rng.normal(size=(2048, n)) @ mix  # strongly correlated inputs
    h = mx.array((xs.T @ xs / len(xs)).astype(np.float32))
    w = mx.random.normal((48, n), key=mx.random.key(5))
    spec = TrellisSpec(bits=2, L=8, max_block=32)  # 4 blocks of 32 columns: feedback between them
    plain = ldlq.proxy_loss(dequantize(quantize_weight(w, spec)) - w, h)
    fed = ldlq.proxy_loss(dequantize(quantize_weight(w, spec, hessian=h)) - w, h)
    assert fed < 0.85 * plain
