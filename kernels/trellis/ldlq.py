"""BlockLDLQ: quantize column blocks in order, feeding each block's error into the next.

The output error of a quantized layer on inputs x is E x with E = W^ - W, and its mean square is
tr(E H E^T) with H = E[x x^T] (the "proxy loss" of GPTQ/QuIP; QTIP quantizes with BlockLDLQ,
arXiv 2406.11235 section 4). Factor H = U D U^T with U block-unit-upper-triangular (identity
blocks on the diagonal; block size T, the trellis block length) and D block-diagonal. Then, for
one row e of E, e H e^T = sum_k (eU)_k D_k (eU)_k^T with (eU)_k = e_k + sum_{j<k} e_j U_jk: block k
only depends on itself and earlier blocks. So we quantize block k to the target
w_k - sum_{j<k} e_j U_jk, which zeroes the feedback term and leaves only block k's own error.
Within a block the trellis minimises plain squared error (D_k is ignored), as QTIP does.

U comes from a Cholesky factor of H with its index order reversed: P H P = C C^T with C lower;
L = C blockdiag(C)^-1 is block-unit-lower, and U = P L P.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from .codes import decode_states

if TYPE_CHECKING:
    from .quantizer import TrellisSpec

DAMP = 0.01  # add DAMP * mean(diag H) to the diagonal: H from few tokens can be singular


def block_udu(hessian: np.ndarray, block: int, damp: float = DAMP) -> np.ndarray:
    """U (n, n), block-unit-upper-triangular, with H + damp*mean(diag)*I = U D U^T."""
    h = np.asarray(hessian, dtype=np.float64)
    n = h.shape[0]
    h = h + damp * float(np.mean(np.diag(h))) * np.eye(n)
    c = np.linalg.cholesky(h[::-1, ::-1])
    lower = np.empty_like(c)
    for lo in range(0, n, block):
        cols = slice(lo, lo + block)
        lower[:, cols] = np.linalg.solve(c[cols, cols].T, c[:, cols].T).T  # C[:, b] C_bb^-1
    return lower[::-1, ::-1].copy()


def proxy_loss(err: mx.array, hessian: mx.array) -> float:
    """tr(E H E^T) / n_out: the mean squared output error per row."""
    return float(mx.sum((err @ hessian) * err) / err.shape[0])


def quantize_rows_ldlq(
    rows: mx.array,
    hessian: mx.array,
    cb: mx.array,
    spec: TrellisSpec,
    block: int,
    progress: Callable[[int], None] | None = None,
) -> tuple[mx.array, mx.array]:
    """Packed codes and row scales of rotated rows W~ (n_out, n_in) given rotated H~."""
    from .quantizer import encode_rows, pack_states, row_rms

    n_out, n_in = rows.shape
    u = mx.array(block_udu(np.array(hessian), block).astype(np.float32))
    rms = row_rms(rows)
    corr = mx.zeros_like(rows)  # sum over done blocks j of E_j U_jk, for every later column
    state_blocks = []
    for lo in range(0, n_in, block):
        hi = lo + block
        target = rows[:, lo:hi] - corr[:, lo:hi]
        states = encode_rows(target, rms, cb, spec, block)
        err = rms * mx.take(cb, states) - rows[:, lo:hi]
        if hi < n_in:
            corr = mx.concatenate([corr[:, :hi], corr[:, hi:] + err @ u[lo:hi, hi:]], axis=1)
        mx.eval(states, corr)
        state_blocks.append(states)
        if progress is not None:
            progress(n_out * block)
    states = mx.concatenate(state_blocks, axis=1)
    # Row scales that minimise the output error for the chosen codes: (c H w^T) / (c H c^T).
    values = decode_states(states, spec.code)
    vh = values @ hessian
    num = mx.sum(vh * rows, axis=1)
    den = mx.sum(vh * values, axis=1)
    scales = mx.where(den > 0, num / mx.maximum(den, 1e-30), 0.0)
    return pack_states(states, spec, block), scales
