"""engine.sampling: exact checks against a numpy reference, and statistical checks of the draws.

Exact tier: greedy = argmax, neutral rows untouched, every filter and penalty equal to a small
float64 numpy reference (hypothesis over logits and per-row params), rows aligned through
take/concat/record, a seeded row's draws independent of its batch mates.
Statistical tier: the empirical distribution of many draws matches the softmax (chi-square with
fixed seeds), and filtered-out tokens never appear.
(tests/conftest.py imports `engine`, which loads OpenBLAS, before this module imports mlx.)
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from scipy import stats

from engine.api import SamplingParams
from engine.sampling import SamplerState, draw, process_logits, sample, uniform_noise

NEG_INF = -np.inf


def make_state(params, vocab_size, prompt_ids=None, seeds=None) -> SamplerState:
    prompt_ids = prompt_ids if prompt_ids is not None else [[] for _ in params]
    seeds = seeds if seeds is not None else list(range(len(params)))
    return SamplerState.from_params(list(params), prompt_ids, vocab_size, seeds)


def softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


# ---------------------------------------------------------------------------------------------
# numpy reference (float64, one row at a time, written from the semantics, not the code)


class Ambiguous(Exception):
    """The row sits within float32 noise of a filter boundary; the test discards it."""


def process_row_ref(
    logits: np.ndarray, p: SamplingParams, prompt: list[int], generated: list[int]
) -> np.ndarray:
    x = logits.astype(np.float64).copy()
    V = x.size
    if p.repetition_penalty != 1.0:
        for t in set(prompt) | set(generated):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    counts = np.bincount(np.asarray(generated, dtype=np.int64), minlength=V).astype(np.float64)
    x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    for t, b in p.logit_bias.items():
        x[t] += b
    if p.allowed_token_ids is not None:
        x[np.setdiff1d(np.arange(V), p.allowed_token_ids)] = NEG_INF
    if p.temperature == 0:
        return x
    x = x / p.temperature
    keep = np.isfinite(x)
    if 0 < p.top_k < V:
        kth = np.sort(x)[::-1][p.top_k - 1]
        _check_margin(x[keep], kth)
        keep &= x >= kth
    if p.top_p < 1.0:
        probs = softmax(np.where(keep, x, NEG_INF))
        order = np.argsort(-probs, kind="stable")
        cum = np.cumsum(probs[order])
        if np.min(np.abs(cum[:-1] - p.top_p)) < 1e-4:
            raise Ambiguous
        n = min(int(np.searchsorted(cum, p.top_p)) + 1, int(keep.sum()))  # first cum >= top_p
        thresh = x[order[n - 1]]
        _check_margin(x[keep], thresh)
        keep &= x >= thresh
    if p.min_p > 0:
        probs = softmax(np.where(keep, x, NEG_INF))
        ratio = probs / probs.max()
        if np.any(np.abs(np.log(ratio[keep]) - math.log(p.min_p)) < 1e-4):
            raise Ambiguous
        keep &= ratio >= p.min_p
    return np.where(keep, x, NEG_INF)


def _check_margin(values: np.ndarray, thresh: float) -> None:
    gap = np.abs(values - thresh)
    if np.any((gap > 0) & (gap < 1e-4 * max(1.0, abs(thresh)))):
        raise Ambiguous


# ---------------------------------------------------------------------------------------------
# hypothesis strategies

V_SMALL = 24


def grid(bound: int) -> st.SearchStrategy[float]:
    """Values on a 1/16 grid: exact in float32, so the float64 reference sees the same inputs."""
    return st.integers(-16 * bound, 16 * bound).map(lambda v: v / 16)


@st.composite
def row_params(draw_, vocab_size: int = V_SMALL) -> SamplingParams:
    ids = st.integers(0, vocab_size - 1)
    return SamplingParams(
        temperature=draw_(st.sampled_from([0.0, 0.3, 0.7, 1.0, 1.0, 1.6])),
        top_k=draw_(st.sampled_from([0, 0, 1, 2, 5, 11, vocab_size, vocab_size + 3])),
        top_p=draw_(st.one_of(st.just(1.0), st.floats(0.05, 0.99))),
        min_p=draw_(st.one_of(st.just(0.0), st.floats(0.01, 0.6))),
        repetition_penalty=draw_(st.sampled_from([1.0, 1.0, 0.8, 1.3, 2.0])),
        presence_penalty=draw_(st.one_of(st.just(0.0), grid(2))),
        frequency_penalty=draw_(st.one_of(st.just(0.0), grid(2))),
        logit_bias=draw_(st.dictionaries(ids, grid(100), max_size=4)),
        allowed_token_ids=draw_(
            st.one_of(st.none(), st.lists(ids, min_size=1, max_size=8, unique=True).map(tuple))
        ),
    )


@st.composite
def batches(draw_):
    num_rows = draw_(st.integers(1, 5))
    params = [draw_(row_params()) for _ in range(num_rows)]
    # logits on a 1/8 grid: exact in float32, with occasional exact ties
    logits = (
        np.array(
            draw_(
                st.lists(
                    st.integers(-80, 80), min_size=num_rows * V_SMALL, max_size=num_rows * V_SMALL
                )
            ),
            np.float32,
        ).reshape(num_rows, V_SMALL)
        / 8
    )
    prompts = [draw_(st.lists(st.integers(0, V_SMALL - 1), max_size=6)) for _ in range(num_rows)]
    num_generated = draw_(st.integers(0, 4))
    generated = np.array(
        draw_(
            st.lists(
                st.integers(0, V_SMALL - 1),
                min_size=num_rows * num_generated,
                max_size=num_rows * num_generated,
            )
        ),
        np.int64,
    ).reshape(num_rows, num_generated)
    return params, logits, prompts, generated


def build(params, prompts, generated, vocab_size=V_SMALL, seeds=None) -> SamplerState:
    state = make_state(params, vocab_size, prompts, seeds)
    for step in range(generated.shape[1]):
        state = state.record(mx.array(generated[:, step].astype(np.int32)))
    return state


def assert_matches_ref(processed: np.ndarray, ref: np.ndarray) -> None:
    assert np.array_equal(np.isfinite(processed), np.isfinite(ref)), (processed, ref)
    finite = np.isfinite(ref)
    np.testing.assert_allclose(processed[finite], ref[finite], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# exact tier


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_process_logits_matches_numpy_reference(batch):
    params, logits, prompts, generated = batch
    try:
        refs = [
            process_row_ref(logits[i], p, prompts[i], list(generated[i]))
            for i, p in enumerate(params)
        ]
    except Ambiguous:
        assume(False)
    state = build(params, prompts, generated)
    processed = np.array(process_logits(mx.array(logits), state))
    for row, ref in enumerate(refs):
        assert_matches_ref(processed[row], ref)
    # greedy rows draw the reference argmax
    tokens = np.array(draw(mx.array(processed), state))
    for row, p in enumerate(params):
        if p.temperature == 0:
            assert tokens[row] == np.argmax(refs[row])
        else:  # a sampled token is never a filtered one
            assert np.isfinite(refs[row][tokens[row]])


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(top_k=3),
        SamplingParams(top_p=0.5),
        SamplingParams(min_p=0.2),
        SamplingParams(temperature=0.5),
        SamplingParams(repetition_penalty=1.5),
        SamplingParams(presence_penalty=1.0, frequency_penalty=0.5),
        SamplingParams(logit_bias={3: 5.0}),
        SamplingParams(top_k=2, top_p=0.9, min_p=0.1, temperature=0.8),
    ],
    ids=["top_k", "top_p", "min_p", "temperature", "repetition", "presence_freq", "bias", "all"],
)
def test_each_filter_matches_reference(params):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(1, 32)).astype(np.float32) * 3
    prompt, generated = [1, 2, 5], np.array([[5, 7, 7]])
    ref = process_row_ref(logits[0], params, prompt, list(generated[0]))
    state = build([params], [prompt], generated, vocab_size=32)
    processed = np.array(process_logits(mx.array(logits), state))[0]
    assert_matches_ref(processed, ref)
    assert not np.array_equal(processed, logits[0])  # the setting did something


@pytest.mark.parametrize("top_p, num_kept", [(0.4, 1), (0.5, 24), (1.0, 24)])
def test_top_k_keeps_ties_and_top_p_sees_their_mass(top_p, num_kept):
    """bf16 logits tie often: top-k keeps every token tied with the k-th largest, and top-p
    renormalises over all of them, even those outside the partition's k candidates."""
    logits = np.zeros((1, 24), np.float32)
    logits[0, 5] = 3.0  # p = e^3 / (e^3 + 23) = 0.466 among the survivors
    params = SamplingParams(top_k=2, top_p=top_p)
    state = make_state([params], 24)
    assert state.top_k_rows is not None  # the partition path
    processed = np.array(process_logits(mx.array(logits), state))[0]
    assert np.isfinite(processed).sum() == num_kept
    assert_matches_ref(processed, process_row_ref(logits[0], params, [], []))


def _nucleus_f64(row: np.ndarray, top_p: float) -> int:
    """How many tokens top-p keeps, in float64 (the reference for float32 rounding)."""
    xs = np.sort(row.astype(np.float64))[::-1]
    probs = np.exp(xs - xs[0])
    probs /= probs.sum()
    return max(int((np.cumsum(probs) - probs < top_p).sum()), 1)


@pytest.mark.parametrize("scale, flat_row", [(8.0, False), (4.0, False), (8.0, True)])
def test_top_p_on_the_cpu_sorts_only_its_candidates_when_they_hold_the_nucleus(
        monkeypatch, scale, flat_row):
    """Top-p without top-k over a 32,000-token vocabulary: where every row's nucleus lies within
    the `TOP_P_CANDIDATES` largest logits, only those are sorted, and the kept set is what a
    float64 sort of the whole vocabulary keeps (within one token where float32 rounding meets
    the boundary; the full float32 sort is no closer); one flat row among them (a nucleus of
    thousands) sends every row to the full sort."""
    import engine.sampling as sampling

    rng = np.random.default_rng(int(scale))
    logits = (rng.standard_normal((8, 32000)) * scale).astype(np.float32)
    if flat_row:
        logits[3] *= 0.05
    top_p = np.array([0.5, 0.8, 0.9, 0.95] * 2, np.float32)
    full_sorts = []
    real = sampling._top_k_top_p_threshold
    monkeypatch.setattr(sampling, "_top_k_top_p_threshold",
                        lambda *a: full_sorts.append(a[-1]) or real(*a))
    thresh = np.array(sampling._top_p_threshold(mx.array(logits), mx.array(top_p)))
    kept = (logits >= thresh[:, None]).sum(axis=1)
    assert full_sorts == ([32000] if flat_row else [])
    want = [_nucleus_f64(logits[i], float(top_p[i])) for i in range(8)]
    assert max(want) > (sampling.TOP_P_CANDIDATES if flat_row else 10)
    if flat_row:
        full = np.array(real(mx.array(logits), mx.zeros((8,), mx.int32), mx.array(top_p), 32000))
        np.testing.assert_array_equal(thresh, full)
    else:
        assert np.abs(kept - want).max() <= 1, (kept, want)
        assert (kept == want).mean() >= 0.5, (kept, want)


def test_neutral_rows_are_bit_identical_in_a_busy_batch():
    V = 64
    rng = np.random.default_rng(1)
    logits = (rng.normal(size=(6, V)) * 4).astype(np.float32)
    busy = SamplingParams(
        temperature=0.7,
        top_k=5,
        top_p=0.8,
        min_p=0.1,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        logit_bias={1: 2.0},
    )
    params = [
        SamplingParams(),
        busy,
        SamplingParams(temperature=0.0),
        busy,
        SamplingParams(top_p=0.6),
        SamplingParams(),
    ]
    state = build(params, [[1, 2, 3]] * 6, np.tile([[4, 4, 9]], (6, 1)), vocab_size=V)
    assert state.counts is not None and state.seen is not None and state.bias is not None
    assert state.needs_sort and state.needs_min_p and state.needs_temperature
    processed = np.array(process_logits(mx.array(logits), state))
    for row in (0, 2, 5):
        assert np.array_equal(processed[row], logits[row])
    assert not np.array_equal(processed[1], logits[1])
    assert np.isinf(processed[4]).any()


def test_greedy_equals_argmax_and_ignores_filters_and_seed():
    V = 100
    rng = np.random.default_rng(2)
    logits = (rng.normal(size=(8, V)) * 2).astype(np.float32)
    params = [
        SamplingParams(temperature=0.0, top_k=k, top_p=p)
        for k, p in [(0, 1.0), (1, 0.1), (50, 0.5), (0, 1.0)] * 2
    ]
    params[3] = SamplingParams(temperature=1.0)  # one sampled row in the batch
    state = make_state(params, V, seeds=[11] * 8)
    for step in range(5):
        tokens = np.array(sample(mx.array(logits), state).tokens)
        greedy_rows = [i for i in range(8) if i != 3]
        assert np.array_equal(tokens[greedy_rows], logits[greedy_rows].argmax(-1))
        state = state.record(mx.array(tokens))
        assert np.array(state.steps).tolist() == [step + 1] * 8
    all_greedy = make_state([SamplingParams(temperature=0.0)] * 8, V)
    assert all_greedy.all_greedy
    assert np.array_equal(np.array(sample(mx.array(logits), all_greedy).tokens), logits.argmax(-1))


def test_allowed_token_ids_and_bias_validation():
    V = 50
    allowed = (3, 17, 40)
    params = SamplingParams(allowed_token_ids=allowed, logit_bias={17: -100.0})
    state = make_state([params] * 400, V, seeds=list(range(400)))
    logits = mx.array(np.zeros((400, V), np.float32))
    tokens = set(np.array(sample(logits, state).tokens).tolist())
    assert tokens == {3, 40}  # 17 is allowed but biased away (e^-100)
    with pytest.raises(ValueError):
        make_state([SamplingParams(logit_bias={V: 1.0})], V)
    with pytest.raises(ValueError):
        make_state([SamplingParams(allowed_token_ids=())], V)
    with pytest.raises(ValueError):
        make_state([SamplingParams(repetition_penalty=1.2)], V, prompt_ids=[[V + 1]])


# ---------------------------------------------------------------------------------------------
# the RNG


def _fmix32_py(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def uniform_ref(seed: int, step: int, index: int) -> np.float32:
    """The docstring's recipe in plain Python integers."""
    m = 0xFFFFFFFF
    k1 = _fmix32_py((_fmix32_py(seed ^ 0x5BD1E995) + step * 0x9E3779B9) & m)
    k2 = _fmix32_py((k1 + 0x9E3779B9) & m)
    j = _fmix32_py((index * 0xCC9E2D51 + 0x1B873593) & m)
    h = _fmix32_py((_fmix32_py(k1 ^ j) + k2) & m)
    u = (np.float32(h) + np.float32(0.5)) * np.float32(2.0**-32)
    return min(u, np.float32(1 - 2.0**-24))


def test_uniform_noise_follows_the_documented_recipe():
    u = np.array(uniform_noise(mx.array([42], mx.uint32), mx.array([0], mx.uint32), 3))[0]
    np.testing.assert_array_equal(u, np.array([0.6509361, 0.4867955, 0.2073181], np.float32))
    rng = np.random.default_rng(3)
    seeds = rng.integers(0, 2**32, size=16, dtype=np.uint64)
    steps = rng.integers(0, 2**32, size=16, dtype=np.uint64)
    noise = np.array(
        uniform_noise(mx.array(seeds.astype(np.uint32)), mx.array(steps.astype(np.uint32)), 5000)
    )
    for row in range(16):
        for index in (0, 1, 777, 4999):
            assert noise[row, index] == uniform_ref(int(seeds[row]), int(steps[row]), index)


def test_uniform_noise_is_uniform_and_independent():
    V = 4096
    seeds = mx.array([0, 0, 1, 2**31, 0, 0], mx.uint32)
    steps = mx.array([0, 1, 0, 0, 0, 2**32 - 1], mx.uint32)
    u = np.array(uniform_noise(seeds, steps, V)).astype(np.float64)
    assert (u > 0).all() and (u < 1).all()
    assert np.array_equal(u[0], u[4])  # same (seed, step): same numbers
    assert stats.kstest(u.ravel(), "uniform").pvalue > 0.001
    # different seeds / steps and neighbouring indices are uncorrelated
    for a, b in [(0, 1), (0, 2), (2, 3), (1, 5)]:
        assert abs(np.corrcoef(u[a], u[b])[0, 1]) < 0.06
        assert np.mean(u[a] == u[b]) < 0.01
    assert abs(np.corrcoef(u[0, :-1], u[0, 1:])[0, 1]) < 0.06
    assert len(np.unique(u[0])) == V  # a bijection of the index within a row


def test_seeds_beyond_32_bits_are_folded():
    state = make_state([SamplingParams()] * 3, 8, seeds=[2**40 + 5, -1, 5])
    seeds = np.array(state.seeds).tolist()
    assert seeds[0] != seeds[2] and 0 <= seeds[1] < 2**32


# ---------------------------------------------------------------------------------------------
# statistical tier: many draws (one row per draw, the step counter varying) match the softmax

N_DRAWS = 20_000


def empirical(logits_row: np.ndarray, params: SamplingParams, vary: str) -> np.ndarray:
    V = logits_row.size
    state = make_state([params] * N_DRAWS, V, seeds=[1234] * N_DRAWS)
    if vary == "step":
        state.steps = mx.arange(N_DRAWS, dtype=mx.uint32)
    else:
        state.seeds = mx.arange(N_DRAWS, dtype=mx.uint32) * 7919
    logits = mx.broadcast_to(mx.array(logits_row)[None], (N_DRAWS, V))
    tokens = np.array(sample(logits, state).tokens)
    return np.bincount(tokens, minlength=V)


STAT_LOGITS = np.random.default_rng(4).normal(size=12).astype(np.float32)


@pytest.mark.parametrize(
    "params, vary",
    [
        (SamplingParams(), "step"),
        (SamplingParams(), "seed"),
        (SamplingParams(temperature=0.7, top_k=5), "step"),
        (SamplingParams(top_p=0.75), "step"),
        (SamplingParams(temperature=1.3, top_k=8, top_p=0.9, min_p=0.1), "seed"),
        (SamplingParams(min_p=0.25, logit_bias={0: 1.5}), "step"),
    ],
)
def test_draws_match_the_filtered_softmax(params, vary):
    expected = process_row_ref(STAT_LOGITS, params, [], [])
    probs = softmax(expected)  # exp(-inf) = 0 for the filtered tokens
    counts = empirical(STAT_LOGITS, params, vary)
    kept = probs > 0
    assert counts[~kept].sum() == 0, "a filtered-out token was drawn"
    assert kept.sum() >= 2
    result = stats.chisquare(counts[kept], probs[kept] / probs[kept].sum() * N_DRAWS)
    assert result.pvalue > 0.001, (counts, probs * N_DRAWS)


def test_chi_square_detects_a_wrong_distribution():
    """The statistical check has power: draws at temperature 1 fail against temperature 0.8."""
    counts = empirical(STAT_LOGITS, SamplingParams(), "step")
    wrong = softmax(STAT_LOGITS / 0.8)
    assert stats.chisquare(counts, wrong * N_DRAWS).pvalue < 1e-6


# ---------------------------------------------------------------------------------------------
# batch independence and row alignment


def test_seeded_row_is_independent_of_its_batch():
    V, num_steps = 40, 24
    rng = np.random.default_rng(5)
    mine = SamplingParams(temperature=0.9, top_p=0.9, repetition_penalty=1.2, seed=99)
    my_logits = (rng.normal(size=(num_steps, V)) * 2).astype(np.float32)
    prompt = [1, 2, 3]

    alone = make_state([mine], V, [prompt], seeds=[99])
    alone_tokens = []
    for step in range(num_steps):
        tok = sample(mx.array(my_logits[step : step + 1]), alone).tokens
        alone_tokens.append(int(tok[0]))
        alone = alone.record(tok)

    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.5, top_k=3, presence_penalty=1.0, logit_bias={5: 3.0}),
        SamplingParams(min_p=0.3, frequency_penalty=0.7, allowed_token_ids=(1, 2, 9)),
    ]
    batch = make_state([others[0], mine, others[1]], V, [[4], prompt, [7, 8]], seeds=[99, 99, 5])
    batch_tokens = []
    for step in range(num_steps):
        if step == 8:  # a row leaves and a new one joins in front
            batch = batch.take([2, 1])
            newcomer = make_state([others[2]], V, [[0]], seeds=[99])
            batch = SamplerState.concat([newcomer, batch])
        if step == 16:  # reorder, drop the newcomer
            batch = batch.take(mx.array([1, 2]))
        mine_row = 1 if step < 8 else (2 if step < 16 else 1)
        logits = (rng.normal(size=(batch.batch_size, V)) * 2).astype(np.float32)
        logits[mine_row] = my_logits[step]
        tokens = sample(mx.array(logits), batch).tokens
        batch_tokens.append(int(tokens[mine_row]))
        batch = batch.record(tokens)
    assert batch_tokens == alone_tokens
    assert len(set(alone_tokens)) > 3  # it really sampled


def test_take_concat_record_keep_rows_aligned():
    V = 16
    pa = SamplingParams(presence_penalty=1.0, logprobs=True)
    pb = SamplingParams(repetition_penalty=1.5, top_k=4)
    pc = SamplingParams(temperature=0.0, logit_bias={2: 1.0}, top_logprobs=3)
    state = make_state([pa, pb, pc], V, [[1], [2, 3], [4]], seeds=[10, 11, 12])
    assert state.counts is not None and state.seen is not None and state.bias is not None
    state = state.record(mx.array([5, 6, 7]))
    state = state.record(mx.array([[5, 5], [8, 6], [7, 0]]))  # [B, T]: two tokens per row
    counts, seen = np.array(state.counts), np.array(state.seen)
    assert counts[0, 5] == 3 and counts[1, 6] == 2 and counts[1, 8] == 1 and counts[2, 0] == 1
    assert seen[1, [2, 3, 6, 8]].all() and seen[1].sum() == 4 and seen[0, [1, 5]].all()
    assert np.array(state.steps).tolist() == [3, 3, 3]
    assert state.num_top_logprobs == 3 and state.want_logprobs

    taken = state.take([2, 0])
    assert np.array_equal(np.array(taken.counts), counts[[2, 0]])
    assert taken.seen is None  # no kept row uses the repetition penalty
    assert np.array(taken.seeds).tolist() == [12, 10]
    assert np.allclose(np.array(taken.presence_penalty), [0.0, 1.0])
    assert np.array(taken.bias)[0, 2] == 1.0 and np.array(taken.bias)[1].sum() == 0
    assert not taken.needs_sort and taken.any_greedy and not taken.all_greedy

    plain = make_state([SamplingParams(), SamplingParams(top_p=0.5)], V, seeds=[20, 21])
    assert plain.counts is None and plain.seen is None and plain.bias is None
    assert not plain.want_logprobs and plain.num_top_logprobs == 0
    merged = SamplerState.concat([plain, state])
    assert merged.batch_size == 5 and merged.vocab_size == V
    assert np.array_equal(np.array(merged.counts)[:2], np.zeros((2, V)))
    assert np.array_equal(np.array(merged.counts)[2:], counts)
    assert np.array_equal(np.array(merged.seen)[2:], seen) and not np.array(merged.seen)[:2].any()
    assert np.array(merged.steps).tolist() == [0, 0, 3, 3, 3]
    assert np.array(merged.seeds).tolist() == [20, 21, 10, 11, 12]
    assert np.array(merged.top_k).tolist() == [0, 0, 0, 4, 0]
    assert np.array(merged.top_p_only_rows).tolist() == [1]
    assert np.array(merged.top_k_rows).tolist() == [3] and merged.max_top_k == 4
    assert merged.num_top_logprobs == 3

    # processing the merged batch equals processing each part alone
    logits = np.random.default_rng(6).normal(size=(5, V)).astype(np.float32)
    whole = np.array(process_logits(mx.array(logits), merged))
    parts = np.concatenate(
        [
            np.array(process_logits(mx.array(logits[:2]), plain)),
            np.array(process_logits(mx.array(logits[2:]), state)),
        ]
    )
    assert np.array_equal(whole, parts)
    empty = merged.take([])
    assert empty.batch_size == 0 and empty.counts is None


def test_a_replaced_draw_leaves_the_state_recording_the_new_token_would():
    """`replace_last` (a grammar row's draw redone under its right mask): counts and seen
    tokens become what recording the new token would have made of them, for a row whose old
    token was in its prompt (still seen) and one whose was not; other rows and steps stay."""
    V = 12
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.2, repetition_penalty=1.3)] * 3
    before = make_state(params, V, [[1, 2], [3], [4]], seeds=[1, 2, 3])
    drawn = before.record(mx.array([5, 3, 6]))
    rows, old, new = mx.array([2, 1], mx.int32), mx.array([6, 3], mx.int32), mx.array([9, 7], mx.int32)
    fixed = drawn.replace_last(rows, old, new, before, [2, 1])
    want = before.record(mx.array([5, 7, 9]))
    assert np.array_equal(np.array(fixed.counts), np.array(want.counts))
    assert np.array_equal(np.array(fixed.seen), np.array(want.seen))
    assert np.array(fixed.seen)[1, 3]  # row 1's prompt token stays seen
    assert np.array(fixed.steps).tolist() == np.array(want.steps).tolist() == [1, 1, 1]


def test_logprobs_are_the_raw_model_distribution():
    V = 30
    rng = np.random.default_rng(7)
    logits = (rng.normal(size=(3, V)) * 3).astype(np.float32)
    params = [
        SamplingParams(temperature=0.5, top_k=4, presence_penalty=2.0, logprobs=True),
        SamplingParams(top_logprobs=5, logit_bias={0: 10.0}),
        SamplingParams(),
    ]
    state = make_state(params, V).record(mx.array([1, 2, 3]))
    out = sample(mx.array(logits), state)
    log_softmax = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    tokens = np.array(out.tokens)
    np.testing.assert_allclose(np.array(out.logprobs), log_softmax[np.arange(3), tokens], atol=1e-5)
    assert out.top_ids.shape == (3, 5) and out.top_ids.dtype == mx.int32
    np.testing.assert_array_equal(np.array(out.top_ids), np.argsort(-logits, axis=-1)[:, :5])
    np.testing.assert_allclose(
        np.array(out.top_logprobs), -np.sort(-log_softmax, axis=-1)[:, :5], atol=1e-5
    )
    assert sample(mx.array(logits), make_state([SamplingParams()], V)).logprobs is None


def test_state_built_from_the_contract_fields_alone_derives_its_flags():
    B, V = 2, 10
    ones, zeros = mx.ones((B,)), mx.zeros((B,))
    state = SamplerState(
        temperature=mx.array([0.0, 0.5]),
        top_p=mx.array([1.0, 0.9]),
        top_k=mx.array([0, 0], mx.int32),
        min_p=zeros,
        repetition_penalty=ones,
        presence_penalty=mx.array([0.0, 1.0]),
        frequency_penalty=zeros,
        seeds=mx.array([1, 2], mx.uint32),
        steps=mx.zeros((B,), mx.uint32),
        counts=mx.zeros((B, V), mx.int32),
        seen=None,
        bias=None,
        num_top_logprobs=2,
        want_logprobs=True,
    )
    assert state.vocab_size == V and state.any_greedy and state.needs_temperature
    assert np.array(state.top_p_only_rows).tolist() == [1] and state.top_k_rows is None
    assert np.array(state.row_top_logprobs).tolist() == [2, 2]
    merged = SamplerState.concat([state, make_state([SamplingParams(logit_bias={1: 1.0})], V)])
    assert merged.bias is not None and np.array(merged.bias)[:2].sum() == 0
    assert merged.take([0, 2]).counts is None  # row 1, with the presence penalty, is gone
    out = sample(mx.array(np.zeros((3, V), np.float32)), merged)
    assert out.top_ids.shape == (3, 2)
