"""The adaptive controller on simulated step costs: it speculates where verification is cheap,
stops where it is not (never below 0.95x plain), shrinks drafts for rows with low acceptance
and as the batch grows; plus the n-gram index and the CLI -> SpecConfig mapping."""

from __future__ import annotations

import numpy as np
import pytest

from engine.spec import SpecConfig
from engine.spec.adaptive import Controller, ControllerConfig, expected_tokens
from engine.spec.ngram import NGramIndex


def _simulate(cost, alphas: np.ndarray, steps: int = 3000, K: int = 4, seed: int = 0):
    """Drive the controller like the engine does; returns (spec tokens/s) / (plain tokens/s)
    and the fraction of steps that speculated. `cost(B, W)` gives seconds per step."""
    rng = np.random.default_rng(seed)
    ctl = Controller(ControllerConfig(max_draft=K))
    B = len(alphas)
    acc, judged = np.zeros(B), np.zeros(B)
    tokens, seconds, spec_steps = 0, 0.0, 0
    for _ in range(steps):
        alpha = ctl.alpha(acc, judged)
        caps = ctl.caps(alpha, np.full(B, 1000))
        width = ctl.decide(alpha, caps).width
        k = np.minimum(caps, width - 1)
        # each draft accepted with the row's true probability, until the first rejection
        run = (rng.random((B, max(K, 1))) < alphas[:, None]).cumprod(axis=1).sum(axis=1)
        a = np.minimum(run, k)
        if width > 1:
            spec_steps += 1
            acc = 0.9 * acc + a
            judged = 0.9 * judged + a + (a < k)
            ctl.learn(k, a)
        else:
            a[:] = 0
        noisy = cost(B, width) * rng.uniform(0.8, 1.25)  # a shared machine's jitter
        ctl.record(B, width, noisy, typical=True)
        tokens += int((a + 1).sum())
        seconds += cost(B, width)
    plain_rate = B / cost(B, 1)
    return tokens / seconds / plain_rate, spec_steps / steps


def test_stops_speculating_when_verification_costs_a_step_per_token():
    """Reference-BLAS CPU: W columns cost W plain steps; speculation cannot pay."""
    ratio, frac = _simulate(lambda B, W: 0.010 * W, np.full(4, 0.6))
    assert ratio >= 0.97, ratio
    assert frac < 0.05, frac


def test_speculates_when_verification_is_nearly_free():
    """Memory-bound decoding (GPU, Apple silicon): wider verification costs a few percent."""
    ratio, frac = _simulate(lambda B, W: 0.010 * (1 + 0.04 * (W - 1)), np.full(2, 0.7))
    best = expected_tokens(np.array([0.7]), np.array([4]))[0] / 1.16
    assert frac > 0.9, frac
    assert ratio > 0.9 * best and ratio > 1.8, ratio


@pytest.mark.parametrize(("batch", "should_speculate"), [(1, True), (16, False)])
def test_large_batches_turn_speculation_off(batch, should_speculate):
    """Per-row cost grows with the batch (compute-bound at 16 rows)."""

    def cost(B, W):
        return 0.010 * (1 + (0.05 if B <= 2 else 0.9) * (W - 1))

    ratio, frac = _simulate(cost, np.full(batch, 0.6), steps=1500)
    assert ratio >= 0.95, ratio
    assert (frac > 0.8) if should_speculate else (frac < 0.06), frac


def test_caps_shrink_with_acceptance_and_room():
    ctl = Controller(ControllerConfig(max_draft=6))
    caps = ctl.caps(np.array([0.05, 0.3, 0.6, 0.9, 0.9]), np.array([9, 9, 9, 9, 2]))
    assert caps.tolist() == [0, 1, 3, 6, 2]
    assert np.all(np.diff(caps[:4]) >= 0)


def test_row_alpha_follows_its_own_history():
    ctl = Controller(ControllerConfig(max_draft=4, prior_alpha=0.5))
    alpha = ctl.alpha(np.array([0.0, 12.0, 0.0]), np.array([12.0, 12.0, 0.0]))
    assert alpha[0] < 0.1 < 0.9 < alpha[1]
    assert alpha[2] == pytest.approx(0.5)  # no history: the pooled prior


def test_ngram_index_proposes_the_continuation_of_the_latest_longest_match():
    idx = NGramIndex(min_n=2, max_n=3)
    ctx = [5, 6, 7, 8, 9, 1, 6, 7, 2, 5, 6, 7]
    # suffix (5 6 7) occurs at 0..2 -> continue with 8 9 1; (6 7) alone would say 2 5 6
    assert idx.lookup(ctx, 3) == [8, 9, 1]
    ctx += [4]  # (7 4) and (6 7 4) never occurred: nothing to propose
    assert idx.lookup(ctx, 3) == []
    ctx += [6, 7]  # (4 6 7) never, (6 7) latest at 10..11 -> continue with 4 6 7
    assert idx.lookup(ctx, 5) == [4, 6, 7]
    assert idx.num_indexed == len(ctx) - 1  # indexed incrementally, never the live suffix


def test_cli_flags_map_to_spec_config():
    from mlxd.runtime import _spec_config

    assert _spec_config({}) is None
    assert _spec_config({"spec": "none", "draft_model": None}) is None
    cfg = _spec_config({"draft_model": "/m/draft", "num_draft_tokens": 3})
    assert (cfg.method, cfg.draft_model, cfg.num_draft_tokens) == ("draft", "/m/draft", 3)
    assert _spec_config({"spec": "ngram"}).method == "ngram"
    with pytest.raises(ValueError, match="--draft-model"):
        SpecConfig(method="draft")
    with pytest.raises(ValueError, match="at least 1"):
        SpecConfig(method="ngram", num_draft_tokens=0)


def _simulate_engine(ctl, cost, alphas, steps, spikes=(), seed=0):
    """Like `_simulate` on a given controller; the first speculative steps cost `spikes`
    seconds (CUDA: an engine's first speculative steps set up new shapes). Returns
    (spec tokens/s) / (plain tokens/s) and the number of speculative steps."""
    rng = np.random.default_rng(seed)
    B = len(alphas)
    acc, judged = np.zeros(B), np.zeros(B)
    tokens, seconds, spec_steps = 0, 0.0, 0
    for _ in range(steps):
        alpha = ctl.alpha(acc, judged)
        caps = ctl.caps(alpha, np.full(B, 1000))
        width = ctl.decide(alpha, caps).width
        k = np.minimum(caps, width - 1)
        run = (rng.random((B, 8)) < alphas[:, None]).cumprod(axis=1).sum(axis=1)
        a = np.minimum(run, k) if width > 1 else np.zeros(B, np.int64)
        step = cost(B, width) * rng.uniform(0.95, 1.05)
        if width > 1:
            step = spikes[spec_steps] if spec_steps < len(spikes) else step
            spec_steps += 1
            acc, judged = 0.9 * acc + a, 0.9 * judged + a + (a < k)
            ctl.learn(k, a)
        ctl.record(B, width, step, typical=True, emitted=float((a + 1).mean()))
        tokens += int((a + 1).sum())
        seconds += step
    return tokens / seconds / (B / cost(B, 1)), spec_steps


def _gpu_draft_cost(B, W):
    """H200, tinycoder-16m + draft-4m at one row: a plain step 1.5 ms, a round 4-6 ms."""
    return 0.0015 if W == 1 else 0.0045 + 0.0005 * W


def test_one_hopeless_sample_ends_an_exploration():
    """A measured round that could not pay even if every draft were accepted stops the
    exploration at once (1 unmeasured + 1 measured step), not after `min_samples`."""
    ctl = Controller(ControllerConfig(max_draft=4, explore_budget=1.0))
    _, spec_steps = _simulate_engine(ctl, _gpu_draft_cost, np.full(1, 0.7), steps=60)
    assert spec_steps == 2, spec_steps  # then plain until the next probe (64 steps later)


def test_dear_first_speculative_steps_stay_within_the_exploration_budget():
    """H200 pattern: each engine's first speculative steps cost 40-120 ms (vs a 1.5 ms plain
    step). The first engine of a process pays one exploration (ended by the hopeless rule);
    the next engines on the same model remember its cost and explore only when the budget
    (3 % of the decoded time) covers it: short workloads stay at ~1x plain."""
    from engine.spec.adaptive import EXPLORE_MEMORY

    key = ("test-drafter", object())
    spikes = (0.12, 0.056, 0.047)
    ratios = []
    for engine_no in range(3):
        ctl = Controller(ControllerConfig(max_draft=4), memory_key=key)
        ratio, _ = _simulate_engine(ctl, _gpu_draft_cost, np.full(1, 0.7), 1500, spikes, engine_no)
        ratios.append(ratio)
        assert ctl.explore_excess <= 0.18, ctl.explore_excess
    assert EXPLORE_MEMORY.first_cost(key) is not None
    assert min(ratios[1:]) >= 0.97, ratios  # 2.3 s workloads: no exploration fits the budget


def test_exploration_budget_still_finds_speculation_that_pays():
    """Dear first steps, but verification nearly free afterwards (memory-bound): a long run
    still explores (after the budget covers it), re-probes past the dear steps and speculates."""
    key = ("test-drafter-2", object())

    def cost(B, W):
        return 0.0015 * (1 + 0.04 * (W - 1))

    spikes = (0.12, 0.056, 0.047)
    for engine_no in range(2):
        ctl = Controller(ControllerConfig(max_draft=4), memory_key=key)
        ratio, spec_steps = _simulate_engine(ctl, cost, np.full(1, 0.7), 30000, spikes, engine_no)
    assert ratio > 1.5 and spec_steps > 15000, (ratio, spec_steps)
    assert ctl.explore_excess <= ctl.config.explore_budget * ctl.busy + 0.25


def test_exploration_budget_lets_paying_speculation_in_early():
    """Reference-BLAS CPU, edit workload (n-gram): W = 2 costs 1.3x a plain step and drafts are
    mostly accepted. A fresh engine explores after a few dozen steps and, since paying rounds
    cost the budget nothing, climbs to wider rounds within a short workload."""
    ctl = Controller(ControllerConfig(max_draft=4), memory_key=("test-drafter-3", object()))

    def cost(B, W):
        return 0.020 * (1 + 0.3 * (W - 1))

    ratio, spec_steps = _simulate_engine(ctl, cost, np.full(1, 0.85), steps=250)
    assert spec_steps > 150 and ratio > 1.3, (ratio, spec_steps)
    assert ctl.explore_excess < 0.1, ctl.explore_excess


def _simulate_lookup(cost, alpha_true: float, steps: int, B: int = 1, jump: bool = True,
                     offer_len: int = 8, seed: int = 0):
    """An n-gram-like drafter (offers `offer_len` drafts a row, free to make) under the
    controller as the decoder drives it (offers passed, a jump's caps used for the step).
    Returns (spec tokens/s) / (plain tokens/s), the speculative steps and the controller."""
    rng = np.random.default_rng(seed)
    ctl = Controller(ControllerConfig(max_draft=8, jump=jump), lookup_evidence=True)
    acc, judged = np.zeros(B), np.zeros(B)
    tokens, seconds, spec_steps = 0, 0.0, 0
    for _ in range(steps):
        alpha = ctl.alpha(acc, judged)
        caps = ctl.caps(alpha, np.full(B, 1000))
        offer = np.where(caps > 0, offer_len, 0)
        caps = np.minimum(caps, offer)
        d = ctl.decide(alpha, caps, offer)
        width = d.width
        k = np.minimum(d.caps if d.jump else caps, width - 1)
        run = (rng.random((B, 8)) < alpha_true).cumprod(axis=1).sum(axis=1)
        a = np.minimum(run, k) if width > 1 else np.zeros(B, np.int64)
        step = cost(B, int(k.max()) + 1 if width > 1 else 1) * rng.uniform(0.95, 1.05)
        if width > 1:
            spec_steps += 1
            acc, judged = 0.9 * acc + a, 0.9 * judged + a + (a < k)
            ctl.learn(k, a)
        ctl.record(B, int(k.max()) + 1 if width > 1 else 1, step, typical=True,
                   emitted=float((a + 1).mean()))
        tokens += int((a + 1).sum())
        seconds += step
    return tokens / seconds / (B / cost(B, 1)), spec_steps, ctl


def _flat_gpu_cost(B, W):
    """MLX-CUDA pattern (H200): any verify width costs about two plain steps."""
    return 0.0015 if W == 1 else 0.0030 * (1 + 0.01 * (W - 2))


def test_flat_cost_jump_finds_wide_lookup_rounds_that_pay():
    """On flat verify costs W = 2 never pays (1.8 tokens for 2 plain steps at alpha 0.8), so
    the one-width climb stops there (1.0x); the jump tries the widest offered width (4.2
    tokens for about the same cost) and keeps it: about 2x. (At alpha 0.7 the simulated gain
    is 1.0-1.16x: the margins and the noisy per-row acceptance keep it cautious.)"""
    without, spec0, _ = _simulate_lookup(_flat_gpu_cost, 0.8, 3000, jump=False)
    ratio, spec_steps, ctl = _simulate_lookup(_flat_gpu_cost, 0.8, 3000)
    assert without < 1.05 and spec0 < 150, (without, spec0)
    assert ratio > 1.7 and spec_steps > 2500, (ratio, spec_steps)
    assert ctl.costs.measured(1, 9) is not None and not ctl._flat_refuted
    assert ctl.jumps > 2000


def test_flat_cost_jump_stays_plain_where_even_wide_rounds_do_not_pay():
    """alpha 0.45: 1.8 tokens for 2 plain steps at any width: the jump's samples say no."""
    ratio, spec_steps, _ = _simulate_lookup(_flat_gpu_cost, 0.45, 3000)
    assert ratio >= 0.97 and spec_steps < 150, (ratio, spec_steps)


def test_flat_cost_jump_costs_one_sample_where_wide_verifies_are_dear():
    """Reference-BLAS CPU (W columns cost W plain steps): the jump's first two samples refute
    the flat premise for the bucket and no further jump is tried: still ~1x plain."""
    cpu = lambda B, W: 0.010 * W  # noqa: E731
    ratio, spec_steps, ctl = _simulate_lookup(cpu, 0.6, 3000, jump=True)
    assert ratio >= 0.97, ratio
    assert 1 in ctl._flat_refuted
    assert ctl.costs.cells[(1, 9)].count == 2  # two jump samples, then never again
    base, base_steps, _ = _simulate_lookup(cpu, 0.6, 3000, jump=False)
    assert spec_steps <= base_steps + 2, (spec_steps, base_steps)


def test_flat_cost_jump_survives_one_dear_sample():
    """On the GPU one wide step can stall (a first use, another process): one dear sample does
    not refute the premise; the next jump samples again, and flat costs win as before."""
    stalled = []

    def cost(B, W):
        if W == 9 and not stalled:
            stalled.append(W)
            return 0.030  # 20x a plain step, once
        return _flat_gpu_cost(B, W)

    ratio, spec_steps, ctl = _simulate_lookup(cost, 0.8, 3000)
    assert not ctl._flat_refuted and ratio > 1.7, (ratio, spec_steps)


def test_flat_cost_jump_is_for_lookup_drafters_only():
    """A draft model's chain grows with the width, so the flat premise is never made for it."""
    ctl = Controller(ControllerConfig(max_draft=8))
    assert not ctl.lookup_evidence
    alpha = np.full(1, 0.6)
    for _ in range(40):
        caps = ctl.caps(alpha, np.full(1, 1000))
        d = ctl.decide(alpha, caps, np.full(1, 8))
        assert not d.jump
        ctl.record(1, d.width, _flat_gpu_cost(1, d.width), typical=True)
