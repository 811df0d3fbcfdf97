"""Speculation for the running batch: per-row state, the verify width, drafts, bookkeeping.

The executor (engine.runner) asks for a width each step and, above 1, drafts to verify:

    width = spec.decide(batch)            # 1: plain (pipelined) decoding this step
    rnd = spec.propose(batch, width)      # drafts for every row, at most width - 1 each
    ... the runner's verify forward over [B, K + 1], the verdict ...
    spec.observe(rnd, accepted)           # the drafter and the controller learn
    spec.record(num_rows, width, seconds, typical)

Rows with and without speculation share the step: the verify input is
`[next_token, d_1 .. d_K]` for every row, where a row with fewer drafts (none: n-gram found
nothing, its acceptance is too low, or it is about to finish) is padded;
its padding columns are never accepted and the layouts roll every row back to its own accepted
length (`engine.kv.batch.rollback`, exact across a ring's wrap and for recurrent layers). A row
with no drafts gets exactly the token plain decoding would have drawn (same column-0 logits,
same counter RNG). `NoSpec` stands in when speculation is off.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any, Protocol, cast

import mlx.core as mx
import numpy as np

from engine.api import SpecStats
from engine.spec.accept import plain_greedy
from engine.spec.adaptive import Controller, ControllerConfig
from engine.spec.base import Drafter, Proposal, ProposeContext
from kernels.common import gpu_backend

PLAIN_HOLD = 15  # decide() re-decides a plain choice every PLAIN_HOLD + 1 steps


class SpecRows:
    """Per-row speculation state (struct of arrays), carried by `RunningBatch.spec`."""

    __slots__ = ("drafter_state", "contexts")

    def __init__(self, num_rows: int, drafter_state: Any) -> None:
        self.drafter_state = drafter_state  # acceptance is pooled (adaptive.py)
        # each row's prompt + output so far, extended as it decodes (`Speculation._context`)
        self.contexts: list[list[int] | None] = [None] * num_rows

    def take(self, keep: list[int]) -> None:
        if self.drafter_state is not None:
            self.drafter_state.take(keep)
        self.contexts = [self.contexts[i] for i in keep]

    def concat(self, other: SpecRows) -> None:
        if self.drafter_state is not None:
            self.drafter_state.concat(other.drafter_state)
        self.contexts = self.contexts + other.contexts


@dataclass(slots=True)
class Round:
    """One speculative round's drafts, handed back to `observe` after the verdict."""

    ctx: ProposeContext
    proposal: Proposal
    rows: SpecRows
    started: float
    batch_rows: list[Any]  # the batch's RowMeta, in the proposal's order


class Executor(Protocol):
    """What `Speculation.warm_up` needs of the runner."""

    def new_caches(self, num_rows: int) -> list[Any]: ...

    def prefill_row(self, caches: list[Any], token_ids: list[int]) -> None: ...

    def verify(self, batch: Any, width: int) -> Any: ...


@dataclass(slots=True)
class _Totals:
    spec_steps: int = 0
    plain_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    row_rounds: int = 0  # (row, step) pairs with at least one draft
    width_sum: int = 0
    seconds_spec: float = 0.0


class Speculation:
    """The drafter and the controller that picks each step's verify width (`model`: the
    target; not needed by the choice, kept for the drafters' construction signature;
    `optional`: see the attribute)."""

    def __init__(self, model: Any, drafter: Drafter, config: ControllerConfig, optional: bool = False) -> None:
        del model
        self.drafter = drafter
        # a lookup's drafts are a point mass, often wrong off its matches: a lower prior
        self.controller = Controller(config, prior=0.5 if drafter.point_mass else 0.6)
        self.totals = _Totals()
        self._catch_up = False
        self._emitted = 1.0  # tokens per row of the last speculative step
        self._verified = 0  # columns of the last verify (0: it had no drafts)
        self._overhead_seen = 0.0  # drafter seconds (prefill, catch-up) already passed on
        self._plain_hold = 0  # further decide() calls answered "plain" without re-deciding
        self.sync_plain = False  # decide's plain step is read before the next decide
        # only on a CPU, where it was measured: on a GPU the pipeline hides a plain step's host
        # work, a large share of a step there
        self._sync_on_miss = drafter.point_mass and gpu_backend() is None
        self._plain_rows: list[Any] | None = None  # the batch's row list when it was decided
        self._min_gain: np.ndarray | None = None  # the last decision's (Decision.min_gain)
        self.warmup_seconds = 0.0  # warm_up(): the speculative shapes built at engine start
        self.warmup_ms: dict[int, float] = {}  # verify ms by width, at warm-up
        # a convenience the engine goes without where the architecture cannot speculate (the
        # predictions-only default), instead of refusing to start
        self.optional = optional

    @property
    def max_draft(self) -> int:
        return self.controller.config.max_draft

    # -- rows ------------------------------------------------------------------------------
    def admit(self, rows: list[Any], batch_size: int = 0) -> SpecRows:
        """Spec state for rows leaving prefill into a batch of `batch_size` rows (a draft model
        prefills them now if speculation is on at that size, else on first use)."""
        warm = self.controller.warm(max(batch_size, len(rows)))
        prompts = [r.request.prompt_ids for r in rows]
        predictions = [r.request.prediction_ids for r in rows]
        return SpecRows(len(rows), self.drafter.admit(prompts, warm, predictions))

    # -- choosing --------------------------------------------------------------------------
    def _caps(self, batch: Any, explore: bool = True) -> np.ndarray:
        """Per-row draft ceilings. With `explore`, rows whose drafter lags far behind sit out
        (bar one) until speculation is known to pay at this batch size."""
        rows = batch.rows
        spec: SpecRows = batch.spec
        caps = self.controller.caps(_room(rows))
        lag_of = getattr(self.drafter, "lag", None)
        warm = self.controller.warm(len(rows))
        if explore and lag_of is not None and caps.max(initial=0) > 0 and not warm:
            # until speculation is known to pay here, rows whose drafter state lags far behind
            # (admitted cold, or decoded plainly for long) sit out, bar one to measure with
            lag = lag_of(
                spec.drafter_state, [r.num_prompt_tokens + len(r.output_ids) for r in rows]
            )
            far = lag > int(getattr(self.drafter, "max_merged", 0))
            if far.all():
                far[int(np.argmin(lag))] = False
            caps[far] = 0
        return caps

    def decide(self, batch: Any) -> int:
        """Verify width for this step (1 = plain decoding).

        While decoding plainly the choice is re-made every `PLAIN_HOLD` steps (or when the rows
        change or a probe is due), not every step: the decision is host work that a pipelined
        plain step would otherwise pay each time (on a GPU a plain step is ~1-2 ms of host
        work, and the choice moves only with the slowly changing costs and acceptance). A
        lookup drafter that found nothing is asked again at the next step. A drafter with
        `wants` (predictions only) is not asked at all while no row could get drafts."""
        wants = getattr(self.drafter, "wants", None)
        if batch.spec is None or not len(batch.rows) or (
                wants is not None and not wants(batch.spec.drafter_state)):
            self.sync_plain = False
            return 1
        ctl = self.controller
        rows = batch.rows  # a new list object whenever rows join or leave (take / concat)
        if self._plain_hold > 0 and rows is self._plain_rows and not ctl.probe_due(len(batch.rows)):
            self._plain_hold -= 1
            return 1
        caps = self._caps(batch, explore=False)  # what the batch would gain when warm
        if self.drafter.point_mass and caps.max(initial=0) > 0:
            caps = np.minimum(caps, self._available(batch, caps))  # the lookup's own offer
        priced = getattr(self.drafter, "prices_drafts", False) and plain_greedy(batch.sampler)
        decision = ctl.decide(caps, priced)
        self._min_gain = decision.min_gain
        # hold a choice made on costs; a lookup drafter that found nothing looks again at the
        # next step (a copied stretch may start at any token: on the 1B twin's edit workload
        # holding 3 steps there took 145 plain steps against 129, 1.29-1.31x against 1.32-1.43x)
        found = not self.drafter.point_mass or caps.max(initial=0) > 0
        hold = decision.width == 1 and not decision.probe and ctl.config.adaptive and found
        self._plain_hold = PLAIN_HOLD if hold else 0
        release = getattr(self.drafter, "release", None)
        if hold and release is not None and not ctl.warm(len(rows)):
            release(batch.spec.drafter_state)  # its KV would only follow the rows around
        self._plain_rows = rows
        # a lookup that found nothing while speculation pays here: the next plain step is read
        # before the next lookup, so that a copied stretch starting at the token now in flight
        # is verified from the next step on, not one step later
        self.sync_plain = (self._sync_on_miss and not found and decision.width == 1
                           and ctl.warm(len(rows)))
        return decision.width

    def _available(self, batch: Any, caps: np.ndarray) -> np.ndarray:
        ctx = self._context(batch, caps)
        available = getattr(self.drafter, "available", None)
        if available is not None:  # counts only (no device arrays on a plain step)
            return available(ctx)
        return self.drafter.propose(ctx).num_drafts

    def _context(self, batch: Any, caps: np.ndarray) -> ProposeContext:
        # prompt + output per row, kept by the batch's spec state and extended by the tokens
        # emitted since (rebuilt every step, a decision over 64 rows of 2,000-token prompts
        # cost 611 us on this CPU, against 262)
        spec: SpecRows = batch.spec
        if len(spec.contexts) != len(batch.rows):  # never expected: start over rather than misalign
            spec.contexts = [None] * len(batch.rows)
        contexts = spec.contexts
        for b, r in enumerate(batch.rows):
            c = contexts[b]
            if c is None:
                contexts[b] = r.request.prompt_ids + r.output_ids
                continue
            have = len(c) - len(r.request.prompt_ids)
            if have < len(r.output_ids):
                c.extend(r.output_ids[have:])
        return ProposeContext(
            cast(list[list[int]], contexts), caps, batch.next_tokens, batch.sampler,
            spec.drafter_state,
        )

    # -- the round -------------------------------------------------------------------------
    def propose(self, batch: Any, width: int) -> Round:
        """Drafts for every row of `batch`, at most `width - 1` each (rows with none are
        padded; their padding is never accepted)."""
        t0 = time.perf_counter()
        caps = self._caps(batch)
        ctx = self._context(batch, np.minimum(caps, width - 1))
        if self._min_gain is not None and len(self._min_gain) >= ctx.max_drafts:
            ctx.min_gain = self._min_gain
        return Round(ctx, self._propose(ctx), batch.spec, t0, batch.rows)

    def observe(self, rnd: Round, accepted: np.ndarray) -> None:
        """Row b accepted `accepted[b]` of its drafts (the target's token follows them)."""
        proposal = rnd.proposal
        K = int(proposal.tokens.shape[1])
        if K:
            self.drafter.observe(rnd.ctx, proposal, accepted)
            if proposal.predicted is not None:  # for the requests' usage
                for b in np.flatnonzero(proposal.predicted):
                    rnd.batch_rows[b].accepted_prediction += int(accepted[b])
        self._learn(rnd.rows, proposal.num_drafts, accepted)
        self._emitted = float(accepted.mean()) + 1.0 if len(accepted) else 1.0
        self._verified = K + 1 if K else 0
        self._catch_up = bool(getattr(self.drafter, "caught_up", False)) and K > 0
        tot = self.totals
        tot.spec_steps += 1
        tot.width_sum += K + 1
        tot.seconds_spec += time.perf_counter() - rnd.started

    def _propose(self, ctx: ProposeContext) -> Proposal:
        B = len(ctx.contexts)
        if ctx.max_drafts > 0:
            proposal = self.drafter.propose(ctx)
            K = int(proposal.num_drafts.max(initial=0))
            if K == 0:
                return _empty(B)
            if K < proposal.tokens.shape[1]:  # trim columns nobody uses
                proposal.tokens = proposal.tokens[:, :K]
                if proposal.host_tokens is not None:
                    proposal.host_tokens = proposal.host_tokens[:, :K]
                if proposal.draft_logits is not None:
                    proposal.draft_logits = proposal.draft_logits[:, :K]
                if proposal.column_states is not None:
                    proposal.column_states = proposal.column_states[: K + 1]
            return proposal
        return _empty(B)

    def _learn(self, spec: SpecRows, num_drafts: np.ndarray, accepted: np.ndarray) -> None:
        del spec
        self.controller.learn(num_drafts, accepted)
        tot = self.totals
        tot.drafted += int(num_drafts.sum())
        tot.accepted += int(accepted.sum())
        tot.emitted += int((accepted + 1).sum())
        tot.row_rounds += int((num_drafts > 0).sum())

    # -- warm-up ---------------------------------------------------------------------------
    def warm_up(self, executor: Executor, vocab_size: int, prompt_len: int = 24) -> float:
        """One speculative round per verify width the controller can choose (2 .. ceiling + 1),
        on a throwaway one-row batch (its own caches, drafter state and sampler), greedy: on
        MLX-CUDA an engine's first rounds of each shape cost 40-550 ms (kernels set up per
        engine), paid here at load instead of while serving. Leaves nothing behind: the rows,
        caches and drafter state are dropped, and the statistics (totals, the controller's
        acceptance estimate, the drafter's counters) are restored. Returns the seconds taken."""
        from engine.api import Request, SamplingParams
        from engine.batch import RowMeta, RunningBatch
        from engine.sampling import SamplerState

        t0 = time.perf_counter()
        ctl = self.controller
        saved = (
            self.totals, copy.deepcopy(ctl.acceptance), dict(vars(self.drafter)),
            self._emitted, self._catch_up,
        )
        drafter = self.drafter
        self.totals = _Totals()
        ms: dict[int, float] = {}
        try:
            # a repeating prompt (token ids 1..period, inside any vocabulary)
            period = max(1, min(16, vocab_size - 1))
            prompt = [1 + i % period for i in range(max(prompt_len, 2 * period))]
            K = self.max_draft
            max_tokens = 4 * (K + 2) * (K + 1)
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
            row = RowMeta(Request("spec-warmup", prompt, params), len(prompt), max_tokens,
                          frozenset())
            caches = executor.new_caches(1)
            executor.prefill_row(caches, prompt[:-1])
            sampler = SamplerState.from_params([params], [prompt], vocab_size, [0])
            spec = SpecRows(1, drafter.admit([prompt], True))
            batch = RunningBatch([row], mx.array([prompt[-1]], dtype=mx.int32), sampler, caches,
                                 spec)
            if drafter.point_mass:  # a lookup drafter: exactly W - 1 drafts whatever it finds
                self.drafter = _FixedDrafter(drafter)
            for width in range(2, K + 2):
                t1 = time.perf_counter()
                result = executor.verify(batch, width)
                mx.eval(batch.next_tokens, *batch.arrays())
                ms[width] = round((time.perf_counter() - t1) * 1e3, 2)
                row.output_ids.extend(result.tokens[0])
                row.num_generated += len(result.tokens[0])
        finally:
            self.drafter = drafter
            (self.totals, ctl.acceptance, state, self._emitted,
             self._catch_up) = saved
            vars(drafter).update(state)
        self.warmup_ms = ms
        self.warmup_seconds = time.perf_counter() - t0
        return self.warmup_seconds

    # -- timing and stats ------------------------------------------------------------------
    def record(self, num_rows: int, width: int, seconds: float, typical: bool) -> None:
        """The step just run, for the controller: a verify is recorded at the columns it
        verified (a lookup may have filled fewer than decided), with the drafter's work since
        the last speculative one (a draft model's prefill at admission, which runs inside the
        scheduling of a step, and its catch-up, inside the verify step's proposal): already in
        the `seconds` of the steps that ran it, but in no typical step's."""
        if width <= 1:
            self.totals.plain_steps += 1
        drafter = 0.0
        if width > 1:
            typical = typical and not self._catch_up and self._verified > 1
            width = max(self._verified, 2)
            overhead = float(getattr(self.drafter, "prefill_seconds", 0.0)) + float(
                getattr(self.drafter, "catch_up_seconds", 0.0)
            )
            drafter, self._overhead_seen = overhead - self._overhead_seen, overhead
        self._catch_up = False
        emitted = self._emitted if width > 1 else 1.0
        self.controller.record(num_rows, width, seconds, typical, emitted, drafter)

    def stats(self) -> SpecStats:
        tot = self.totals
        ctl = self.controller
        cells = ctl.costs.cells
        drafter = {k: float(v) for k, v in self.drafter.stats().items() if v is not None}
        return SpecStats(
            method=self.drafter.name,
            num_draft_tokens=self.max_draft,
            spec_steps=tot.spec_steps,
            plain_steps=tot.plain_steps,
            drafted_tokens=tot.drafted,
            accepted_tokens=tot.accepted,
            acceptance_rate=_ratio(tot.accepted, tot.drafted),
            mean_verify_width=_ratio(tot.width_sum, tot.spec_steps, 3),
            tokens_per_row_round=_ratio(tot.accepted + tot.row_rounds, tot.row_rounds, 3),
            expected_tokens_per_round=round(float(ctl.acceptance.expected(
                np.array(self.max_draft))), 3),
            acceptance_by_position=[round(float(a), 4) for a in ctl.acceptance.rates],
            overhead_ms_per_spec_step=round(ctl.overhead * 1e3, 3),
            switch_ms_per_spec_step=round(ctl.switch_seconds * 1e3, 3),
            explore_ms=round(ctl.explore_excess * 1e3, 3),
            busy_s=round(ctl.busy, 3),
            speculating_by_bucket={str(b): v for b, v in sorted(ctl.speculating.items())},
            step_ms={f"{b}x{w}": round(c.seconds * 1e3, 3) for (b, w), c in sorted(cells.items())},
            drafter=drafter,
            warmup_s=round(self.warmup_seconds, 3),
            warmup_ms_by_width={str(w): v for w, v in self.warmup_ms.items()},
        )


def _ratio(num: float, den: float, digits: int = 4) -> float | None:
    return round(num / den, digits) if den else None


class NoSpec:
    """`Speculation` when it is off: every step plain, no per-row state."""

    sync_plain = False

    def admit(self, rows: list[Any], batch_size: int = 0) -> None:
        del rows, batch_size

    def decide(self, batch: Any) -> int:
        del batch
        return 1

    def record(self, num_rows: int, width: int, seconds: float, typical: bool) -> None:
        del num_rows, width, seconds, typical

    def stats(self) -> None:
        return None


class _FixedDrafter:
    """`warm_up`'s stand-in for a lookup drafter: exactly the drafts asked for (token 1), so
    every verify width is built whatever the lookup would find."""

    point_mass = True
    catches_up = False

    def __init__(self, inner: Any) -> None:
        self.name = inner.name

    def propose(self, ctx: ProposeContext) -> Proposal:
        tokens = np.ones((len(ctx.contexts), ctx.max_drafts), np.int32)
        return Proposal(mx.array(tokens), ctx.num_drafts.copy(), host_tokens=tokens)

    def observe(self, ctx: ProposeContext, proposal: Proposal, num_accepted: np.ndarray) -> None:
        del ctx, proposal, num_accepted

    def admit(self, contexts: Any, warm: bool, predictions: Any = ()) -> None:
        del contexts, warm, predictions

    def stats(self) -> dict[str, Any]:
        return {}


def _room(rows: list[Any]) -> np.ndarray:
    """[B] drafts each row has room for: tokens it may still generate, less the target's own."""
    return np.array([r.max_new_tokens - r.num_generated - 1 for r in rows], np.int64)


def _empty(B: int) -> Proposal:
    return Proposal(
        tokens=mx.zeros((B, 0), mx.int32),
        num_drafts=np.zeros(B, np.int64),
        host_tokens=np.zeros((B, 0), np.int32),
    )
