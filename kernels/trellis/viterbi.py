"""Viterbi encoder for the bitshift trellis, vectorised over many sequences in plain MLX.

Shortest path: D_t[s] is the least squared error of any state path that ends in state s at time t.
The predecessors of s = (o << K) | k are the 2^K states (j << (L-K)) | o that share its top L-K bits
``o``, so one step is "min over the 2^K slabs of D reshaped to (2^K, 2^(L-K), B), then add the
branch error". The arrays are state-major, batch-minor, so every slab is contiguous: on a CPU a
step is three streaming passes over 2^L * B floats; on a GPU the same ops run as MLX kernels.

The error (x - c)^2 is computed as c*(c - 2x): x^2 is the same for every state at a step, so it
cannot change the argmin.

Rather than keeping 2^(L-K) back-pointers per step, we keep the per-step minima m_t (float32) and
recompute the 2^K candidate costs during the backward pass; this keeps the forward pass free of
argmin reductions, which are the slow op on MLX's CPU backend.

Tail-biting: a block's first state must overlap its last. Trying every one of the 2^(L-K) overlaps
is exact but 2^(L-K) times dearer (``exact_tail_biting`` does it, for tests). ``encode_tail_biting``
takes two passes instead (the same idea as QTIP's tail-biting approximation, arXiv 2406.11235,
Algorithm 4, in our own formulation): an unconstrained pass over a window of the sequence rotated
so that the wrap point sits in its middle picks the overlap; a second pass then forces the start
and end states to carry it.
"""

from __future__ import annotations

import mlx.core as mx

_INF = float("inf")


def _branch_error(cb: mx.array, xt: mx.array) -> mx.array:
    """c*(c - 2x): squared error up to the state-independent x^2. cb (n,1) or gathered, xt (B,)."""
    return cb * (cb - 2.0 * xt)


def viterbi(
    x: mx.array,
    cb: mx.array,
    L: int,
    K: int,
    start_overlap: mx.array | None = None,
    end_overlap: mx.array | None = None,
) -> mx.array:
    """Best state path for each column of ``x``.

    x: (T, B) float32 targets, time-major; cb: (2^L,) code values per state.
    start_overlap: (B,) optional; the first state's top L-K bits must equal it.
    end_overlap: (B,) optional; the last state's low L-K bits must equal it.
    Returns states (T, B) uint32.
    """
    T, B = x.shape
    n, no, nk = 2**L, 2 ** (L - K), 2**K
    cbc = cb.reshape(n, 1)
    start_mask = None
    if start_overlap is not None:
        top = (mx.arange(n, dtype=mx.uint32) >> K).reshape(n, 1)
        start_mask = top == start_overlap.astype(mx.uint32).reshape(1, B)
    D = _branch_error(cbc, x[0])
    if start_mask is not None:
        D = mx.where(start_mask, D, _INF)
    minima: list[mx.array] = []
    for t in range(1, T):
        slabs = D.reshape(nk, no, B)
        m = slabs[0]
        for j in range(1, nk):
            m = mx.minimum(m, slabs[j])
        minima.append(m)
        D = (m[:, None, :] + _branch_error(cbc, x[t]).reshape(no, nk, B)).reshape(n, B)
        if t % 16 == 0:
            mx.eval(D, minima[-16:])

    j_hi = (mx.arange(nk, dtype=mx.uint32) << (L - K)).reshape(nk, 1)
    if end_overlap is not None:
        cand = j_hi + end_overlap.astype(mx.uint32).reshape(1, B)
        pick = mx.argmin(mx.take_along_axis(D, cand, axis=0), axis=0)
        last = mx.take_along_axis(cand, pick.reshape(1, B), axis=0)[0]
    else:
        last = mx.argmin(D, axis=0).astype(mx.uint32)

    states = [last]
    s = last
    for t in range(T - 1, 0, -1):
        cand = j_hi + (s >> K).reshape(1, B)  # (nk, B) predecessors of s
        cost = _branch_error(mx.take(cb, cand), x[t - 1].reshape(1, B))
        if t - 1 >= 1:
            cost = cost + mx.take_along_axis(minima[t - 2], cand >> K, axis=0)
        elif start_mask is not None:
            cost = mx.where(mx.take_along_axis(start_mask, cand, axis=0), cost, _INF)
        pick = mx.argmin(cost, axis=0).reshape(1, B)
        s = mx.take_along_axis(cand, pick, axis=0)[0]
        states.append(s)
    return mx.stack(states[::-1], axis=0)


def path_cost(x: mx.array, states: mx.array, cb: mx.array) -> mx.array:
    """Sum of squared errors of a state path; x and states (T, B). Returns (B,)."""
    return mx.sum(mx.square(x - mx.take(cb, states)), axis=0)


def _chunk_size(T: int, L: int, K: int, budget_bytes: int) -> int:
    per_seq = 4 * (T * 2 ** (L - K) + 4 * 2**L)  # stored minima + a few live 2^L slabs
    return max(1, budget_bytes // per_seq)


def encode_tail_biting(
    x: mx.array,
    cb: mx.array,
    L: int,
    K: int,
    wrap_window: int | None = 64,
    budget_bytes: int | None = None,
) -> mx.array:
    """Tail-biting state paths for sequences x (N, T). Returns states (N, T) uint32.

    wrap_window: length of the rotated window used to pick each block's wrap overlap
    (None: the whole sequence; 64 costs about half a pass and loses little, see docs/trellis.md).
    budget_bytes: working memory per chunk of sequences (default 192 MiB on a CPU, 8 GiB on a GPU,
    where bigger chunks amortise the per-step launches).
    """
    N, T = x.shape
    if budget_bytes is None:
        budget_bytes = (8 << 30) if mx.default_device() == mx.gpu else (192 << 20)
    chunk = _chunk_size(T, L, K, budget_bytes)
    win = T if wrap_window is None else max(2, min(T, wrap_window))
    half = win // 2
    out = []
    for lo in range(0, N, chunk):
        xc = x[lo : lo + chunk].astype(mx.float32)
        rotated = mx.concatenate([xc[:, T - half :], xc[:, : win - half]], axis=1)
        first = viterbi(mx.contiguous(rotated.T), cb, L, K)
        overlap = first[half] >> K  # top L-K bits of the state at original t = 0
        states = viterbi(mx.contiguous(xc.T), cb, L, K, start_overlap=overlap, end_overlap=overlap)
        mx.eval(states)
        out.append(states.T)
    return mx.concatenate(out, axis=0) if len(out) > 1 else out[0]


def exact_tail_biting(x: mx.array, cb: mx.array, L: int, K: int) -> mx.array:
    """Optimal tail-biting paths by trying every wrap overlap (2^(L-K) passes; tests only)."""
    N, T = x.shape
    no = 2 ** (L - K)
    xt = mx.repeat(x.astype(mx.float32).T, no, axis=1)  # (T, N*no), column i*no + o
    overlaps = mx.tile(mx.arange(no, dtype=mx.uint32), N)
    states = viterbi(xt, cb, L, K, start_overlap=overlaps, end_overlap=overlaps)
    cost = path_cost(xt, states, cb).reshape(N, no)
    best = mx.argmin(cost, axis=1)
    states = states.T.reshape(N, no, T)
    return mx.take_along_axis(states, best.reshape(N, 1, 1), axis=1)[:, 0]
