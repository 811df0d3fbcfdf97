"""Who runs this step, and with how many tokens.

Queues: `waiting` (admitted, not started) → `prefill` (one group being prefilled, possibly over
several steps) → `running` (decoding, one token per row per step). Each step:

    plan   = scheduler.schedule()            # next prefill chunk (if any) + whether to decode
    result = runner.execute(plan, ...)        # forwards
    events = scheduler.update(plan, result)   # tokens out, finished rows dropped at once

A prefill group is either several short prompts that fit one chunk together (one right-padded
forward) or one long prompt prefilled alone in chunks of `prefill_chunk` tokens, so long
prompts interleave with the running decodes instead of stalling them. Prefill covers the prompt
minus its last token; the last token is the row's first decode input, so every sampled token
comes from the batched decode step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from engine import kvcache
from engine.api import FINISH_ABORT, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP, TokenEvent
from engine.batch import RowMeta, RunningBatch


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 128  # rows decoding at once
    prefill_chunk: int = 512  # columns per prefill forward
    prefill_budget: int = 2048  # rows x columns of prefill work per step
    max_queue: int = 1024  # waiting requests before new ones are refused


@dataclass(slots=True)
class PrefillGroup:
    rows: list[RowMeta]
    token_lists: list[list[int]]  # what goes through prefill: prompt[:-1] per row
    caches: kvcache.Caches
    done: int = 0  # columns already processed

    @property
    def width(self) -> int:
        return max((len(t) for t in self.token_lists), default=0)

    @property
    def finished(self) -> bool:
        return self.done >= self.width


@dataclass(slots=True)
class Plan:
    prefill: PrefillGroup | None = None
    prefill_end: int = 0  # process columns [prefill.done, prefill_end)
    decode: bool = False
    chunk: int = 0  # the widest prefill forward allowed now (a padded last chunk stays within)


@dataclass(slots=True)
class StepResult:
    """Host-side outputs of a decode step, one entry per running row (a list of entries per
    row after a speculative step: engine.spec.SpecStepResult has that shape)."""

    tokens: list[Any] = field(default_factory=list)
    logprobs: list[Any] | None = None
    top_logprobs: list[Any] | None = None


class Scheduler:
    def __init__(self, config: SchedulerConfig, make_caches):
        self.config = config
        self._make_caches = make_caches  # (num_rows) -> empty batch caches
        self.waiting: deque[RowMeta] = deque()
        self.prefill: PrefillGroup | None = None
        self.running = RunningBatch()
        # rows leaving prefill -> their speculation state (engine.spec; None: speculation off)
        self.admit_spec: Any = None
        self.prefix: Any = None  # engine.prefix.PrefixIndex, or None (prefix cache off)
        self.budget: Any = None  # engine.admission.MemoryBudget, or None (no admission control)

    # -- admission -------------------------------------------------------------------------
    def add(self, row: RowMeta) -> None:
        self.waiting.append(row)

    def has_work(self) -> bool:
        return bool(self.waiting) or self.prefill is not None or len(self.running) > 0

    def abort(self, req_id: str) -> RowMeta | None:
        """Remove a request wherever it is; returns its row if it was found."""
        for row in self.waiting:
            if row.req_id == req_id:
                self.waiting.remove(row)
                row.finished = True
                if self.prefix is not None:
                    self.prefix.forget(row)
                return row
        group = self.prefill
        if group is not None:
            for i, row in enumerate(group.rows):
                if row.req_id == req_id:
                    self._drop_from_prefill(i)
                    row.finished = True
                    return row
        i = self.running.index_of(req_id)
        if i is not None:
            row = self.running.rows[i]
            row.finished = True
            self.drop_finished()
            return row
        return None

    def _drop_from_prefill(self, i: int) -> None:
        group = self.prefill
        assert group is not None
        keep = [j for j in range(len(group.rows)) if j != i]
        if not keep:
            self.prefill = None
            return
        # A right-padded group mid-prefill cannot drop a row cheaply; groups of several rows
        # finish in one forward, so this only happens between steps on a finished-or-new group.
        kvcache.filter_rows(group.caches, keep)
        group.rows = [group.rows[j] for j in keep]
        group.token_lists = [group.token_lists[j] for j in keep]

    # -- planning --------------------------------------------------------------------------
    def schedule(self) -> Plan:
        if self.prefill is None:
            self.prefill = self._form_group()
        plan = Plan(decode=len(self.running) > 0)
        group = self.prefill
        if group is not None:
            plan.prefill = group
            plan.chunk = self._chunk()
            plan.prefill_end = min(group.width, group.done + plan.chunk)
        return plan

    def _chunk(self) -> int:
        """Prefill columns per forward (smaller with a prefix cache over sliding layers)."""
        return self.prefix.chunk if self.prefix is not None else self.config.prefill_chunk

    def _reserved_bytes(self) -> int:
        rows = self.running.rows + (self.prefill.rows if self.prefill is not None else [])
        return sum(self.budget.row_bytes(r.num_prompt_tokens, r.max_new_tokens) for r in rows)

    def _form_group(self) -> PrefillGroup | None:
        cfg = self.config
        room = cfg.max_num_seqs - len(self.running)
        chunk = self._chunk()
        rows: list[RowMeta] = []
        width = 0
        reserved = self._reserved_bytes() if self.budget is not None else 0
        while self.waiting and len(rows) < room:
            row = self.waiting[0]
            if self.prefix is not None:
                self.prefix.lookup(row)
            need = row.num_prompt_tokens - 1 - row.num_cached_tokens
            if self.budget is not None:
                extra = self.budget.row_bytes(row.num_prompt_tokens, row.max_new_tokens)
                if (rows or len(self.running)) and not self.budget.fits(reserved, extra, min(need, chunk)):
                    break  # wait until running rows finish and release their reservation
                reserved += extra
            if need > chunk:
                if rows:
                    break  # a long prompt goes alone, next time
                rows.append(self.waiting.popleft())
                break
            new_width = max(width, need)
            if rows and new_width * (len(rows) + 1) > cfg.prefill_budget:
                break
            rows.append(self.waiting.popleft())
            width = new_width
        if not rows:
            return None
        token_lists = [r.request.prompt_ids[r.num_cached_tokens : -1] for r in rows]
        if self.prefix is not None:
            caches = self.prefix.group_caches(rows)
        else:
            caches = self._make_caches(len(rows))
        return PrefillGroup(rows, token_lists, caches)

    # -- results ---------------------------------------------------------------------------
    def finish_prefill_step(self, plan: Plan, first_tokens: mx.array | None) -> None:
        """After the runner processed `plan`'s chunk: move a completed group into `running`."""
        group = plan.prefill
        if group is None:
            return
        group.done = plan.prefill_end
        if self.prefix is not None:
            self.prefix.store(group.rows, group.caches)
        if not group.finished:
            return
        self.prefill = None
        last = mx.array([r.request.prompt_ids[-1] for r in group.rows], dtype=mx.int32)
        from engine.sampling import SamplerState  # local: keeps import order obvious

        sampler = SamplerState.from_params(
            [r.request.params for r in group.rows],
            [r.request.prompt_ids for r in group.rows],
            self.vocab_size,
            [self._seed_of(r) for r in group.rows],
        )
        spec = self.admit_spec(group.rows) if self.admit_spec is not None else None
        self.running.concat(RunningBatch(group.rows, last, sampler, group.caches, spec))

    vocab_size: int = 0

    @staticmethod
    def _seed_of(row: RowMeta) -> int:
        seed = row.request.params.seed
        if seed is None:
            import random

            seed = random.getrandbits(32)
        return seed & 0xFFFFFFFF

    def finish_decode_step(self, rows: list[RowMeta], result: StepResult) -> list[TokenEvent]:
        """Turn one decode step (covering `rows`, as launched) into events; rows that finish
        leave the running batch at once. Rows already finished (aborted, or finished by the
        previous step while this one was in flight) are skipped.

        A row's entry in `result.tokens` is one token, or a list of them (a speculative step:
        accepted drafts, then the target's token); the list is cut at a stop token (not
        emitted) or at the row's max_new_tokens, exactly as if they had come one per step.
        """
        events: list[TokenEvent] = []
        for i, (row, token) in enumerate(zip(rows, result.tokens, strict=True)):
            if row.finished:
                continue
            event = self._row_event(row, result, i)
            events.append(event)
            row.finished = event.finish_reason is not None
        self.drop_finished()
        return events

    def _row_event(self, row: RowMeta, result: StepResult, i: int) -> TokenEvent:
        params = row.request.params
        multi = isinstance(result.tokens[i], list)
        tokens = result.tokens[i] if multi else [result.tokens[i]]
        finish = None
        ids: list[int] = []
        for token in tokens:
            if token in row.stop_ids:
                finish = FINISH_STOP
                break
            ids.append(token)
            row.output_ids.append(token)
            row.num_generated += 1
            if row.constraint is not None:
                finish = _advance_constraint(row, token)
            if row.num_generated >= row.max_new_tokens:
                finish = finish or FINISH_LENGTH
            if finish is not None:
                break
        event = TokenEvent(
            req_id=row.req_id,
            token_ids=ids,
            finish_reason=finish,
            num_prompt_tokens=row.num_prompt_tokens,
            num_cached_tokens=row.num_cached_tokens,
        )
        if params.logprobs and ids and result.logprobs is not None:
            lps = result.logprobs[i] if multi else [result.logprobs[i]]
            event.logprobs = lps[: len(ids)]
            if params.top_logprobs and result.top_logprobs is not None:
                tops = result.top_logprobs[i] if multi else [result.top_logprobs[i]]
                event.top_logprobs = [t[: params.top_logprobs] for t in tops[: len(ids)]]
        if finish == FINISH_ERROR:
            event.error = f"constrained decoding failed: {row.constraint.error or 'token rejected'}"
        return event

    def drop_finished(self) -> None:
        running = self.running
        if any(r.finished for r in running.rows):
            running.take([i for i, r in enumerate(running.rows) if not r.finished])

    def abort_event(self, row: RowMeta, reason: str = FINISH_ABORT) -> TokenEvent:
        return TokenEvent(
            req_id=row.req_id,
            token_ids=[],
            finish_reason=reason,
            num_prompt_tokens=row.num_prompt_tokens,
            num_cached_tokens=row.num_cached_tokens,
        )


def _advance_constraint(row: RowMeta, token: int) -> str | None:
    """Feed the sampled token to the row's grammar: "stop" once the grammar is complete."""
    if not row.constraint.consume(token):
        return FINISH_ERROR  # the mask should make this impossible
    return FINISH_STOP if row.constraint.is_done() else None
