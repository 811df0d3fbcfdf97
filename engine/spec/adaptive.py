"""When to speculate and how far: per-row draft lengths and a verify width chosen online.

Expected tokens. Row b's drafts are accepted independently with probability `alpha[b]` (until
the first rejection), so `k` drafts yield `E(alpha, k) = (1 - alpha**(k+1)) / (1 - alpha)`
tokens (accepted drafts + the target's own token). `alpha[b]` is a decayed count per row:
`(S + m * alpha0) / (T + m)` with S accepted drafts, T drafts judged (a rejection ends a
round's judging), both decayed by `decay` each speculative step, `m` pseudo-counts of the
drafter's pooled acceptance `alpha0`. A row's ceiling `cap[b]` is the longest draft whose last
token still has a chance `alpha**k >= min_reach` of being reached and accepted (short drafts
for rows with low acceptance, none below `alpha < min_reach`), and never more than the row
has left to generate.

Cost. `StepCosts` keeps the engine step's wall time per (batch-size bucket, verify width W),
W = 1 being plain pipelined decoding: the median of the last `window` samples, trusted from
`min_samples` on (on a shared machine other processes stall steps and drift the level over
time; a median of recent samples follows the level and ignores the stalls). A step is
measured only when it is typical: no prefill in it, and the same mode as the step before (the
first step after a switch drains or refills the pipeline). Unmeasured widths are estimated:
from this bucket's W = 1 and the ratio measured at the nearest bucket; else by a straight line
through this bucket's measured widths; else W = 2 alone is tried (`prior_slope`). A width is
considered only once the width below it is measured in this bucket: exploration climbs one
width at a time (on a noisy machine a cheap-looking W = 2 extrapolated to W = 5 cost 3.5x a
plain step per sample at 16 rows on this CPU).

Choice. For each W the expected rate is `sum_b E(alpha[b], min(W - 1, cap[b]))` tokens per
`cost(W) + overhead` seconds (`overhead`: an EMA, per speculative step, of the drafter work
no step measurement holds: a draft model's prefill of admitted rows and catch-up); speculation
must beat plain by `margin` (a wrong "speculate" costs more than a missed one, and what the
cells still miss, such as pipeline drains, is all on the speculative side), plus `noise_margin`
times the larger relative spread (IQR / median) of the two cells compared: on a loaded shared
machine the cells are sampled at different loads and only a clear advantage is trusted. Probes keep both sides' costs fresh, `probe_steps` steps each (all but
the first are measured): while speculating, plain decoding after `plain_probe_every` steps
(the interval doubling to `max_plain_probe_every`); while decoding plainly, speculation after
`probe_every` steps (doubling to `max_probe_every`: a draft model's probe must first catch up
on the tokens decoded plainly). A changed choice restarts the interval.

Exploration budget. Trying speculation where it is not yet known to pay (an untrusted width,
or a probe while decoding plainly) costs whatever those steps take beyond a plain step: on a
reference-BLAS CPU a step or two, but on CUDA the first speculative steps of an engine cost
40-120 ms each against a ~1.5 ms plain step (new attention and graph shapes, measured on an
H200), i.e. 5-10 % of a few-second workload. So the
time exploratory steps took beyond plain decoding of the tokens they emitted is accounted
(`explore_excess`: a round that already pays costs nothing), and an exploration starts
only while `explore_excess + expected <= explore_budget * busy` (busy: the engine's recorded
step time): exploring costs at most a few percent of the time decoded, whatever the device.
`expected` is what the last exploration of this engine cost, and for an engine's first one,
what the first exploration of an earlier engine on the same model and drafter cost in this
process (`ExploreMemory`; else `explore_prior_steps` plain steps). A measured sample that
cannot pay even if every draft were accepted (`cost(W) > hopeless * W * cost(1)`) ends the
exploration of that width at once, without waiting for `min_samples`.

Worked example: batch of 4 with alpha = 0.6, plain 10 ms, W = 3 measured at 13 ms:
E(0.6, 2) = 1.96 tokens/row -> 7.84 tokens / 13 ms = 603 tok/s vs 400 tok/s plain: W = 3.
At 16 rows, plain 20 ms and W = 3 at 45 ms: 31.4 / 45 ms = 697 vs 800 tok/s: plain.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np


def expected_tokens(alpha: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Tokens a row emits with k drafts accepted independently with prob alpha (plus one)."""
    a = np.clip(alpha, 0.0, 0.999)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def median_spread(ordered: list[float]) -> tuple[float, float]:
    """Median and relative spread (IQR / median; 0 below 3 samples) of sorted samples (np.median
    costs ~30 us per step)."""
    n = len(ordered)
    median = 0.5 * (ordered[(n - 1) // 2] + ordered[n // 2])
    spread = (ordered[(3 * n) // 4] - ordered[n // 4]) / median if n >= 3 and median > 0 else 0.0
    return median, spread


def bucket_of(num_rows: int) -> int:
    """1, 2, 4, 8, ...: the power of two at or above num_rows."""
    return 1 << max(0, int(num_rows - 1).bit_length())


@dataclass(slots=True)
class _Cell:
    samples: deque[float]
    count: int
    last_step: int
    seconds: float = 0.0  # median of `samples`
    spread: float = 0.0  # interquartile range of `samples` / median (how noisy the machine is)


class StepCosts:
    """Seconds per engine step keyed by (bucket, width): the median of recent samples, trusted
    once a cell has `min_samples` (the median of one or two samples on a shared machine is a
    coin toss, and the first cell measured must not decide on its own)."""

    def __init__(self, window: int = 9, min_samples: int = 3, prior_slope: float = 0.15) -> None:
        self.window = window
        self.min_samples = min_samples
        self.prior_slope = prior_slope
        self.cells: dict[tuple[int, int], _Cell] = {}

    def observe(self, bucket: int, width: int, seconds: float, step: int) -> None:
        cell = self.cells.get((bucket, width))
        if cell is None:
            cell = self.cells[(bucket, width)] = _Cell(deque(maxlen=self.window), 0, step)
        cell.samples.append(seconds)
        cell.seconds, cell.spread = median_spread(sorted(cell.samples))
        cell.count += 1
        cell.last_step = step

    def measured(self, bucket: int, width: int) -> _Cell | None:
        """The cell if it holds enough samples to be trusted."""
        cell = self.cells.get((bucket, width))
        return cell if cell is not None and cell.count >= self.min_samples else None

    def estimate(self, bucket: int, width: int) -> float | None:
        """Seconds per step at this width (None: unknown, and not to be tried yet)."""
        cell = self.measured(bucket, width)
        if cell is not None:
            return cell.seconds
        plain = self.measured(bucket, 1)
        if plain is None:
            return None
        ratio = self._neighbour_ratio(bucket, width)
        if ratio is not None:
            return plain.seconds * ratio
        widths = sorted(w for (b, w) in self.cells if b == bucket and w > 1 and self.measured(b, w))
        if widths:
            w2 = widths[-1] if widths[-1] < width else widths[0]
            slope = (self.cells[(bucket, w2)].seconds - plain.seconds) / (w2 - 1)
            return plain.seconds + max(slope, 0.0) * (width - 1)
        if width == 2:
            return plain.seconds * (1.0 + self.prior_slope)
        return None

    def spread(self, bucket: int, width: int) -> float | None:
        cell = self.measured(bucket, width)
        return None if cell is None else cell.spread

    def _neighbour_ratio(self, bucket: int, width: int) -> float | None:
        best: tuple[int, float] | None = None
        for b, w in self.cells:
            cell, plain = self.measured(b, w), self.measured(b, 1)
            if w != width or b == bucket or cell is None or plain is None:
                continue
            dist = abs(int(np.log2(b)) - int(np.log2(bucket)))
            ratio = cell.seconds / plain.seconds
            if bucket > b:  # more rows: verification is relatively dearer, never cheaper
                ratio = max(ratio, 1.0)
            if best is None or dist < best[0]:
                best = (dist, ratio)
        return None if best is None else best[1]


@dataclass(slots=True)
class ControllerConfig:
    max_draft: int = 4  # --num-draft-tokens: the ceiling
    adaptive: bool = True  # False: always W = max_draft + 1 (tests, benchmarks of the raw path)
    min_reach: float = 0.2
    prior_alpha: float = 0.6
    pseudo_count: float = 2.0
    decay: float = 0.9
    margin: float = 1.08  # speculation must beat plain by 8 %
    # ... and by this much more per unit of the step times' relative spread (IQR / median of
    # the cells compared): on a loaded shared machine the cells are measured at different
    # loads, and only a clear advantage survives the noise
    noise_margin: float = 0.5
    probe_every: int = 64  # plain decoding: try speculation again after this many steps
    max_probe_every: int = 2048
    plain_probe_every: int = 32  # speculating: re-measure plain decoding after this many steps
    max_plain_probe_every: int = 256
    probe_steps: int = 3  # a probe's length (its first step is not measured)
    # exploring may cost this share of the engine's time (excess over plain steps)
    explore_budget: float = 0.03
    explore_prior_steps: float = 2.0  # expected excess of a first exploration, in plain steps
    hopeless: float = 1.5  # a sample above hopeless * W * plain ends exploring width W
    # A lookup drafter (n-gram) offering some row at least `long_match` drafts is cheap
    # evidence: an engine's first exploration is then expected to cost only what its steps
    # would take beyond plain decoding of the tokens they emit at the current acceptance
    # (nothing, when W = 2 is expected to pay), instead of a remembered or prior cost; not
    # when that remembered cost was dominated by set-up (over `setup_bound` plain steps:
    # MLX-CUDA's first shapes of an engine), which a long match does not make cheaper.
    long_match: int = 4
    setup_bound: float = 4.0
    # The flat-cost jump (lookup drafters only). Their drafts cost nothing to make, and on
    # MLX-CUDA a verify step costs nearly the same at any width from 2 on (its cost is set by
    # its kernel launches, not its columns: docs/speculative.md), so W = 2, the
    # first width the climb measures, is the worst value and a measured W = 2 that does not pay
    # says little about wide widths. Then the widest width the rows' offers fill is tried on the
    # premise that it costs what W = 2 costs; its own samples replace the premise, and two
    # samples above `flat_tolerance` times W = 2's cost refute it for the batch-size bucket (one
    # could be a stall; on a reference-BLAS CPU a width-9 verify costs ~9 plain steps: two
    # samples, then no more jumps).
    jump: bool = True
    flat_tolerance: float = 1.5


class ExploreMemory:
    """What the first exploration of an engine cost (excess seconds), per (model, drafter),
    for the engines that follow in this process (the cost is the device's and the backend's:
    on CUDA, shapes and graphs set up per engine)."""

    def __init__(self) -> None:
        self._first: dict[Any, tuple[Any, float]] = {}

    def first_cost(self, key: Any) -> float | None:
        entry = self._first.get(key)
        if entry is None or (entry[0] is not None and entry[0]() is None):
            return None
        return entry[1]

    def remember(self, key: Any, seconds: float, ref: Any = None) -> None:
        self._first[key] = (ref, seconds)


EXPLORE_MEMORY = ExploreMemory()


@dataclass(slots=True)
class Decision:
    width: int  # 1 = plain decoding
    caps: np.ndarray  # [B] per-row draft ceilings (0 = no speculation for the row)
    probe: bool = False
    jump: bool = False  # the flat-cost jump: `caps` are the lookup's offers, not the row caps


@dataclass
class Controller:
    config: ControllerConfig
    costs: StepCosts = field(default_factory=StepCosts)
    pooled_alpha: float = 0.0
    step: int = 0
    _last_width: int = 0  # width of the previous engine step (0: none yet)
    _probe_left: int = 0  # further steps of the probe under way
    _probe_width: int = 0
    _next_probe: dict[int, int] = field(default_factory=dict)  # bucket -> step
    _interval: dict[int, int] = field(default_factory=dict)  # bucket -> probe interval
    _chosen_spec: dict[int, bool] = field(default_factory=dict)  # bucket -> last exploit choice
    overhead: float = 0.0  # EMA of drafter seconds outside the measured steps, per spec step
    busy: float = 0.0  # seconds of every recorded step
    explore_excess: float = 0.0  # seconds exploratory steps cost beyond plain steps
    memory_key: Any = None  # (model, drafter) key into EXPLORE_MEMORY (None: not shared)
    memory_ref: Any = None  # a weak reference that invalidates the key (the model)
    _exploring: bool = False  # the current decision explores (its steps are accounted)
    _episode: float = 0.0  # excess of the exploration under way
    _episodes: int = 0  # explorations finished in this engine
    _last_episode: float | None = None  # excess of the last finished exploration
    _gated_until: float = 0.0  # busy seconds before which exploring is not reconsidered
    _probe_start: int = 0  # step at which the current probe began
    lookup_evidence: bool = False  # caps carry a lookup drafter's offer (see long_match)
    _match_cost: float | None = None  # first exploration's expected cost given a long match
    _flat_refuted: set[int] = field(default_factory=set)  # buckets where a jump sample was dear
    jumps: int = 0  # decisions that took the flat-cost jump (engine stats)

    def __post_init__(self) -> None:
        self.pooled_alpha = self.config.prior_alpha

    # -- per-row acceptance ----------------------------------------------------------------
    def alpha(self, accepted: np.ndarray, judged: np.ndarray) -> np.ndarray:
        m = self.config.pseudo_count
        return (accepted + m * self.pooled_alpha) / (judged + m)

    def caps(self, alpha: np.ndarray, room: np.ndarray) -> np.ndarray:
        """Per-row draft ceilings: alpha**k >= min_reach, within the tokens the row has left."""
        K = self.config.max_draft
        if not self.config.adaptive:
            return np.clip(room, 0, K)
        a = np.clip(alpha, 1e-6, 0.999)
        k = np.floor(np.log(self.config.min_reach) / np.log(a)).astype(np.int64)
        return np.clip(np.minimum(k, room), 0, K)

    def learn(self, num_drafts: np.ndarray, num_accepted: np.ndarray) -> None:
        judged = num_accepted + (num_accepted < num_drafts)
        total = judged.sum()
        if total > 0:
            rate = num_accepted.sum() / total
            self.pooled_alpha += 0.05 * (rate - self.pooled_alpha)

    def add_overhead(self, seconds: float) -> None:
        """Drafter work since the previous speculative step that no step measurement holds (a
        draft model's prefill of admitted rows, its catch-up after plain stretches, which
        recurs when the choice flips back and forth): amortised over speculative steps."""
        self.overhead += 0.1 * (seconds - self.overhead)

    def warm(self, num_rows: int) -> bool:
        """Whether speculation has been measured to pay for a batch of this size (a draft
        model then prefills admitted rows; until then it explores with one row, see
        `Speculation._caps`)."""
        b = bucket_of(max(num_rows, 1))
        measured = any(
            w > 1 and self.costs.measured(b, w) for (bb, w) in self.costs.cells if bb == b
        )
        return bool(self._chosen_spec.get(b, False)) and measured

    # -- the verify width ------------------------------------------------------------------
    def probe_due(self, num_rows: int) -> bool:
        """A probe is under way or would start at the next `decide`."""
        if self._probe_left > 0:
            return True
        nxt = self._next_probe.get(bucket_of(max(num_rows, 1)))
        return (nxt is None or self.step >= nxt) and self.busy >= self._gated_until

    def decide(
        self, alpha: np.ndarray, caps: np.ndarray, offer: np.ndarray | None = None
    ) -> Decision:
        """`caps` already include what the drafter can offer (n-gram: the match length);
        `offer`: a lookup drafter's offer per row up to the ceiling (see `long_match`)."""
        cfg = self.config
        B = len(caps)
        if B == 0 or caps.max(initial=0) == 0:
            return self._plain(caps)
        if not cfg.adaptive:
            return Decision(int(caps.max()) + 1, caps)
        if self._probe_left > 0:
            bucket = bucket_of(B)
            plain = self.costs.estimate(bucket, 1)
            if (
                self._probe_width > 1
                and plain is not None
                and self._hopeless(bucket, self._probe_width, plain, since=self._probe_start)
            ):
                self._probe_left = 0  # this probe's sample already says it cannot pay
                return self._plain(caps)
            self._probe_left -= 1
            w = min(self._probe_width, int(caps.max()) + 1)
            self._exploring = w > 1
            return Decision(w, np.minimum(caps, w - 1), probe=True)
        bucket = bucket_of(B)
        plain = self.costs.estimate(bucket, 1)
        if plain is None:
            return self._plain(caps)  # measure plain decoding first
        self._match_cost = None
        long = offer is not None and offer.max(initial=0) >= cfg.long_match
        if self.lookup_evidence and self._last_episode is None and long:
            est2 = self.costs.estimate(bucket, 2) or plain * (1.0 + self.costs.prior_slope)
            gain = float(expected_tokens(alpha, np.minimum(caps, 1)).mean())
            self._match_cost = (cfg.probe_steps + 1) * max(0.0, est2 - plain * gain)
        plain_spread = self.costs.spread(bucket, 1) or 0.0
        best_w, best_rate = 1, B / plain
        for w in range(2, int(caps.max()) + 2):
            cost = self.costs.estimate(bucket, w)
            if cost is None or (w > 2 and self.costs.measured(bucket, w - 1) is None):
                break  # one width at a time: never try w before w - 1 is measured here
            if self._hopeless(bucket, w, plain):
                break  # wider is dearer still
            if self.costs.measured(bucket, w) is None and not self.may_explore(plain):
                break  # untried here, and exploring now would exceed the budget
            cost += self.overhead
            rate = float(expected_tokens(alpha, np.minimum(caps, w - 1)).sum()) / cost
            spread = max(plain_spread, self.costs.spread(bucket, w) or 0.0)
            margin = cfg.margin + cfg.noise_margin * spread
            if rate > best_rate * (margin if best_w == 1 else 1.0):
                best_w, best_rate = w, rate
        jumped = False
        if best_w == 1 and cfg.jump and self.lookup_evidence and offer is not None:
            top = self._jump(bucket, alpha, offer, plain, best_rate, plain_spread)
            if top is not None:
                best_w, caps, jumped = top, np.minimum(offer, top - 1), True
        decision = self._maybe_probe(bucket, best_w, caps)
        decision.jump = jumped and decision.width == best_w and not decision.probe
        self.jumps += decision.jump
        self._exploring = decision.width > 1 and (
            decision.probe or self.costs.measured(bucket, decision.width) is None
        )
        return decision

    def _jump(
        self,
        bucket: int,
        alpha: np.ndarray,
        offer: np.ndarray,
        plain: float,
        plain_rate: float,
        plain_spread: float,
    ) -> int | None:
        """The flat-cost jump (`ControllerConfig.jump`): the widest width the lookup's offers
        fill, if it pays at its own sampled cost, or else at W = 2's measured cost while the
        flat premise stands in this bucket; None otherwise."""
        cfg = self.config
        top = int(offer.max(initial=0)) + 1
        two = self.costs.measured(bucket, 2)
        if top < 4 or two is None or bucket in self._flat_refuted:
            return None
        cell = self.costs.cells.get((bucket, top))
        dear = cfg.flat_tolerance * two.seconds
        samples = list(cell.samples) if cell is not None else []
        if len(samples) >= 2 and min(samples) > dear:
            self._flat_refuted.add(bucket)  # wide verifies are dear here: no more jumps
            return None
        cheap = sorted(x for x in samples if x <= dear)  # dear ones: stalls, while the premise holds
        if cheap:
            cost, spread = median_spread(cheap)
        else:  # untried, or one dear sample (a stall or a first use can be one): the premise
            if not self.may_explore(plain):
                return None
            cost, spread = two.seconds, two.spread
        rate = float(expected_tokens(alpha, np.minimum(offer, top - 1)).sum()) / (cost + self.overhead)
        margin = cfg.margin + cfg.noise_margin * max(plain_spread, spread)
        return top if rate > plain_rate * margin else None

    def _plain(self, caps: np.ndarray) -> Decision:
        self._exploring = False
        return Decision(1, caps)

    def _hopeless(self, bucket: int, width: int, plain: float, since: int | None = None) -> bool:
        """Samples of this width (even fewer than `min_samples`) cost more than the width could
        ever repay: all W tokens of every row accepted would not reach plain decoding's rate.
        With `since`: only the latest sample, if taken at or after that step (a probe's own)."""
        cell = self.costs.cells.get((bucket, width))
        if cell is None or not cell.samples:
            return False
        limit = self.config.hopeless * width * plain
        if since is not None:
            return cell.last_step >= since and cell.samples[-1] > limit
        return cell.seconds > limit

    def expected_explore_cost(self, plain: float) -> float:
        """Excess seconds the next exploration is expected to cost (see the module doc)."""
        if self._last_episode is not None:
            return self._last_episode
        first = EXPLORE_MEMORY.first_cost(self.memory_key) if self.memory_key else None
        expected = first if first is not None else self.config.explore_prior_steps * plain
        if self._match_cost is not None and expected <= self.config.setup_bound * plain:
            expected = min(expected, self._match_cost)  # a long lookup match: see long_match
        return expected

    def may_explore(self, plain: float) -> bool:
        """Whether an exploration may start now within the budget (and if not, no re-check
        until enough busy time has passed: the gate costs nothing per plain step)."""
        if self._exploring or self._probe_left > 0:
            return True
        need = self.explore_excess + self.expected_explore_cost(plain)
        ok = need <= self.config.explore_budget * self.busy
        if not ok:
            self._gated_until = need / self.config.explore_budget
        return ok

    def _maybe_probe(self, bucket: int, width: int, caps: np.ndarray) -> Decision:
        """Now and then run the mode not chosen for `probe_steps` steps (the first unmeasured);
        the interval doubles while the choice stands and restarts when it changes."""
        cfg = self.config
        spec = width > 1
        first, most = (
            (cfg.plain_probe_every, cfg.max_plain_probe_every)
            if spec
            else (cfg.probe_every, cfg.max_probe_every)
        )
        if self._chosen_spec.get(bucket) != spec:
            self._chosen_spec[bucket] = spec
            self._interval[bucket] = first
            self._next_probe[bucket] = self.step + first
        if self.step < self._next_probe.setdefault(bucket, self.step + first):
            return Decision(width, caps)
        plain = self.costs.estimate(bucket, 1)
        if not spec and plain is not None and not self.may_explore(plain):
            return Decision(width, caps)  # not within the exploration budget yet: plain
        interval = min(2 * self._interval.get(bucket, first), most)
        self._interval[bucket] = interval
        self._next_probe[bucket] = self.step + interval
        self._probe_width = 1 if spec else 2
        self._probe_left = cfg.probe_steps - 1
        self._probe_start = self.step
        w = self._probe_width
        return Decision(w, np.minimum(caps, w - 1), probe=True)

    def record(
        self, num_rows: int, width: int, seconds: float, typical: bool, emitted: float = 1.0
    ) -> None:
        """Wall time of the engine step just run (`typical`: no prefill, nothing unusual;
        `emitted`: tokens per row it produced, 1 for a plain step).

        The first step after a switch between plain and speculative decoding drains or
        refills the pipeline, so only a step in the same mode as the one before is measured.
        """
        same_mode = self._last_width > 0 and (self._last_width > 1) == (width > 1)
        bucket = bucket_of(num_rows)
        if width > 1 and self._exploring:  # what exploring cost beyond plain decoding of the
            plain = self.costs.estimate(bucket, 1)  # same tokens (a paying round costs nothing)
            excess = max(0.0, seconds - (plain or 0.0) * max(emitted, 1.0))
            self.explore_excess += excess
            self._episode += excess
        elif self._episode > 0.0:  # an exploration just ended
            self._end_episode()
        if typical and same_mode and num_rows > 0:
            self.costs.observe(bucket, width, seconds, self.step)
        self.busy += seconds
        self._last_width = width
        self.step += 1

    def _end_episode(self) -> None:
        if self._episodes == 0 and self.memory_key is not None:
            EXPLORE_MEMORY.remember(self.memory_key, self._episode, self.memory_ref)
        self._last_episode = self._episode
        self._episodes += 1
        self._episode = 0.0

    @property
    def speculating(self) -> dict[int, bool]:
        """Batch-size bucket -> whether its last exploit choice was to speculate."""
        return dict(self._chosen_spec)
