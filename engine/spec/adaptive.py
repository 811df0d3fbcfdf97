"""How wide to verify, chosen online from measured step costs and a running acceptance estimate.

The rule (docs/speculative.md, "The controller"):

1. Acceptance. Per draft position j (1 = the first draft of a round): the share of drafts
   accepted among those judged there (every earlier draft of their round accepted), pooled over
   rows, counts decayed by `DECAY` a round, starting from `PRIOR` drafts at the drafter's prior
   (which decay too). `k` drafts yield `E(k) = 1 + sum_{j<=k} a_1 * ... * a_j` tokens. Per
   position, because a draft's chance depends on its place in the round (streaks raise the
   later positions, a drifting draft lowers them), which decides how wide to verify.
2. Cost. The step time per (batch-size bucket, width), the median of its last `WINDOW`
   samples; widths between two measured ones are interpolated linearly, wider ones are unknown.
   A verify is never taken to cost less than a plain step (its cells' noise could otherwise
   make speculation look free). Steps with a prefill, or after which rows left the batch, are
   not samples (their once-off work is no width's cost).
3. Choice. The width with the most expected tokens per second, `sum_b E(min(W - 1, caps_b)) /
   (cost(W) + drafter overhead + switching)`; speculation starts when it beats plain decoding
   by `MARGIN` and stops when it no longer beats it (`HOLD`): noise in the estimates does not
   flip it. `switching` is what the first steps after switches between plain and speculative
   decoding that the drafter's offers caused cost beyond their mode's typical step, per
   speculative step (no cost cell holds it; lookups that come and go make a switch of every
   round); it decays while decoding plainly, so speculation is tried again.
4. Probes. Every `gap` steps a probe measures `PROBE_STEPS - 1` steps at the least recently
   measured of widths 1, 2 and the widest the rows fill (never the current choice, nor width 1
   while speculating is expected to beat plain decoding by `CLEAR`); the gap doubles
   from `min_gap` to `max_gap` while the choice stands and restarts when it changes. Once a
   width W pays, width 2W + 1 (within the widest) is probed at once if it was never measured:
   a short answer finds a wide width that pays in a few rounds. A probe sample that costs more
   than `W` plain steps cannot pay and ends the probe (for a priced drafter, rule 6, more than
   the `E(W - 1)` tokens a round is expected to yield: its rounds would be priced anyway).
5. Budget. Probes at widths above 1 may cost at most `budget` of the engine's busy time (plus
   `ALLOWANCE` one-row tokens at the bucket's plain cost per row, at the start) beyond what
   plain decoding of their tokens would take. A probe starts only where one sample's predicted
   excess fits what is left (else the climb toward its width, else none); one under way stops
   at the budget once it has a measured sample.
6. Prices. A drafter that can tell its drafts' chances (a draft model on greedy rows) gets the
   widest width the rows fill, with a price per draft past the first: the choice's expected
   rate times what one more column costs (costs past the widest measured width continue its
   slope). It stops the round where its rows' summed chances of every draft so far accepted
   fall below the next price, so confident stretches run deep and unsure rounds stay short;
   probes stay unpriced at their width, and the climb of rule 4 is left to unpriced drafters.

Worked example: one row, plain 231 ms, width 2 measured at 285 ms, the first draft accepted
at 0.55: 1.55 tokens / 285 ms = 5.4 tok/s against 4.3 plain: speculate at width 2. At
launch-bound costs (width 2 at 462 ms) 1.55 / 462 ms = 3.4 tok/s: plain, with a probe at a
growing gap, within the budget.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

PRIOR = 8.0  # drafts' worth of prior acceptance (a few unlucky rounds do not decide)
DECAY = 0.95  # the counts' decay per round (~20 rounds of memory)
MARGIN = 1.1  # speculation starts when it beats plain by 10 % (estimates are noisy) ...
HOLD = 1.001  # ... and stops when it no longer beats plain decoding (a tie is plain)
CLEAR = 1.5  # speculation expected to beat plain by this much: width 1 is not probed
PROBE_STEPS = 4  # a probe's measured samples + 1 (a step after a mode switch is not measured)
SWITCH_DECAY = 0.995  # the switching cost's decay per plain step (speculation is retried)
WINDOW = 8  # samples per cost cell
MIN_SAMPLES = 2  # samples before a cell is used
ALLOWANCE = 8.0  # one-row tokens of probing excess allowed before any busy time has accrued


class Acceptance:
    """Per draft position, accepted / judged drafts pooled over rows (rule 1 above)."""

    def __init__(self, max_draft: int, prior: float) -> None:
        self.accepted = np.full(max(max_draft, 1), PRIOR * prior)
        self.judged = np.full(max(max_draft, 1), PRIOR)

    def learn(self, num_drafts: np.ndarray, num_accepted: np.ndarray) -> None:
        """Row b drafted `num_drafts[b]` tokens and `num_accepted[b]` of them were accepted:
        positions 1..a_b were accepted, position a_b + 1 (if drafted) rejected, the rest not
        judged."""
        pos = np.arange(len(self.judged))[None, :]
        acc = np.asarray(num_accepted).reshape(-1, 1)
        judged = (pos < np.minimum(acc + 1, np.asarray(num_drafts).reshape(-1, 1))).sum(axis=0)
        if judged.any():
            self.accepted = DECAY * self.accepted + (pos < acc).sum(axis=0)
            self.judged = DECAY * self.judged + judged

    @property
    def rates(self) -> np.ndarray:
        """[max_draft] acceptance at each draft position, given the earlier ones accepted."""
        return np.asarray(self.accepted / self.judged)

    def expected(self, k: np.ndarray) -> np.ndarray:
        """Tokens a row emits in a round with `k` drafts (the target's own token included)."""
        gains = np.concatenate([[1.0], 1.0 + np.cumsum(np.cumprod(self.rates))])
        return np.asarray(gains[np.clip(np.asarray(k, dtype=np.int64), 0, len(gains) - 1)])


def bucket_of(num_rows: int) -> int:
    """1, 2, 4, 8, ...: the power of two at or above num_rows."""
    return 1 << max(0, int(num_rows - 1).bit_length())


@dataclass(slots=True)
class _Cell:
    samples: deque[float]
    count: int = 0
    last_step: int = -1
    seconds: float = 0.0  # median of `samples`


class StepCosts:
    """Seconds per engine step keyed by (bucket, width): the median of the last `WINDOW`
    samples (a shared machine's stalls are outliers a median ignores, and a changing load
    moves it within a window)."""

    def __init__(self) -> None:
        self.cells: dict[tuple[int, int], _Cell] = {}

    def observe(self, bucket: int, width: int, seconds: float, step: int) -> None:
        cell = self.cells.get((bucket, width))
        if cell is None:
            cell = self.cells[(bucket, width)] = _Cell(deque(maxlen=WINDOW))
        cell.samples.append(seconds)
        ordered = sorted(cell.samples)
        n = len(ordered)
        cell.seconds = 0.5 * (ordered[(n - 1) // 2] + ordered[n // 2])
        cell.count += 1
        cell.last_step = step

    def measured(self, bucket: int, width: int) -> _Cell | None:
        cell = self.cells.get((bucket, width))
        return cell if cell is not None and cell.count >= MIN_SAMPLES else None

    def last_step(self, bucket: int, width: int) -> int:
        cell = self.cells.get((bucket, width))
        return -1 if cell is None else cell.last_step

    def known(self, bucket: int) -> list[tuple[int, float]]:
        """(width, seconds) of this bucket's measured widths, narrowest first."""
        return sorted((w, c.seconds) for (b, w), c in self.cells.items()
                      if b == bucket and c.count >= MIN_SAMPLES)

    def estimate(self, bucket: int, width: int) -> float | None:
        """Seconds per step at this width: measured, or interpolated between the nearest
        measured widths around it; None beyond the widest measured."""
        cell = self.measured(bucket, width)
        if cell is not None:
            return cell.seconds
        known = self.known(bucket)
        lo = max((k for k in known if k[0] < width), default=None)
        hi = min((k for k in known if k[0] > width), default=None)
        if lo is None or hi is None:
            return None
        return lo[1] + (hi[1] - lo[1]) * (width - lo[0]) / (hi[0] - lo[0])

    def extrapolate(self, bucket: int, width: int) -> float | None:
        """`estimate`, and beyond the widest measured width, that width's cost plus the slope
        (at least 0) from the next narrower measured one; None with fewer than two measured."""
        cost = self.estimate(bucket, width)
        known = self.known(bucket)
        if cost is not None or len(known) < 2 or width < known[-1][0]:
            return cost
        (w0, c0), (w1, c1) = known[-2:]
        return c1 + max(0.0, (c1 - c0) / (w1 - w0)) * (width - w1)


@dataclass(slots=True)
class ControllerConfig:
    max_draft: int = 4  # --num-draft-tokens: the ceiling
    adaptive: bool = True  # False: always the widest width the rows fill (tests, benchmarks)
    budget: float = 0.015  # probing's share of busy time beyond plain decoding of its tokens
    min_gap: int = 16  # steps between probes, doubling while the choice stands ...
    max_gap: int = 256  # ... up to this


@dataclass(slots=True)
class Decision:
    width: int  # 1 = plain decoding
    caps: np.ndarray  # [B] per-row draft ceilings (0 = no speculation for the row)
    probe: bool = False
    # [width - 1] or None: entry k (k >= 1 drafts already kept) is what draft k + 1 must be
    # worth to be verified, in tokens summed over the rows (rule 6); None: verify the full width
    min_gain: np.ndarray | None = None


@dataclass
class Controller:
    config: ControllerConfig
    prior: float = 0.6  # the drafter's acceptance before any round
    costs: StepCosts = field(default_factory=StepCosts)
    acceptance: Acceptance = field(init=False)
    step: int = 0
    busy: float = 0.0  # seconds of every recorded step
    explore_excess: float = 0.0  # seconds probes cost beyond plain decoding of their tokens
    overhead: float = 0.0  # EMA of drafter seconds no typical step shows, per spec step
    switching: float = 0.0  # EMA of mode switches' excess seconds, per spec step (rule 3)
    _switch_excess: float = 0.0  # switches' excess since the last speculative step
    _was_probe: bool = False  # the previous step belonged to a probe
    _offered: bool = False  # the last decision's rows had drafts to offer
    _offer_changed: bool = False  # ... and the one before's had not, or the other way round
    _last_width: int = 0  # width of the previous engine step (0: none yet)
    _probe_left: int = 0  # further measured samples the probe under way needs
    _probe_steps: int = 0  # further steps it may take to get them
    _probe_width: int = 0
    _probe_start: int = 0
    _probing: bool = False  # the current decision is a probe at a width above 1
    _choice: dict[int, bool] = field(default_factory=dict)  # bucket -> speculating
    _next_probe: dict[int, int] = field(default_factory=dict)  # bucket -> step
    _gap: dict[int, int] = field(default_factory=dict)  # bucket -> current probe gap

    # -- acceptance ------------------------------------------------------------------------
    def __post_init__(self) -> None:
        self.acceptance = Acceptance(self.config.max_draft, self.prior)

    def caps(self, room: np.ndarray) -> np.ndarray:
        """Per-row draft ceilings: the ceiling, within the tokens the row has left (the width
        is the batch's, so a row drafting up to it costs the verify nothing more)."""
        return np.clip(room, 0, self.config.max_draft)

    def learn(self, num_drafts: np.ndarray, num_accepted: np.ndarray) -> None:
        self.acceptance.learn(num_drafts, num_accepted)

    # -- the width -------------------------------------------------------------------------
    def warm(self, num_rows: int) -> bool:
        """Whether this batch size's current choice is to speculate (a draft model then
        prefills admitted rows at once); always, when not adaptive."""
        if not self.config.adaptive:
            return True
        return self._choice.get(bucket_of(max(num_rows, 1)), False)

    def probe_due(self, num_rows: int) -> bool:
        """A probe is under way or would start at the next `decide`."""
        if self._probe_left > 0:
            return True
        b = bucket_of(max(num_rows, 1))
        plain = self.costs.estimate(b, 1)
        due = self.step >= self._next_probe.get(b, self.step)
        return due and plain is not None and self._left(b, plain) >= 0

    def decide(self, caps: np.ndarray, priced: bool = False) -> Decision:
        """The verify width for rows with draft ceilings `caps` (which already hold what the
        drafter can offer: n-gram, the match length). `priced`: the drafter can stop a round
        where its drafts are worth less than their columns (rule 6), so a speculative step
        offers it the widest width the rows fill."""
        top = int(caps.max(initial=0)) + 1
        self._probing = False
        self._offer_changed, self._offered = self._offered != (top > 1), top > 1
        if top == 1:
            return Decision(1, caps)
        if not self.config.adaptive:
            return Decision(top, caps)
        b = bucket_of(len(caps))
        plain = self.costs.estimate(b, 1)
        if plain is None:
            return Decision(1, caps)  # measure plain decoding first
        if self._probe_left > 0:
            if self._probe_width > 1 and (self._hopeless(b, self._probe_width, plain, priced)
                                          or self._spent(b, self._probe_width, plain)):
                self._probe_left = 0
            else:
                return self._probe_decision(min(self._probe_width, top), caps)
        best, gain = self._best(b, caps, top, plain)
        decision = self._maybe_probe(b, best, gain, caps, top, plain, may_climb=not priced)
        if priced and decision.width > 1 and not decision.probe:
            decision = Decision(top, caps, min_gain=self._min_gain(b, top, gain * len(caps) / plain))
        return decision

    def _best(self, b: int, caps: np.ndarray, top: int, plain: float) -> tuple[int, float]:
        """The width with the most expected tokens per second (rule 3), and its expected rate
        over plain decoding's."""
        best_w, best_rate = 1, len(caps) / plain
        margin = HOLD if self._choice.get(b) else MARGIN
        for w in range(2, top + 1):
            cost = self.costs.estimate(b, w)
            if cost is None:
                break
            cost = max(cost, plain)  # a verify does a plain step's work and more: cheaper is noise
            rate = float(self.acceptance.expected(np.minimum(caps, w - 1)).sum())
            rate /= cost + self.overhead + self.switch_seconds
            if rate > best_rate * (margin if best_w == 1 else 1.0):
                best_w, best_rate = w, rate
        return best_w, best_rate * plain / len(caps)

    def _maybe_probe(
        self, b: int, best: int, gain: float, caps: np.ndarray, top: int, plain: float,
        may_climb: bool = True,
    ) -> Decision:
        spec = best > 1
        chosen = Decision(best, np.minimum(caps, best - 1) if spec else caps)
        if self._choice.get(b) != spec:
            first = b not in self._choice
            self._choice[b] = spec
            self._gap[b] = self.config.min_gap
            self._next_probe[b] = self.step + (0 if first else self.config.min_gap)
        climb = self._climb(b, best, top) if spec and may_climb else 0
        if self.step < self._next_probe[b] and not climb:
            return chosen
        # width 1 is not probed while speculating pays by far (its cost cannot flip that)
        candidates = sorted({1, 2, top} - {best} - ({1} if gain >= CLEAR else set()))
        if not candidates and not climb:
            return chosen
        width = climb or min(candidates, key=lambda w: (self.costs.last_step(b, w), w))
        if width > 1:
            width = self._affordable(b, width, caps, plain)
            if not width:  # asked again a gap later, not at every step until the budget grows
                self._next_probe[b] = self.step + self._gap[b]
                return chosen
        gap = self._gap[b]
        self._next_probe[b] = self.step + gap
        self._gap[b] = min(2 * gap, self.config.max_gap)
        self._probe_width, self._probe_start = width, self.step
        self._probe_left, self._probe_steps = PROBE_STEPS - 1, 3 * PROBE_STEPS
        return self._probe_decision(width, caps)

    def _min_gain(self, b: int, width: int, rate: float) -> np.ndarray:
        """Rule 6: a round stops drafting where the next column's expected tokens (summed over
        rows) are worth less than its cost at the round's expected rate: entry k is `rate *
        (cost(k + 2) - cost(k + 1))`, the tokens that the extra column's seconds would yield
        at that rate (0 where a cost is not known, or a wider verify costs no more)."""
        need = np.zeros(max(width - 1, 1))
        costs = [self.costs.extrapolate(b, w) for w in range(2, width + 1)]
        for k in range(1, width - 1):
            lo, hi = costs[k - 1], costs[k]
            if lo is not None and hi is not None:
                need[k] = max(0.0, rate * (hi - lo))
        return need

    def _climb(self, b: int, best: int, top: int) -> int:
        """Speculation pays at `best`: the wider width to probe at once, not a probe gap later
        (`2 * best + 1` within `top`, the widest the rows fill), if it was never measured; 0
        when there is none."""
        width = min(top, 2 * best + 1)
        return width if width > best and self.costs.measured(b, width) is None else 0

    def _probe_decision(self, width: int, caps: np.ndarray) -> Decision:
        self._probing = width > 1
        return Decision(width, np.minimum(caps, width - 1) if width > 1 else caps, probe=True)

    def _hopeless(self, b: int, width: int, plain: float, priced: bool) -> bool:
        """This probe's latest sample costs more than plain decoding of `width` tokens (for a
        priced drafter, of the tokens the round is expected to yield: its speculative steps are
        priced rounds, so an unpriced wide probe only has to show the width's cost)."""
        cell = self._probe_sample(b, width)
        tokens = float(self.acceptance.expected(np.array(width - 1))) if priced else width
        return cell is not None and cell.samples[-1] > tokens * plain

    def _spent(self, b: int, width: int, plain: float) -> bool:
        """The probe under way has a measured sample and the budget is spent (rule 5): an
        expensive width's probe stops at one sample instead of running past the budget."""
        return self._probe_sample(b, width) is not None and self._left(b, plain) < 0

    def _probe_sample(self, b: int, width: int) -> _Cell | None:
        """The probed width's cost cell if the probe under way has measured it, else None."""
        cell = self.costs.cells.get((b, width))
        return cell if cell is not None and cell.last_step >= self._probe_start else None

    def _left(self, b: int, plain: float) -> float:
        """Seconds of probing excess the budget has left (rule 5): its share of busy time,
        plus the start allowance of `ALLOWANCE` one-row tokens at this bucket's plain cost
        per row, less what probes have spent."""
        allowance = ALLOWANCE * plain / b
        return self.config.budget * self.busy + allowance - self.explore_excess

    def _affordable(self, b: int, width: int, caps: np.ndarray, plain: float) -> int:
        """The width to probe for `width` (rule 5): itself if one sample's predicted excess
        fits what the budget has left, else the climb toward it (`2 W + 1` from the widest
        measured width W) if that fits, else 0 (no probe). A sample is predicted at the cost
        line's extrapolation, or at `width` plain steps before two widths are measured (a
        verify costing more cannot pay), less plain decoding of the tokens it would emit."""
        left = self._left(b, plain)
        known = max((w for w, _ in self.costs.known(b)), default=1)
        for w in dict.fromkeys((width, min(width, 2 * known + 1))):
            if w <= 1:
                continue
            cost = self.costs.extrapolate(b, w)
            cost = w * plain if cost is None else cost
            emitted = float(self.acceptance.expected(np.minimum(caps, w - 1)).mean())
            if cost - plain * emitted <= left:
                return w
        return 0

    # -- measuring -------------------------------------------------------------------------
    def record(
        self,
        num_rows: int,
        width: int,
        seconds: float,
        typical: bool,
        emitted: float = 1.0,
        drafter: float = 0.0,
    ) -> None:
        """The engine step just run: `width` columns verified (1: plain), `seconds` of wall
        time, `typical` (no prefill, nothing unusual), `emitted` tokens per row, `drafter`
        seconds of drafter work since the last speculative step that no typical step shows (a
        draft model's prefill at admission, its catch-up after a plain stretch). Those seconds
        are inside the `seconds` of the steps that ran them (this one or an earlier one), so
        they count once in `busy` and in a probe's excess; they are amortised into the cost of
        speculating (`overhead`), which the cost cells (typical steps only) do not hold.

        The first step after a switch between plain and speculative decoding drains or
        refills the pipeline, so only a step in the same mode as the one before is measured.
        What such a step costs beyond its mode's typical step, when the drafter's offers
        caused the switch (drafts appeared or ran out), is charged to speculating
        (`switching`, per speculative step): where the rows' lookups come and go, each round
        brings two switches, which no cost cell shows. The controller's own switches and
        those into and out of probes (the budget holds those) are left out, and the charge
        decays while decoding plainly, so speculation is tried again when the rows change.
        """
        b = bucket_of(max(num_rows, 1))
        same_mode = self._last_width > 0 and (self._last_width > 1) == (width > 1)
        probe = self._probing or self._probe_left > 0
        regular = not probe and not self._was_probe
        if regular and self._last_width > 0 and num_rows > 0:
            # switches the drafter's offers caused (not the controller's own choice)
            if not same_mode and typical and self._offer_changed:
                typical_cost = self.costs.estimate(b, width)
                if typical_cost is not None:
                    self._switch_excess += seconds - typical_cost
            if width > 1:  # per speculative step: the switches since the last one
                self.switching += 0.1 * (self._switch_excess - self.switching)
                self._switch_excess = 0.0
            elif same_mode:
                self.switching *= SWITCH_DECAY
        self._was_probe = probe
        if width > 1:
            self.overhead += 0.1 * (drafter - self.overhead)
            if self._probing:  # what the probe cost beyond plain decoding of its tokens
                plain = self.costs.estimate(b, 1) or 0.0
                self.explore_excess += max(0.0, seconds - plain * max(emitted, 1.0))
        measured = typical and same_mode and num_rows > 0
        if measured:
            self.costs.observe(b, width, seconds, self.step)
        if self._probe_left > 0:  # a probe lasts until it has its samples (or runs out of steps)
            self._probe_steps -= 1
            self._probe_left -= measured and (width > 1) == (self._probe_width > 1)
            if self._probe_steps <= 0:
                self._probe_left = 0
        self.busy += seconds
        self._last_width = width
        self.step += 1

    @property
    def switch_seconds(self) -> float:
        """What switching modes costs per speculative step (`switching`, never below 0: its
        samples are signed, so noise averages out instead of piling up)."""
        return max(0.0, self.switching)

    @property
    def speculating(self) -> dict[int, bool]:
        """Batch-size bucket -> whether its current choice is to speculate."""
        return dict(self._choice)
