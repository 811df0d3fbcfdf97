"""Who runs this step, and with how many tokens.

Queues: `waiting` (admitted, not started) → `prefill` (one group being prefilled, possibly over
several steps) → `running` (decoding). Each step:

    plan   = scheduler.schedule()            # next prefill chunk, and who joins the batch
    result = runner.run(plan)                # forwards (engine.runner)
    events = scheduler.update(plan, result)  # tokens out, finished rows dropped at once

A prefill group is either several short prompts that fit one chunk together (one right-padded
forward) or one long prompt prefilled alone in chunks of `prefill_chunk` tokens, so long
prompts interleave with the running decodes instead of stalling them. Prefill covers the prompt
minus its last token; the last token is the row's first decode input, so every sampled token
comes from the batched decode step. A group joins the running batch in the step its prefill
completes, and decodes in that same step.

The running batch (with the rows that join it) decodes every step; how many tokens per row is
the executor's question to the speculation (engine.runner).
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

import mlx.core as mx

from engine.api import FINISH_ABORT, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP, TokenEvent
from engine.batch import RowMeta, RunningBatch
from engine.kv.memory import MemoryBudget
from engine.kv.prefix_cache import NoPrefix, PrefixIndex
from engine.sampling import SamplerState
from engine.spec.decoder import NoSpec, Speculation


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 128  # rows decoding at once
    prefill_chunk: int = 512  # columns per prefill forward
    prefill_budget: int = 2048  # rows x columns of prefill work per step
    max_queue: int = 1024  # waiting requests before new ones are refused


@dataclass(slots=True)
class PrefillGroup:
    """Rows being prefilled together, as the batch they will join `running` as."""

    batch: RunningBatch  # rows, last prompt tokens, sampler and spec state, the caches filled
    token_lists: list[list[int]]  # what goes through prefill: prompt[cached:-1] per row
    done: int = 0  # columns already processed

    @property
    def rows(self) -> list[RowMeta]:
        return self.batch.rows

    @property
    def caches(self) -> list:
        assert self.batch.caches is not None
        return self.batch.caches

    @property
    def width(self) -> int:
        return max((len(t) for t in self.token_lists), default=0)

    @property
    def finished(self) -> bool:
        return self.done >= self.width


@dataclass(slots=True)
class Plan:
    batch: RunningBatch  # the running batch
    prefill: PrefillGroup | None = None
    prefill_end: int = 0  # process columns [prefill.done, prefill_end)
    join: RunningBatch | None = None  # joins `batch` after the chunk (its prefill is complete)


@dataclass(slots=True)
class StepResult:
    """Host outputs of a step, per row of `rows` (the rows it covered, as launched): the tokens
    it produced (accepted drafts, then the target's token), and their logprobs when asked."""

    rows: list[RowMeta] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] | None = None
    top_logprobs: list[list[list[tuple[int, float]]]] | None = None
    errors: dict[int, str] = field(default_factory=dict)  # row index -> why the row failed
    width: int = 0  # the decode this step ran: 0 none, 1 plain, k + 1 a verify of k drafts


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        make_caches,
        vocab_size: int,
        budget: MemoryBudget,
        prefix: PrefixIndex | NoPrefix | None = None,
        spec: Speculation | NoSpec | None = None,
    ):
        self.config = config
        self.vocab_size = vocab_size
        self.budget = budget
        self.prefix = prefix or NoPrefix(make_caches, config.prefill_chunk)
        self.spec = spec or NoSpec()
        self.waiting: deque[RowMeta] = deque()
        self.prefill: PrefillGroup | None = None
        self.running = RunningBatch()
        self._failed: list[TokenEvent] = []  # rows failed while planning, out with the next update

    # -- admission -------------------------------------------------------------------------
    def add(self, row: RowMeta) -> None:
        self.waiting.append(row)

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefill or len(self.running) or self._failed)

    def abort(self, req_id: str) -> RowMeta | None:
        """Remove a request wherever it is; returns its row if it was found."""
        for row in self.waiting:
            if row.req_id == req_id:
                self.waiting.remove(row)
                row.finished = True
                self.prefix.forget(row)
                return row
        group = self.prefill
        if group is not None:
            for i, row in enumerate(group.rows):
                if row.req_id == req_id:
                    self._drop_from_prefill(i)
                    row.finished = True
                    return row
        at = self.running.index_of(req_id)
        if at is not None:
            row = self.running.rows[at]
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
        group.batch.take(keep)
        group.token_lists = [group.token_lists[j] for j in keep]

    # -- planning --------------------------------------------------------------------------
    def schedule(self) -> Plan:
        if self.prefill is None:
            self.prefill = self._form_group()
        plan = Plan(self.running)
        group = self.prefill
        if group is not None:
            plan.prefill = group
            plan.prefill_end = min(group.width, group.done + self.prefix.chunk)
            if plan.prefill_end >= group.width:
                plan.join = group.batch
        return plan

    def _reserved_bytes(self) -> int:
        rows = self.running.rows + (self.prefill.rows if self.prefill is not None else [])
        return sum(self.budget.row_bytes(r.num_prompt_tokens, r.max_new_tokens) for r in rows)

    def _form_group(self) -> PrefillGroup | None:
        cfg = self.config
        room = cfg.max_num_seqs - len(self.running)
        chunk = self.prefix.chunk
        rows: list[RowMeta] = []
        width = 0
        reserved = self._reserved_bytes()
        while self.waiting and len(rows) < room:
            row = self.waiting[0]
            self.prefix.lookup(row)
            need = row.num_prompt_tokens - 1 - row.num_cached_tokens
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
        rows, sampler = self._sampler_for(rows)
        if not rows:
            return None
        token_lists = [r.request.prompt_ids[r.num_cached_tokens : -1] for r in rows]
        last = mx.array([r.request.prompt_ids[-1] for r in rows], dtype=mx.int32)
        spec = self.spec.admit(rows, len(self.running) + len(rows))
        caches = self.prefix.group_caches(rows)
        return PrefillGroup(RunningBatch(rows, last, sampler, caches, spec), token_lists)

    def _sampler_for(self, rows: list[RowMeta]) -> tuple[list[RowMeta], SamplerState | None]:
        """The rows' sampler state; a row whose settings it refuses (a token id outside the
        vocabulary) fails alone, with its message, and the others go on."""
        try:
            return rows, self._sampler(rows) if rows else None
        except ValueError:
            pass
        good = []
        for row in rows:
            try:
                self._sampler([row])
                good.append(row)
            except ValueError as exc:
                self.prefix.forget(row)
                row.finished = True
                self._failed.append(self.abort_event(row, FINISH_ERROR, f"invalid request: {exc}"))
        return good, self._sampler(good) if good else None

    def _sampler(self, rows: list[RowMeta]) -> SamplerState:
        return SamplerState.from_params(
            [r.request.params for r in rows],
            [r.request.prompt_ids for r in rows],
            self.vocab_size,
            [_seed_of(r) for r in rows],
        )

    # -- results ---------------------------------------------------------------------------
    def update(self, plan: Plan, result: StepResult) -> list[TokenEvent]:
        """Turn a step's result into events; rows that finish leave the running batch at once.
        Rows already finished (aborted, or finished by the previous step while this one was in
        flight) are skipped. A row's tokens are cut at a stop token (not emitted), at its
        max_new_tokens or where its grammar ends, exactly as if they had come one per step."""
        group = plan.prefill
        if group is not None:
            group.done = plan.prefill_end
            if group.finished:  # its rows joined the running batch in this step
                self.prefill = None
        events, self._failed = self._failed, []
        for i, row in enumerate(result.rows):
            if row.finished:
                continue
            error = result.errors.get(i)
            if error is None:
                event = self._row_event(row, result, i)
            else:  # the row's grammar failed while its mask was built
                event = self.abort_event(row, FINISH_ERROR, f"constrained decoding failed: {error}")
            events.append(event)
            row.finished = event.finish_reason is not None
            if event.finish_reason in (FINISH_STOP, FINISH_LENGTH) and event.error is None:
                self._store_finished(row, result.tokens[i], len(event.token_ids))
        self.prefix.advance(self.running.rows, self.running.caches)
        self.drop_finished()
        return events

    def _store_finished(self, row: RowMeta, step_tokens: list[int], emitted: int) -> None:
        """A row that ended normally leaves its whole sequence in the prefix cache (the next
        turn of a conversation re-sends it), including the stop token it ended on. Aborted and
        failed rows store nothing beyond their prompt."""
        at = self.running.index_of(row.req_id)
        if at is None or self.running.caches is None:
            return
        tail = step_tokens[emitted : emitted + 1]
        if not tail or tail[0] not in row.stop_ids:
            tail = []
        self.prefix.finish(row, self.running.caches, at, tail)

    def _row_event(self, row: RowMeta, result: StepResult, i: int) -> TokenEvent:
        params = row.request.params
        finish = None
        error = None
        ids: list[int] = []
        for token in result.tokens[i]:
            if token in row.stop_ids:
                finish = FINISH_STOP
                break
            ids.append(token)
            row.output_ids.append(token)
            row.num_generated += 1
            if row.constraint is not None:
                finish, error = _advance_constraint(row, token)
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
            error=error,
        )
        if params.logprobs and ids and result.logprobs is not None:
            event.logprobs = result.logprobs[i][: len(ids)]
            if params.top_logprobs and result.top_logprobs is not None:
                tops = result.top_logprobs[i][: len(ids)]
                event.top_logprobs = [t[: params.top_logprobs] for t in tops]
        return event

    def drop_finished(self) -> None:
        running = self.running
        if any(r.finished for r in running.rows):
            running.take([i for i, r in enumerate(running.rows) if not r.finished])

    def abort_event(self, row: RowMeta, reason: str = FINISH_ABORT, error: str | None = None) -> TokenEvent:
        return TokenEvent(
            req_id=row.req_id,
            token_ids=[],
            finish_reason=reason,
            num_prompt_tokens=row.num_prompt_tokens,
            num_cached_tokens=row.num_cached_tokens,
            error=error,
        )


def _seed_of(row: RowMeta) -> int:
    seed = row.request.params.seed
    if seed is None:
        seed = random.getrandbits(32)
    return seed & 0xFFFFFFFF


def _advance_constraint(row: RowMeta, token: int) -> tuple[str | None, str | None]:
    """Feed the sampled token to the row's grammar: (finish reason, error). "stop" once the
    grammar is complete; "error" when it rejects the token (the mask should make that
    impossible) or the grammar engine fails."""
    constraint = row.constraint
    try:
        if not constraint.consume(token):
            return FINISH_ERROR, f"constrained decoding failed: {constraint.error or 'token rejected'}"
        return (FINISH_STOP if constraint.is_done() else None), None
    except Exception as exc:  # noqa: BLE001 - a grammar engine failure ends this row only
        return FINISH_ERROR, f"constrained decoding failed: {type(exc).__name__}: {exc}"
