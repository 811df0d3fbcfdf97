"""Verification rules on synthetic distributions (statistical and exact tiers).

* rejection sampling with a draft distribution q keeps the target distribution p: the first two
  tokens of a row (this round's, completed by a plain draw when the round emitted only one)
  are distributed as p0(x0) * p1(x1 | x0) — chi-square over every (x0, x1) cell, with
  temperature, top-k, min-p and a repetition penalty applied to p and q alike;
* point-mass drafts (n-gram) and greedy rows emit exactly what plain decoding draws;
* `record_ragged` equals recording each row's accepted tokens one by one.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from scipy.stats import chisquare

from engine.api import SamplingParams
from engine.sampling import SamplerState, draw, process_logits
from engine.spec.accept import (
    STREAM_DRAFT,
    column_states,
    draw_stream,
    record_ragged,
    verify,
)

V = 6
N = 24_000  # rows = independent draws (seed = row index)


def _state(params: SamplingParams, n: int = N, seed0: int = 0) -> SamplerState:
    return SamplerState.from_params([params] * n, [[5]] * n, V, list(range(seed0, seed0 + n)))


def _softmax(x: np.ndarray) -> np.ndarray:
    x = np.where(np.isfinite(x), x, -np.inf)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


TARGET = np.array(
    [
        [1.0, 0.2, -0.5, 0.7, 0.0, -1.0],
        [0.1, 0.9, 0.4, -0.3, 0.6, -0.2],
        [0.5, -0.5, 0.3, 0.3, 0.0, 0.8],
    ],
    np.float32,
)  # logits of columns 0, 1, 2 (the same for every row)
DRAFT = np.array(
    [[0.2, 1.0, 0.1, 0.3, -0.4, 0.0], [1.2, 0.3, -0.2, 0.0, 0.5, 0.4]], np.float32
)  # a deliberately different q for drafts 1, 2

PARAMS = {
    "plain_t1": SamplingParams(temperature=1.0),
    "filtered": SamplingParams(temperature=0.8, top_k=5, min_p=0.05, repetition_penalty=1.3),
}


def _round(params: SamplingParams, point_mass: bool):
    """One verify round of k = 2 drafts for N rows; returns (emitted [N, 3], accepted [N],
    states)."""
    state = _state(params)
    target = mx.broadcast_to(mx.array(TARGET)[None], (N, 3, V))
    draft_raw = mx.broadcast_to(mx.array(DRAFT)[None], (N, 2, V))
    states = [state]
    drafts, qs = [], []
    for j in range(2):
        if j:
            states.append(states[-1].record(drafts[-1]))
        if point_mass:  # a deterministic proposal: always token 1, then 0
            drafts.append(mx.full((N,), 1 - j, mx.int32))
        else:
            q = process_logits(draft_raw[:, j], states[j])
            qs.append(q)
            drafts.append(draw_stream(q, states[j], STREAM_DRAFT))
    states.append(states[-1].record(drafts[-1]))
    d = mx.stack(drafts, axis=1)
    num = mx.full((N,), 2, mx.int32)
    verdict = verify(target, states, d, num, None if point_mass else mx.stack(qs, axis=1))
    mx.eval(verdict.tokens, verdict.num_accepted)
    return np.array(verdict.tokens), np.array(verdict.num_accepted), states, target


def _expected_pairs(params: SamplingParams) -> np.ndarray:
    """p0(x0) * p1(x1 | x0) with the sampler's own processing (penalties see x0)."""
    state = _state(params, n=1)
    p0 = _softmax(np.array(process_logits(mx.array(TARGET[:1]), state)))[0]
    out = np.zeros((V, V))
    for x0 in range(V):
        s1 = state.record(mx.array([x0], mx.int32))
        p1 = _softmax(np.array(process_logits(mx.array(TARGET[1:2]), s1)))[0]
        out[x0] = p0[x0] * p1
    return out


@pytest.mark.parametrize("name", sorted(PARAMS))
@pytest.mark.parametrize("point_mass", [False, True])
def test_first_two_tokens_follow_the_target(name, point_mass):
    params = PARAMS[name]
    tokens, accepted, states, target = _round(params, point_mass)
    x0 = tokens[:, 0]
    # rows that emitted one token: the next round draws x1 plainly at column 1
    plain1 = np.array(draw(process_logits(target[:, 1], states[1]), states[1]))
    x1 = np.where(accepted >= 1, tokens[:, 1], plain1)
    # plain1 was drawn with states[1] (which recorded the draft, not x0) for rows that stopped at
    # column 0: redo those with x0 recorded so penalties see the emitted token
    stopped = accepted == 0
    if stopped.any():
        s = states[0].record(mx.array(x0.astype(np.int32)))
        redo = np.array(draw(process_logits(target[:, 1], s), s))
        x1 = np.where(stopped, redo, x1)
    observed = np.bincount(x0 * V + x1, minlength=V * V).astype(float)
    expected = _expected_pairs(params).reshape(-1)
    expected = expected / expected.sum() * N
    keep = expected > 0
    assert observed[~keep].sum() == 0, "a token the target never emits was emitted"
    stat, pvalue = chisquare(observed[keep], expected[keep])
    assert pvalue > 1e-3, (stat, pvalue)
    rate = accepted.mean() / 2
    assert 0.05 < rate < 0.95  # p and q differ, so both outcomes happen


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_point_mass_emits_plain_draws(name):
    """Under point-mass verification each emitted token is the plain sampler's draw at its
    column (same noise counter): seeded rows reproduce plain decoding exactly."""
    tokens, accepted, states, target = _round(PARAMS[name], point_mass=True)
    for c in range(3):
        plain = np.array(draw(process_logits(target[:, c], states[c]), states[c]))
        live = accepted >= c
        np.testing.assert_array_equal(tokens[live, c], plain[live])


def test_greedy_rows_accept_exact_matches_only():
    B, W = 64, 4
    rng = np.random.default_rng(0)
    logits = mx.array(rng.normal(size=(B, W, V)).astype(np.float32))
    argmax = np.array(mx.argmax(logits, axis=-1))
    drafts = argmax[:, :-1].copy()
    bad = rng.integers(0, W, size=B)  # W - 1 = no corruption
    for b in range(B):
        if bad[b] < W - 1:
            drafts[b, bad[b]] = (drafts[b, bad[b]] + 1) % V
    num = rng.integers(0, W, size=B)
    state = _state(SamplingParams(temperature=0.0), n=B)
    d = mx.array(drafts.astype(np.int32))
    states = column_states(state, d, W)
    q = mx.array(rng.normal(size=(B, W - 1, V)).astype(np.float32))
    for draft_logits in (None, q):  # the draft-model path treats greedy rows the same way
        v = verify(logits, states, d, mx.array(num.astype(np.int32)), draft_logits)
        acc = np.array(v.num_accepted)
        want = np.minimum(np.where(bad < W - 1, bad, W - 1), num)
        np.testing.assert_array_equal(acc, want)
        toks = np.array(v.tokens)
        for b in range(B):
            np.testing.assert_array_equal(toks[b, : acc[b] + 1], argmax[b, : acc[b] + 1])
        np.testing.assert_array_equal(np.array(v.last), argmax[np.arange(B), acc])


def test_record_ragged_equals_sequential_record():
    params = [
        SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.3),
        SamplingParams(temperature=0.7, repetition_penalty=1.2),
        SamplingParams(temperature=0.0),
    ]
    state = SamplerState.from_params(params, [[1, 2], [3], [4]], V, [1, 2, 3])
    tokens = mx.array([[1, 1, 4], [5, 0, 0], [2, 3, 2]], mx.int32)
    num = mx.array([3, 1, 2], mx.int32)
    got = record_ragged(state, tokens, num)
    for b, n in enumerate([3, 1, 2]):
        want = state.take([b])
        for j in range(n):
            want = want.record(tokens[b : b + 1, j])
        assert (want.counts is not None) == (b == 0) and (want.seen is not None) == (b == 1)
        assert int(got.steps[b]) == int(want.steps[0])
        if want.counts is not None:
            np.testing.assert_array_equal(np.array(got.counts[b]), np.array(want.counts[0]))
        if want.seen is not None:
            np.testing.assert_array_equal(np.array(got.seen[b]), np.array(want.seen[0]))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_greedy_fast_path_equals_general_path(monkeypatch, dtype):
    """All-greedy rows with nothing shaping the logits take the argmax fast path (no column
    states); it must give the general path's verdict, for bf16 logits (ties) too."""
    import engine.spec.accept as acc_mod

    B, W = 48, 5
    rng = np.random.default_rng(1)
    raw = rng.normal(size=(B, W, V)).astype(np.float32)
    raw[::7, :, 2] = raw[::7, :, 1]  # ties: the first index wins on both paths
    logits = mx.array(raw).astype(dtype)
    drafts = mx.array(np.array(mx.argmax(logits, axis=-1))[:, :-1].astype(np.int32))
    drafts = mx.where(mx.array(rng.random((B, W - 1)) < 0.3), (drafts + 1) % V, drafts)
    num = mx.array(rng.integers(0, W, size=B).astype(np.int32))
    state = _state(SamplingParams(temperature=0.0), n=B)
    assert acc_mod.plain_greedy(state)
    fast = verify(logits, [state], drafts, num)
    monkeypatch.setattr(acc_mod, "plain_greedy", lambda s: False)
    slow = verify(logits, column_states(state, drafts, W), drafts, num)
    for a, b in ((fast.num_accepted, slow.num_accepted), (fast.tokens, slow.tokens),
                 (fast.last, slow.last)):
        np.testing.assert_array_equal(np.array(a), np.array(b))
