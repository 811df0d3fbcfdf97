"""The adaptive controller's parts: the per-position acceptance estimate, the step-cost cells, the
probe rules (a hopeless sample ends a probe, probes stay within the budget and never stop for
good); plus the n-gram index and the CLI -> SpecConfig mapping. Whole-run simulations against
the oracle: tests/test_spec_controller.py."""

from __future__ import annotations

import numpy as np
import pytest

from engine.spec import SpecConfig
from engine.spec.adaptive import (
    ALLOWANCE,
    Acceptance,
    Controller,
    ControllerConfig,
    StepCosts,
)
from engine.spec.ngram import NGramIndex


def test_expected_tokens_multiply_the_positions_acceptance():
    """E(k) = 1 + a1 + a1 a2 + ...: at the prior (0.6 at every position) it is the independent
    drafts' (1 - a^(k+1)) / (1 - a); with no data it stays there."""
    acc = Acceptance(4, 0.6)
    for k in range(5):
        assert acc.expected(np.array(k)) == pytest.approx((1 - 0.6 ** (k + 1)) / 0.4)
    acc.accepted[:] = acc.judged * np.array([0.5, 0.8, 1.0, 0.0])
    assert acc.expected(np.array([0, 1, 2, 3, 4, 9])).tolist() == pytest.approx(
        [1.0, 1.5, 1.9, 2.3, 2.3, 2.3])


def test_acceptance_counts_each_position_judged():
    """A row that drafted 4 and had 2 accepted: positions 1-2 accepted, 3 rejected, 4 not
    judged; a row that drafted 2 and had both accepted: positions 1-2 accepted."""
    acc = Acceptance(4, 0.6)
    prior_acc, prior_judged = acc.accepted.copy(), acc.judged.copy()
    acc.learn(np.array([4, 2]), np.array([2, 2]))
    d = 0.95
    assert (acc.judged - d * prior_judged).tolist() == pytest.approx([2, 2, 1, 0])
    assert (acc.accepted - d * prior_acc).tolist() == pytest.approx([2, 2, 0, 0])
    acc.learn(np.array([0, 0]), np.array([0, 0]))  # no drafts: nothing judged, nothing decays
    assert (acc.judged - d * prior_judged).tolist() == pytest.approx([2, 2, 1, 0])


@pytest.mark.parametrize("probs", [(0.9, 0.5, 0.3, 0.1), (0.5, 0.9, 0.95, 0.95)])
def test_expected_tokens_follow_acceptance_that_depends_on_the_position(probs):
    """Drafts accepted with a probability that falls or rises with the position (a draft
    drifting off, or a hard first token and then a streak): E(k) matches the true yield at
    every k, where independent drafts at the pooled share miss it by over 10 % somewhere."""
    rng = np.random.default_rng(0)
    acc = Acceptance(4, 0.6)
    got, iid = [], []  # the estimates after each round (a ~20-round memory: averaged)
    for i in range(2000):
        a = 0
        while a < 4 and rng.random() < probs[a]:
            a += 1
        acc.learn(np.array([4]), np.array([a]))
        if i >= 100:
            got.append(acc.expected(np.arange(5)))
            p = acc.accepted.sum() / acc.judged.sum()  # one pooled rate over all positions
            iid.append((1 - p ** (np.arange(5) + 1)) / (1 - p))
    true = 1.0 + np.concatenate([[0.0], np.cumsum(np.cumprod(probs))])
    assert np.mean(got, axis=0) == pytest.approx(true, rel=0.1)
    assert np.abs(np.mean(iid, axis=0) / true - 1).max() > 0.1, (np.mean(iid, axis=0), true)


def test_a_few_unlucky_rounds_do_not_decide_the_estimate():
    """Five rounds at 1 of 1 draft accepted then rejected move the first position's estimate
    from its 0.6 prior only part of the way; many more at 0.2 bring it near 0.2 (the prior
    decays with the data)."""
    ctl = Controller(ControllerConfig())
    assert ctl.acceptance.rates[0] == pytest.approx(0.6)
    for i in range(5):
        ctl.learn(np.array([1]), np.array([1 if i == 0 else 0]))
    assert 0.35 < ctl.acceptance.rates[0] < 0.5, ctl.acceptance.rates
    rng = np.random.default_rng(0)
    for _ in range(200):
        ctl.learn(np.array([1]), np.array([int(rng.random() < 0.2)]))
    assert ctl.acceptance.rates[0] < 0.3, ctl.acceptance.rates  # no floor at the prior


def test_caps_are_the_ceiling_within_the_room():
    ctl = Controller(ControllerConfig(max_draft=6))
    assert ctl.caps(np.array([9, 2, 0, -1])).tolist() == [6, 2, 0, 0]


def test_step_costs_interpolate_between_measured_widths_only():
    costs = StepCosts()
    assert costs.estimate(1, 1) is None
    for step, (w, s) in enumerate([(1, 1.0), (1, 1.2), (5, 3.0), (5, 3.0), (2, 9.0)]):
        costs.observe(1, w, s, step)
    assert costs.estimate(1, 1) == pytest.approx(1.1)  # the median
    assert costs.estimate(1, 2) == pytest.approx(1.1 + (3.0 - 1.1) / 4)  # one sample: not used
    assert costs.estimate(1, 4) == pytest.approx(1.1 + 3 * (3.0 - 1.1) / 4)
    assert costs.estimate(1, 6) is None  # beyond the widest measured
    assert costs.estimate(2, 1) is None  # another bucket


def _drive(ctl, cost, alpha_true, steps, seed=0):
    """Drive `ctl` with one row; returns the widths verified per step."""
    rng = np.random.default_rng(seed)
    widths = []
    for _ in range(steps):
        d = ctl.decide(ctl.caps(np.full(1, 1000)))
        k = np.minimum(d.caps, d.width - 1)
        a = np.zeros(1, np.int64)
        if d.width > 1:
            a = np.minimum((rng.random((1, 8)) < alpha_true).cumprod(axis=1).sum(axis=1), k)
            ctl.learn(k, a)
        ctl.record(1, d.width, cost(d.width), True, float((a + 1).mean()))
        widths.append(d.width)
    return widths


def test_a_verify_measured_cheaper_than_plain_decoding_does_not_pay_without_acceptance():
    """Noise can put a verify's cost cell below the plain one's (on a GPU, plain samples that
    waited for the step in flight); a verify is taken to cost at least a plain step, so drafts
    that are never accepted are not verified beyond probes."""
    ctl = Controller(ControllerConfig(max_draft=4))
    widths = _drive(ctl, lambda w: 0.008 if w > 1 else 0.010, 0.0, 400)
    late = widths[200:]
    assert sum(w > 1 for w in late) <= 0.1 * len(late), widths


def test_one_hopeless_sample_ends_a_probe():
    """Launch-bound costs (width W at W plain steps): the first probe at width 2 stops after
    its first measured sample (2 speculative steps: the switch, then one measured)."""
    ctl = Controller(ControllerConfig(max_draft=4))
    widths = _drive(ctl, lambda w: 0.01 * w * 1.01 if w > 1 else 0.01, 0.6, 12)
    assert widths[:3] == [1, 1, 1]  # plain decoding is measured first
    assert widths[3:5] == [2, 2] and widths[5:] == [1] * 7, widths


def test_a_priced_probe_ends_where_it_cannot_pay_its_expected_yield():
    """Every width above 1 costs 3 plain steps (a compute-bound verify at the widest width):
    unpriced, a probe at width 5 runs its samples (3 is below the 5 tokens the round could
    yield); priced, one sample ends it (3 is above the ~2.3 tokens a round of 4 drafts is
    expected to yield at acceptance 0.6), since its speculative steps would be priced rounds."""

    def widths(priced: bool) -> list[int]:
        ctl = Controller(ControllerConfig(max_draft=4))
        rng = np.random.default_rng(0)
        out = []
        for _ in range(60):
            d = ctl.decide(ctl.caps(np.full(1, 1000)), priced=priced)
            if d.width > 1:
                k = np.minimum(d.caps, d.width - 1)
                a = np.minimum((rng.random((1, 8)) < 0.6).cumprod(axis=1).sum(axis=1), k)
                ctl.learn(k, a)
            ctl.record(1, d.width, 0.03 if d.width > 1 else 0.01, True)
            out.append(d.width)
        return out

    unpriced, priced = widths(False), widths(True)
    assert unpriced.count(5) >= 3, unpriced
    assert 1 <= priced.count(5) <= 2, priced


def test_a_probe_stops_at_the_budget_once_it_has_a_sample():
    """A width-17 verify at 15 plain steps is not hopeless for an unpriced drafter (17 tokens
    could come), but its first measured sample spends more than the start allowance: the probe
    (from speculating at a narrow width, so its first step is measured) stops after that
    sample instead of taking three."""
    ctl = Controller(ControllerConfig(max_draft=16))
    widths = _drive(ctl, lambda w: 0.15 if w == 17 else 0.01 * (1 + 0.05 * (w - 1)), 0.3, 120)
    assert widths.count(17) == 1, widths
    cell = ctl.costs.cells[(1, 17)]
    assert cell.count == 1 and cell.samples[-1] == pytest.approx(0.15)


def test_a_probe_the_budget_cannot_cover_is_not_started():
    """Sixteen rows of tinycoder-16m on this CPU with its draft model (a plain step 17 ms, a
    verify 17 + 18 (W - 1) ms: compute-bound): once width 2 is measured, a width-17 sample is
    predicted at ~16 plain steps, beyond what the budget holds in a short run, so the widest
    probe never starts (one such sample cost ~5 % of an 8-s run). Where the verify is cheap
    (memory-bound) the same probe runs at once."""

    def drive(cost_of, steps):
        ctl = Controller(ControllerConfig(max_draft=16))
        rng = np.random.default_rng(0)
        widths = []
        for _ in range(steps):
            d = ctl.decide(ctl.caps(np.full(16, 1000)), priced=True)
            a = np.zeros(16, np.int64)
            if d.width > 1:
                k = np.minimum(d.caps, d.width - 1)
                a = np.minimum((rng.random((16, 16)) < 0.65).cumprod(axis=1).sum(axis=1), k)
                ctl.learn(k, a)
            ctl.record(16, d.width, cost_of(d.width), True, float((a + 1).mean()))
            widths.append(d.width)
        return ctl, widths

    ctl, widths = drive(lambda w: 0.017 + 0.018 * (w - 1), 470)  # ~8 s of steps
    assert 2 in widths and 17 not in widths, widths
    # within the budget, bar the last sample of a probe under way (rule 5)
    last = 0.018 * (max(widths) - 1)
    assert ctl.explore_excess <= ctl.config.budget * ctl.busy + ALLOWANCE * 0.017 + last
    _, cheap = drive(lambda w: 0.017 * (1 + 0.05 * (w - 1)), 60)
    assert 17 in cheap, cheap


def test_probes_stay_within_the_budget_and_never_stop_for_good():
    """Launch-bound costs over a long run: what probes cost beyond plain decoding stays within
    the budget (plus the start allowance), and probes still come in the last stretch."""
    ctl = Controller(ControllerConfig(max_draft=4))
    widths = _drive(ctl, lambda w: 0.01 * w * 1.01 if w > 1 else 0.01, 0.6, 6000)
    assert ctl.explore_excess <= ctl.config.budget * ctl.busy + ALLOWANCE * 0.01
    assert any(w > 1 for w in widths[-1500:])
    assert sum(w > 1 for w in widths) < 0.02 * len(widths)


def test_drafter_work_inside_a_step_counts_once():
    """A draft model's catch-up runs inside the verify step that needed it (and its prefill at
    admission inside a step's scheduling): the step's seconds already hold it. It goes into the
    drafter overhead the width choice adds to verify costs, but into busy time and a probe's
    excess only once, as part of the step."""
    ctl = Controller(ControllerConfig(max_draft=4))
    widths = _drive(ctl, lambda w: 0.01, 0.6, 3)  # plain decoding measured first
    assert widths == [1, 1, 1]
    d = ctl.decide(ctl.caps(np.full(1, 1000)))
    assert d.width > 1 and d.probe  # the first probe
    busy, excess = ctl.busy, ctl.explore_excess
    catch_up, verify = 0.004, 0.012
    ctl.record(1, d.width, verify + catch_up, False, 1.5, catch_up)
    assert ctl.busy - busy == pytest.approx(verify + catch_up)
    assert ctl.explore_excess - excess == pytest.approx(verify + catch_up - 1.5 * 0.01)
    assert ctl.overhead == pytest.approx(0.1 * catch_up)


def test_gaps_double_up_to_the_bound():
    """While plain decoding stands (probes cheap enough for the budget), probes come at gaps
    doubling from min_gap to max_gap."""
    ctl = Controller(ControllerConfig(max_draft=1, budget=1.0))
    widths = _drive(ctl, lambda w: 0.01 * (1 + 0.5 * (w - 1)), 0.05, 1500)
    starts = [i for i in range(1, len(widths)) if widths[i] > 1 and widths[i - 1] == 1]
    gaps = np.diff(starts).tolist()
    assert gaps[:4] == [16, 32, 64, 128], gaps
    assert all(g == 256 for g in gaps[4:]), gaps


def test_a_priced_speculative_step_offers_the_widest_width_with_prices():
    """Rule 6: for a drafter that prices its drafts, a speculative step offers the widest width
    the rows fill, and says what each draft beyond the first must be worth: the expected rate
    of the best fixed width times what one more column costs (10 ms). Probes verify their full
    width unpriced, and an unpriced drafter gets no prices."""
    ctl = Controller(ControllerConfig(max_draft=4))

    def cost(w: int) -> float:
        return 0.1 + 0.01 * (w - 1)

    decisions = []
    for _ in range(80):
        d = ctl.decide(ctl.caps(np.full(1, 1000)), priced=True)
        if d.width > 1:
            k = np.minimum(d.caps, d.width - 1)
            ctl.learn(k, k)  # every draft accepted
        ctl.record(1, d.width, cost(d.width), True, float(d.width))
        decisions.append(d)
    chosen = [d for d in decisions[40:] if d.width > 1 and not d.probe]
    assert chosen, [(d.width, d.probe) for d in decisions]
    rate = float(ctl.acceptance.expected(np.array(4))) / cost(5)  # the best fixed width: 5
    for d in chosen:
        assert d.width == 5 and d.min_gain is not None
        want = [0.0, rate * 0.01, rate * 0.01, rate * 0.01]
        assert d.min_gain.tolist() == pytest.approx(want, rel=0.05)
    assert all(d.min_gain is None for d in decisions if d.probe)
    unpriced = ctl.decide(ctl.caps(np.full(1, 1000)))
    assert unpriced.width > 1 and unpriced.min_gain is None


def test_prices_beyond_the_widest_measured_width_follow_its_slope():
    """Widths 1, 2 and 4 measured (0.10, 0.12, 0.16 s): width 3 is interpolated, widths 5 and 6
    continue the slope from 2 to 4 (0.02 s a column), so every column from 3 on costs 0.02 s;
    with only one width measured nothing is priced."""
    ctl = Controller(ControllerConfig(max_draft=8))
    for step, (w, s) in enumerate([(1, 0.1), (1, 0.1), (2, 0.12), (2, 0.12), (4, 0.16), (4, 0.16)]):
        ctl.costs.observe(1, w, s, step)
    assert ctl._min_gain(1, 6, rate=10.0).tolist() == pytest.approx([0, 0.2, 0.2, 0.2, 0.2])
    lone = Controller(ControllerConfig(max_draft=8))
    lone.costs.observe(1, 1, 0.1, 0)
    lone.costs.observe(1, 1, 0.1, 1)
    assert lone._min_gain(1, 6, rate=10.0).tolist() == [0.0] * 5


def test_not_adaptive_verifies_the_widest_width():
    ctl = Controller(ControllerConfig(max_draft=4, adaptive=False))
    d = ctl.decide(np.array([4, 2]))
    assert d.width == 5 and d.caps.tolist() == [4, 2]


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


def test_ngram_index_extended_in_any_pieces_is_the_brute_force_index():
    """Whether a prompt is indexed whole (one pass per n) or a step's few tokens at a time,
    every n-gram maps to the last position where it ends."""
    rng = np.random.default_rng(3)
    for _ in range(200):
        lo = int(rng.integers(1, 4))
        hi = int(rng.integers(lo, 6))
        tokens = rng.integers(0, 5, int(rng.integers(0, 70))).tolist()
        want = {tuple(tokens[e - n + 1 : e + 1]): e
                for e in range(len(tokens)) for n in range(lo, min(hi, e + 1) + 1)}
        idx, upto = NGramIndex(lo, hi), 0
        while upto < len(tokens):
            upto = min(len(tokens), upto + int(rng.integers(0, 25)))
            idx.extend(tokens, upto)
            idx.extend(tokens, upto - 1)  # behind what is indexed: nothing
        assert idx.ends == want and idx.num_indexed == len(tokens)


def test_a_prediction_is_followed_from_its_start_and_rejoined_after_an_edit():
    """While the output is the prediction's beginning its next tokens are proposed (from the
    first output token on); after the output parts from it, the continuation of the longest
    context suffix found in the prediction."""
    from engine.spec.ngram import Prediction

    prompt = [1, 2, 3]
    pred = Prediction([10, 11, 12, 13, 14, 15, 16, 17], len(prompt), 2, 3)
    assert pred.lookup(prompt + [10], 3) == [11, 12, 13]
    assert pred.lookup(prompt + [10, 11, 12], 2) == [13, 14]
    out = [10, 11, 12, 99, 98]  # an edit: the prediction has nothing after (99 98)
    assert pred.lookup(prompt + out, 3) == [] and not pred.aligned
    out += [14, 15]  # rejoined: (14 15) occurs in the prediction
    assert pred.lookup(prompt + out, 3) == [16, 17]
    assert pred.lookup(prompt + out + [16, 17], 3) == []  # its end


def test_cli_flags_map_to_spec_config():
    from mlxd.runtime import _spec_config

    assert _spec_config({}).method == "prediction"  # the requests' predicted outputs only
    assert _spec_config({"spec": "none", "draft_model": None}) is None
    cfg = _spec_config({"draft_model": "/m/draft", "num_draft_tokens": 3})
    assert (cfg.method, cfg.draft_model, cfg.num_draft_tokens) == ("draft", "/m/draft", 3)
    assert _spec_config({"spec": "ngram"}).method == "ngram"
    with pytest.raises(ValueError, match="--draft-model"):
        SpecConfig(method="draft")
    with pytest.raises(ValueError, match="from 1 to 32"):
        SpecConfig(method="ngram", num_draft_tokens=0)


def test_a_lookup_that_found_nothing_is_asked_again_at_the_next_step():
    """Decoding plainly, a choice made on costs is held for `PLAIN_HOLD` steps, but when the
    n-gram lookup found nothing it looks again at the very next step: a copied stretch can
    start at any token."""
    from types import SimpleNamespace

    from engine.spec import build_speculation
    from engine.spec.decoder import SpecRows

    spec = build_speculation(SpecConfig(method="ngram"), None, vocab_size=100)
    prompt = [10, 11, 12, 13, 14, 15, 16, 17]
    request = SimpleNamespace(prompt_ids=prompt)
    row = SimpleNamespace(request=request, output_ids=[50, 51], constraint=None,
                          max_new_tokens=64, num_generated=2, num_prompt_tokens=len(prompt))
    batch = SimpleNamespace(rows=[row], next_tokens=None, sampler=None,
                            spec=SpecRows(1, spec.drafter.admit([prompt], False)))
    asked = []
    real = spec.drafter.available
    spec.drafter.available = lambda ctx: asked.append(1) or real(ctx)
    assert spec.decide(batch) == 1 and len(asked) == 1  # "50 51" occurred nowhere before
    row.output_ids = [50, 51, 11, 12]  # "11 12" continues as "13 14 ..." in the prompt
    row.num_generated = 4
    spec.decide(batch)
    assert len(asked) == 2  # asked again at once, not after a hold
    assert real(spec._context(batch, np.array([4])))[0] == 4


def test_the_prediction_drafter_drafts_only_from_predictions_and_idles_without_them():
    """The default drafter (predictions only): while no row has a predicted output it is not
    asked at all (no lookup, no synchronous step); a row with one gets the prediction's next
    tokens, a row without none, even where its prompt would offer a copy."""
    from types import SimpleNamespace

    from engine.spec import build_speculation
    from engine.spec.decoder import SpecRows

    spec = build_speculation(SpecConfig(method="prediction"), None, vocab_size=100)
    assert spec.optional and not build_speculation(SpecConfig(method="ngram"), None, vocab_size=100).optional
    prompt = [10, 11, 12, 13, 14, 15, 16, 17]

    def batch_of(predictions):
        rows = [SimpleNamespace(request=SimpleNamespace(prompt_ids=prompt), output_ids=[11, 12],
                                constraint=None, max_new_tokens=64, num_generated=2,
                                num_prompt_tokens=len(prompt)) for _ in predictions]
        state = spec.drafter.admit([prompt] * len(rows), False, predictions)
        return SimpleNamespace(rows=rows, next_tokens=None, sampler=None, spec=SpecRows(len(rows), state))

    asked = []
    real = spec.drafter.available
    spec.drafter.available = lambda ctx: asked.append(1) or real(ctx)
    plain = batch_of([None, None])
    for _ in range(3):
        assert spec.decide(plain) == 1 and not spec.sync_plain
    assert asked == []
    mixed = batch_of([None, [11, 12, 40, 41, 42, 43]])
    spec.decide(mixed)
    assert asked  # a row with a prediction: the lookup runs
    assert list(real(spec._context(mixed, np.array([4, 4])))) == [0, 4]  # 40 41 42 43 for row 1 only


def test_row_contexts_are_extended_in_place_and_follow_the_rows():
    """The drafters' contexts (prompt + output) are kept per row by the batch's spec state and
    extended by the tokens emitted since the last step, not rebuilt; they follow rows that
    leave (`take`) and join (`concat`)."""
    from types import SimpleNamespace

    from engine.spec import build_speculation
    from engine.spec.decoder import SpecRows

    spec = build_speculation(SpecConfig(method="ngram"), None, vocab_size=100)

    def row(prompt):
        return SimpleNamespace(request=SimpleNamespace(prompt_ids=prompt), output_ids=[])

    rows = [row([1, 2, 3]), row([4, 5])]
    state = SpecRows(2, spec.drafter.admit([r.request.prompt_ids for r in rows], False))
    batch = SimpleNamespace(rows=rows, next_tokens=None, sampler=None, spec=state)

    def contexts():
        return spec._context(batch, np.zeros(len(batch.rows), np.int64)).contexts

    first = contexts()
    assert first == [[1, 2, 3], [4, 5]]
    rows[0].output_ids += [7, 8]
    rows[1].output_ids += [9]
    again = contexts()
    assert again == [[1, 2, 3, 7, 8], [4, 5, 9]]
    assert all(a is b for a, b in zip(first, again, strict=True))  # extended, not rebuilt
    state.take([1])
    batch.rows = [rows[1]]
    new = row([6])
    new.output_ids = [2]
    state.concat(SpecRows(1, spec.drafter.admit([[6]], False)))
    batch.rows = [rows[1], new]
    rows[1].output_ids += [3]
    assert contexts() == [[4, 5, 9, 3], [6, 2]]
