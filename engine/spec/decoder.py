"""One speculative decode step for the whole running batch (synchronous), and its bookkeeping.

    width = spec.decide(batch)            # 1: plain (pipelined) decoding this step
    result = spec.step(batch, width)      # drafts -> one target forward over [B, width] -> accept
    spec.record(num_rows, width, seconds, typical)

Rows with and without speculation share the step: the verify input is
`[next_token, d_1 .. d_{W-1}]` for every row, where a row with fewer drafts (none: n-gram found
nothing, its acceptance is too low, it is under a grammar, or it is about to finish) is padded;
its padding columns are never accepted and the layouts roll every row back to its own accepted
length (`engine.kv.batch.rollback`, exact across a ring's wrap and for recurrent layers). A row
with no drafts gets exactly the token plain decoding would have drawn (same column-0 logits,
same counter RNG).
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from engine.spec.accept import (
    column_states,
    greedy_verdict_host,
    plain_greedy,
    record_ragged,
    verify,
)
from engine.spec.adaptive import Controller, ControllerConfig
from engine.spec.base import Drafter, Proposal, ProposeContext
from engine.spec.evalpoints import eval_points, every_from_env
from engine.spec.ringcommit import RingRound
from engine.spec.widekv import wide

# a greedy batch's verdict on the host and a lookup drafter's verify input built there (False:
# the device verdict of accept.verify; same tokens, bench/spec_round_host.py --ab times both)
HOST_VERDICT = True
PLAIN_HOLD = 15  # decide() re-decides a plain choice every PLAIN_HOLD + 1 steps
NOT_FOUND_HOLD = 3  # ... and every NOT_FOUND_HOLD + 1 steps when a lookup drafter found nothing
# the verify forward queues its work every N layers (engine/spec/evalpoints.py; 0: off)
EVAL_EVERY = every_from_env()


class SpecRows:
    """Per-row speculation state (struct of arrays), carried by `RunningBatch.spec`."""

    __slots__ = ("accepted", "judged", "drafter_state")

    def __init__(self, num_rows: int, drafter_state: Any) -> None:
        self.accepted = np.zeros(num_rows)  # decayed count of accepted drafts
        self.judged = np.zeros(num_rows)  # decayed count of drafts judged
        self.drafter_state = drafter_state

    def take(self, keep: list[int]) -> None:
        idx = np.asarray(keep, dtype=np.int64)
        self.accepted, self.judged = self.accepted[idx], self.judged[idx]
        if self.drafter_state is not None:
            self.drafter_state.take(keep)

    def concat(self, other: SpecRows) -> None:
        self.accepted = np.concatenate([self.accepted, other.accepted])
        self.judged = np.concatenate([self.judged, other.judged])
        if self.drafter_state is not None:
            self.drafter_state.concat(other.drafter_state)


@dataclass(slots=True)
class SpecStepResult:
    """Host outputs of a speculative step, per row (several tokens each)."""

    tokens: list[list[int]]
    logprobs: list[list[float]] | None = None
    top_logprobs: list[list[list[tuple[int, float]]]] | None = None


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


class SpecDecoder:
    def __init__(self, model: Any, drafter: Drafter, config: ControllerConfig) -> None:
        self.model = model
        self.drafter = drafter
        self.controller = Controller(config)
        # what an engine's first exploration cost, remembered for the next engine on this model
        self.controller.memory_key = (drafter.name, id(model))
        try:
            self.controller.memory_ref = weakref.ref(model)
        except TypeError:
            self.controller.memory_key = None
        if drafter.point_mass:
            self.controller.pooled_alpha = min(self.controller.pooled_alpha, 0.5)
            self.controller.lookup_evidence = True  # caps carry the lookup's offer
        if getattr(drafter, "catches_up", False):  # a probe first catches rows up: probe rarely
            config.probe_every = max(config.probe_every, 256)
        self.totals = _Totals()
        self._catch_up = False
        self._emitted = 1.0  # tokens per row of the last speculative step
        self._overhead_seen = 0.0  # drafter seconds outside the measured steps, already counted
        self._plain_hold = 0  # further decide() calls answered "plain" without re-deciding
        self._jump: tuple[Any, np.ndarray] | None = None  # (rows, caps) of a flat-cost jump
        self._plain_rows: list[Any] | None = None  # the batch's row list when it was decided
        self._contexts: tuple[Any, list[int], list[list[int]]] | None = None  # see _context
        self.warmup_seconds = 0.0  # warm_up(): the speculative shapes built at engine start
        self.warmup_ms: dict[int, float] = {}

    @property
    def max_draft(self) -> int:
        return self.controller.config.max_draft

    # -- rows ------------------------------------------------------------------------------
    def admit(self, rows: list[Any], batch_size: int = 0) -> SpecRows:
        """Spec state for rows leaving prefill into a batch of `batch_size` rows (a draft model
        prefills them now if speculation is on at that size, else on first use)."""
        warm = self.controller.warm(max(batch_size, len(rows)))
        prompts = [r.request.prompt_ids for r in rows]
        return SpecRows(len(rows), self.drafter.admit(prompts, warm))

    # -- choosing --------------------------------------------------------------------------
    def _caps(self, batch: Any, explore: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Per-row acceptance and draft ceilings. With `explore`, rows whose drafter lags far
        behind sit out (bar one) until speculation is known to pay at this batch size."""
        rows = batch.rows
        spec: SpecRows = batch.spec
        alpha = self.controller.alpha(spec.accepted, spec.judged)
        caps = self.controller.caps(alpha, _room(rows))
        for i, r in enumerate(rows):
            if r.constraint is not None:  # a grammar mask needs each token consumed first
                caps[i] = 0
        lag_of = getattr(self.drafter, "lag", None)
        warm = self.controller.warm(len(rows))
        if explore and lag_of is not None and caps.max(initial=0) > 0 and not warm:
            # until speculation is known to pay here, rows whose drafter state lags far behind
            # (admitted cold, or decoded plainly for long) sit out, bar one to measure with
            lag = lag_of(
                spec.drafter_state, [r.num_prompt_tokens + len(r.output_ids) for r in rows]
            )
            far = lag > self.drafter.max_merged
            if far.all():
                far[int(np.argmin(lag))] = False
            caps[far] = 0
        return alpha, caps

    def decide(self, batch: Any) -> int:
        """Verify width for this step (1 = plain decoding).

        While decoding plainly the choice is re-made every `PLAIN_HOLD` steps (or when the rows
        change or a probe is due), not every step: the decision is host work that a pipelined
        plain step would otherwise pay each time (on a GPU a plain step is ~1-2 ms of host
        work, and the choice moves only with the slowly changing costs and acceptance)."""
        if batch.spec is None or not len(batch):
            return 1
        ctl = self.controller
        rows = batch.rows  # a new list object whenever rows join or leave (take / concat)
        if self._plain_hold > 0 and rows is self._plain_rows and not ctl.probe_due(len(rows)):
            self._plain_hold -= 1
            return 1
        alpha, caps = self._caps(batch, explore=False)  # what the batch would gain when warm
        offer = None
        if self.drafter.point_mass and caps.max(initial=0) > 0:
            # the lookup's own offer up to the ceiling and the row's room (a long match is
            # evidence, long_match; the flat-cost jump drafts this much)
            ask = np.where(caps > 0, np.minimum(self.max_draft, _room(rows)), 0)
            offer = self._available(batch, ask)
            caps = np.minimum(caps, offer)
        decision = ctl.decide(alpha, caps, offer)
        # the flat-cost jump drafts the lookup's whole offer, beyond the rows' usual caps
        self._jump = (rows, decision.caps) if decision.jump else None
        # hold a choice made on costs; a lookup drafter that found nothing looks again soon
        found = not self.drafter.point_mass or caps.max(initial=0) > 0
        hold = decision.width == 1 and not decision.probe and ctl.config.adaptive
        self._plain_hold = (PLAIN_HOLD if found else NOT_FOUND_HOLD) if hold else 0
        self._plain_rows = rows
        return decision.width

    def _available(self, batch: Any, caps: np.ndarray) -> np.ndarray:
        ctx = self._context(batch, caps)
        available = getattr(self.drafter, "available", None)
        if available is not None:  # counts only (no device arrays on a plain step)
            return available(ctx)
        return self.drafter.propose(ctx).num_drafts

    def _context(self, batch: Any, caps: np.ndarray) -> ProposeContext:
        # prompt + output per row, built once per (row list, lengths): `decide` and the step
        # after it ask for the same contexts (a copy of every row's context each time, else)
        rows = batch.rows
        lengths = [len(r.output_ids) for r in rows]
        cached = self._contexts
        if cached is not None and cached[0] is rows and cached[1] == lengths:
            contexts = cached[2]
        else:
            contexts = [r.request.prompt_ids + r.output_ids for r in rows]
            self._contexts = (rows, lengths, contexts)
        return ProposeContext(
            contexts, caps, batch.next_tokens, batch.sampler, batch.spec.drafter_state
        )

    # -- the step --------------------------------------------------------------------------
    def step(self, batch: Any, width: int) -> SpecStepResult:
        """Draft, verify and accept for every row; the batch (caches, sampler, next tokens,
        drafter state) ends the step as if the accepted tokens had been decoded plainly."""
        t0 = time.perf_counter()
        alpha, caps = self._caps(batch)
        jump = self._jump
        if jump is not None and jump[0] is batch.rows and width > 1:
            caps = jump[1]  # decided this step for these rows (ControllerConfig.jump)
        ctx = self._context(batch, np.minimum(caps, width - 1))
        proposal = self._propose(ctx)
        K = int(proposal.tokens.shape[1])
        W = K + 1
        greedy = plain_greedy(batch.sampler)  # argmax of the raw logits: no per-column states
        host_path = greedy and HOST_VERDICT
        if not greedy:
            states = proposal.column_states or column_states(batch.sampler, proposal.tokens, W)
            while len(states) < W:
                states.append(states[-1].record(proposal.tokens[:, len(states) - 1]))
        # rings are written after the verdict (accepted columns only): no ring slack needed, so
        # the target's layouts are the plain engine's (engine/spec/ringcommit.py)
        ring_round = RingRound(batch.caches, W)
        host = proposal.host_tokens if HOST_VERDICT else None
        if host is not None:  # drafts on the host: the whole input goes over as one array
            nxt = np.fromiter((c[-1] for c in ctx.contexts), np.int32, len(ctx.contexts))
            inp = mx.array(np.concatenate([nxt[:, None], host[:, :K].astype(np.int32)], axis=1))
        else:
            drafts = proposal.tokens.astype(mx.int32)
            inp = mx.concatenate([batch.next_tokens[:, None], drafts], axis=1)
        logits = self.model(inp, cache=eval_points(wide(ring_round.model_caches), EVAL_EVERY))
        constrained = batch.constrained_rows()
        if constrained:
            from engine.runner import _mask_logits

            first = _mask_logits(logits[:, 0, :], constrained)
            logits = mx.concatenate([first[:, None], logits[:, 1:]], axis=1)
        if host_path:  # the verdict on the host: one argmax on the device, then numpy on [B, W]
            plain = mx.argmax(logits, axis=-1).astype(mx.int32)  # [B, W]
            extra = _logprobs(logits, plain, batch.sampler)
            reads = [plain, *[x for x in extra if x is not None]]
            mx.eval(*reads, *([proposal.tokens] if host is None and K else []))
            tokens = np.array(plain)
            drafts_np = host if host is not None else np.array(proposal.tokens)
            accepted, last = greedy_verdict_host(tokens, drafts_np, proposal.num_drafts)
            ring_round.finish(accepted + 1)
            num = mx.array(accepted.astype(np.int32) + 1)
            batch.sampler = record_ragged(batch.sampler, plain, num)
            batch.next_tokens = mx.array(last.astype(np.int32))
        else:
            num_drafts = mx.array(proposal.num_drafts.astype(np.int32))
            states = [batch.sampler] if greedy else states
            verdict = verify(logits, states, proposal.tokens, num_drafts, proposal.draft_logits)
            extra = _logprobs(logits, verdict.tokens, batch.sampler)
            mx.eval(verdict.num_accepted, verdict.tokens, *[x for x in extra if x is not None])
            accepted = np.array(verdict.num_accepted).astype(np.int64)
            tokens = np.array(verdict.tokens)
            ring_round.finish(accepted + 1)
            batch.sampler = record_ragged(batch.sampler, verdict.tokens, verdict.num_accepted + 1)
            batch.next_tokens = verdict.last
        # the ring commit and the state updates run while the host does the bookkeeping
        mx.async_eval(batch.next_tokens, *batch.arrays(), *_state_arrays(batch.sampler))
        if K:
            self.drafter.observe(ctx, proposal, accepted)
        self._learn(batch.spec, proposal.num_drafts, accepted)
        self._emitted = float(accepted.mean()) + 1.0 if len(accepted) else 1.0
        self._catch_up = bool(getattr(self.drafter, "caught_up", False)) and K > 0
        tot = self.totals
        tot.spec_steps += 1
        tot.width_sum += W
        tot.seconds_spec += time.perf_counter() - t0
        return _host_result(tokens, accepted, extra, batch.sampler)

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
        cfg = self.controller.config
        judged = accepted + (accepted < num_drafts)
        spec.accepted = cfg.decay * spec.accepted + accepted
        spec.judged = cfg.decay * spec.judged + judged
        self.controller.learn(num_drafts, accepted)
        tot = self.totals
        tot.drafted += int(num_drafts.sum())
        tot.accepted += int(accepted.sum())
        tot.emitted += int((accepted + 1).sum())
        tot.row_rounds += int((num_drafts > 0).sum())

    # -- warm-up ---------------------------------------------------------------------------
    def warm_up(self, new_caches: Any, vocab_size: int, prompt_len: int = 24) -> float:
        """One speculative round per verify width the controller can choose (2 .. ceiling + 1),
        on a throwaway one-row batch (its own caches, drafter state and sampler), greedy: on
        MLX-CUDA an engine's first rounds of each shape cost 40-550 ms (graphs and kernels set up
        per engine), paid here at load instead of while serving. Leaves nothing behind: the
        rows, caches and drafter state are dropped, and the statistics (totals, the controller's
        pooled acceptance, the drafter's counters) are restored. Returns the seconds taken."""
        from engine.api import Request, SamplingParams
        from engine.batch import RowMeta, RunningBatch
        from engine.sampling import SamplerState

        t0 = time.perf_counter()
        saved = (
            self.totals, self.controller.pooled_alpha, dict(vars(self.drafter)), self._emitted,
            self._catch_up,
        )
        drafter = self.drafter
        self.totals = _Totals()
        ms: dict[int, float] = {}
        try:
            # a repeating prompt (token ids 1..period, inside any vocabulary)
            period = max(1, min(16, vocab_size - 1))
            prompt = [1 + i % period for i in range(max(prompt_len, 2 * period))]
            K = self.max_draft
            params = SamplingParams(temperature=0.0, max_tokens=4 * (K + 2) * (K + 1))
            row = RowMeta(Request("spec-warmup", prompt, params), len(prompt),
                          params.max_tokens, frozenset())
            caches = new_caches(1)
            from engine import kvcache

            self.model(mx.array([prompt[:-1]], dtype=mx.int32), cache=caches)
            kvcache.eval_state(caches)
            sampler = SamplerState.from_params([params], [prompt], vocab_size, [0])
            spec = SpecRows(1, drafter.admit([prompt], True))
            spec.accepted[:] = spec.judged[:] = 1e3  # high acceptance: the ceiling's drafts
            batch = RunningBatch([row], mx.array([prompt[-1]], dtype=mx.int32), sampler, caches,
                                 spec)
            if drafter.point_mass:  # a lookup drafter: exactly W - 1 drafts whatever it finds
                self.drafter = _FixedDrafter(drafter)
            for width in range(2, K + 2):
                t1 = time.perf_counter()
                result = self.step(batch, width)
                mx.eval(batch.next_tokens, *batch.arrays())
                ms[width] = round((time.perf_counter() - t1) * 1e3, 2)
                row.output_ids.extend(result.tokens[0])
                row.num_generated += len(result.tokens[0])
        finally:
            self.drafter = drafter
            (self.totals, self.controller.pooled_alpha, state, self._emitted,
             self._catch_up) = saved
            vars(drafter).update(state)
        self.warmup_ms = ms
        self.warmup_seconds = time.perf_counter() - t0
        return self.warmup_seconds

    # -- timing and stats ------------------------------------------------------------------
    def record(self, num_rows: int, width: int, seconds: float, typical: bool) -> None:
        if width <= 1:
            self.totals.plain_steps += 1
        typical = typical and not (width > 1 and self._catch_up)
        self._catch_up = False
        self.controller.record(num_rows, width, seconds, typical, self._emitted if width > 1 else 1.0)
        if width > 1:  # draft prefill / catch-up since the last speculative step
            overhead = float(getattr(self.drafter, "prefill_seconds", 0.0)) + float(
                getattr(self.drafter, "catch_up_seconds", 0.0)
            )
            self.controller.add_overhead(overhead - self._overhead_seen)
            self._overhead_seen = overhead

    def stats(self) -> dict[str, Any]:
        tot = self.totals
        out: dict[str, Any] = {
            "num_draft_tokens": self.max_draft,
            "spec_steps": tot.spec_steps,
            "plain_steps": tot.plain_steps,
            "drafted_tokens": tot.drafted,
            "accepted_tokens": tot.accepted,
            "acceptance_rate": round(tot.accepted / tot.drafted, 4) if tot.drafted else None,
            "mean_verify_width": round(tot.width_sum / tot.spec_steps, 3)
            if tot.spec_steps
            else None,
            "tokens_per_row_round": (
                round((tot.accepted + tot.row_rounds) / tot.row_rounds, 3)
                if tot.row_rounds
                else None
            ),
        }
        out.update(self.controller.summary())
        out.update(self.drafter.stats())
        if self.warmup_ms:
            out["warmup_s"] = round(self.warmup_seconds, 3)
            out["warmup_ms_by_width"] = {str(w): v for w, v in self.warmup_ms.items()}
        return {self.drafter.name: out}


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


def _room(rows: list[Any]) -> np.ndarray:
    """[B] drafts each row has room for: tokens it may still generate, less the target's own."""
    return np.array([r.max_new_tokens - r.num_generated - 1 for r in rows], np.int64)


def _empty(B: int) -> Proposal:
    return Proposal(
        tokens=mx.zeros((B, 0), mx.int32),
        num_drafts=np.zeros(B, np.int64),
        host_tokens=np.zeros((B, 0), np.int32),
    )


def _state_arrays(state: Any) -> list[mx.array]:
    return [v for v in (getattr(state, f) for f in state.__slots__) if isinstance(v, mx.array)]


def _logprobs(
    logits: mx.array, tokens: mx.array, sampler: Any
) -> tuple[mx.array | None, mx.array | None, mx.array | None]:
    """Model logprobs (raw log-softmax) of each column's emitted token, and the top-K."""
    if not sampler.want_logprobs:
        return None, None, None
    raw = logits.astype(mx.float32)
    log_norm = mx.logsumexp(raw, axis=-1, keepdims=True)
    chosen = (mx.take_along_axis(raw, tokens[..., None], axis=-1) - log_norm)[..., 0]
    K = sampler.num_top_logprobs
    if K == 0:
        return chosen, None, None
    cand = mx.argpartition(-raw, K - 1, axis=-1)[..., :K]
    cand_lp = mx.take_along_axis(raw, cand, axis=-1) - log_norm
    order = mx.argsort(-cand_lp, axis=-1)
    top_ids = mx.take_along_axis(cand, order, axis=-1).astype(mx.int32)
    return chosen, top_ids, mx.take_along_axis(cand_lp, order, axis=-1)


def _host_result(
    tokens: np.ndarray, accepted: np.ndarray, extra: tuple[Any, Any, Any], sampler: Any
) -> SpecStepResult:
    counts = (accepted + 1).tolist()
    result = SpecStepResult(tokens=[tokens[b, :n].tolist() for b, n in enumerate(counts)])
    chosen, top_ids, top_lps = extra
    if chosen is not None:
        lp = np.array(chosen)
        result.logprobs = [lp[b, :n].tolist() for b, n in enumerate(counts)]
    if top_ids is not None and top_lps is not None:
        ids, lps = np.array(top_ids), np.array(top_lps)
        result.top_logprobs = [
            [list(zip(ids[b, j].tolist(), lps[b, j].tolist(), strict=True)) for j in range(n)]
            for b, n in enumerate(counts)
        ]
    return result
