"""Who runs this step, and with how many tokens.

Queues: `waiting` (admitted, not started) → `prefill` (one group being prefilled, possibly over
several steps) → `running` (decoding). Each step:

    plan   = scheduler.schedule()            # next prefill chunk, and who joins the batch
    result = runner.run(plan)                # forwards (engine.runner)
    events = scheduler.update(plan, result)  # tokens out, finished rows dropped at once

A prefill group is either several short prompts that fit one chunk together (one
right-padded forward) or one long prompt (longer than `prefill_chunk`) prefilled alone in
chunks, so long prompts interleave with the running decodes instead of stalling them. A long
prompt's chunk (`step_chunk`) is what the device prefills in about `prefill_step_s` at the rate
measured at start-up: while rows decode the prefill budget in columns (`busy_chunk`, so a
decoding row's next token is late by about that much), while none do `idle_chunk`; both at
least `prefill_chunk`, at most what the prefix cache's layouts allow
(`PrefixIndex.max_chunk`), on block boundaries. Prefill covers the
whole prompt (less its cached prefix; the prefix cache never holds a whole prompt, so at least
its last token runs): a group's last chunk samples each row's first token from the logits at
its last prompt token, and the step reports it. The group joins the running batch in that
step and decodes its second token in the same step (plainly: a verify waits for the next).

Which prompts start, and when (`_next_group`, `_order`, `_pick`):

* Order: shortest prompt first (then priority, then arrival), except that a request which later
  requests have passed in `max_passed` steps is overdue and goes first (overdue ones first come
  first served), and nothing later passes an overdue request that cannot start yet. So no
  request is passed in more than `max_passed` steps, and short prompts do not queue behind long
  ones.
* Interleaving: while a long prompt is being prefilled, at most one group of short prompts runs
  between two of its chunks: a short prompt arriving then starts within two steps, and the long
  one's prefill takes at most twice its number of chunks in steps. One long prompt at a time.
* Budget: a group of short prompts holds at most `prefill_budget` rows x columns of prefill
  (`idle_budget_factor` times that when no rows are decoding: nobody's next token waits on
  it). `prefill_budget=None` (the default) is sized at start-up by `auto_prefill_budget` from
  the prefill rate the runner's warm-up measures: the prefill work of one step costs about
  `prefill_step_s` (200 ms), so a decoding row's next token is late by about that much, at least
  one chunk and at most 16. Not less: every step also decodes the running rows, so a smaller
  budget pays that decode more often per prompt (the measured trade: docs/architecture.md).

Memory (`_admits`, engine.kv.memory): a row starts only while the weights, the KV of every
admitted row at its longest (one batch: rows as wide as the longest, in 256-column steps, at the
KV's bits), the prefix cache and a step's activations fit `--memory-budget`; least recently used
prefix-cache blocks are evicted to make that so (never those the group's own hits restore), and
after every step the prefix cache is told what it may hold (`set_room`). A row that does not
fit waits for rows to finish; alone it always starts (a request that cannot fit alone was a
413 when it came in).

The running batch (with the rows that join it) decodes every step; how many tokens per row is
the executor's question to the speculation (engine.runner).
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.api import FINISH_ABORT, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP, TokenEvent
from engine.batch import RowMeta, RunningBatch, compact_order
from engine.kv import batch as kvb
from engine.kv.memory import MemoryBudget
from engine.kv.prefix_cache import NoPrefix, PrefixIndex
from engine.sampling import SamplerState
from engine.spec.decoder import NoSpec, Speculation


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 128  # rows decoding at once
    prefill_chunk: int = 512  # columns per prefill forward
    # rows x columns of prefill work per step; None = auto: sized at start-up from the measured
    # prefill rate (`auto_prefill_budget`)
    prefill_budget: int | None = None
    max_queue: int = 1024  # waiting requests before new ones are refused
    prefill_step_s: float = 0.2  # auto budget: one step's prefill work costs about this long
    idle_budget_factor: int = 4  # no rows decoding: a prefill group may be this many budgets
    max_passed: int = 4  # steps in which later requests may start before a waiting one


DEFAULT_PREFILL_BUDGET = 2048  # until the start-up measurement sets the auto budget
MAX_BUDGET_CHUNKS = 16  # the auto budget is at most this many chunks


def auto_prefill_budget(tokens_per_s: float, chunk: int, step_s: float) -> int:
    """Rows x columns of prefill per step such that the step's prefill costs about `step_s` at
    the measured prefill rate (the decode rows' next token is late by that much), at least one
    chunk (a long prompt always advances) and at most `MAX_BUDGET_CHUNKS` chunks, rounded down
    to a multiple of 16 columns."""
    budget = int(tokens_per_s * step_s) // 16 * 16
    return max(chunk, min(budget, MAX_BUDGET_CHUNKS * chunk))


@dataclass(slots=True)
class PrefillGroup:
    """Rows being prefilled together, as the batch they will join `running` as."""

    batch: RunningBatch  # rows, sampler and spec state, the caches filled
    token_lists: list[list[int]]  # what goes through prefill: prompt[cached:] per row
    done: int = 0  # columns already processed
    chunk: int = 0  # the most columns one step of it runs (its activations were admitted)

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
        self.prefill_budget = config.prefill_budget or DEFAULT_PREFILL_BUDGET
        # a long prompt's chunk while no rows decode: `prefill_chunk` until the start-up
        # measurement sizes it (`size_idle_chunk`)
        self.idle_chunk = self.prefix.chunk
        if isinstance(self.spec, Speculation):  # a verify step writes its drafts' columns too
            budget.max_draft = self.spec.max_draft
        self._passed: dict[str, int] = {}  # waiting req_id -> steps in which later ones started
        self._interleaved = False  # the last step ran a short group between a long one's chunks
        self._failed: list[TokenEvent] = []  # rows failed while planning, out with the next update
        self._picked_chunk = 0  # `_pick`: the most columns a step of the group it picked runs

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
                self._passed.pop(req_id, None)
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
        group = self._next_group()
        plan = Plan(self.running)
        if group is not None:
            plan.prefill = group
            cols = max(self.prefix.chunk, min(group.chunk, self.step_chunk()))
            plan.prefill_end = min(group.width, group.done + cols)
            if plan.prefill_end >= group.width:
                plan.join = group.batch
        # the prefix cache's inserts during this step leave room for what this step holds
        self._give_prefix_room(group if group is not None and group is not self.prefill else None)
        return plan

    def _next_group(self) -> PrefillGroup | None:
        """The group whose chunk this step runs. A long prompt in progress (`self.prefill`)
        alternates with groups of short prompts formed from the queue: at most one short group
        between two of its chunks, so short prompts never wait for a long one's whole prefill
        and the long one's prefill takes at most twice its chunks in steps."""
        started = self.prefill
        if started is None:
            self._interleaved = False
            self.prefill = self._form_group(long_ok=True)
            return self.prefill
        if self._interleaved:
            self._interleaved = False
            return started
        short = self._form_group(long_ok=False)
        self._interleaved = short is not None
        return short or started

    def _order(self) -> list[RowMeta]:
        """Waiting rows in the order they may start: first those later requests have already
        passed in `max_passed` steps (overdue, first come first served), then the rest by
        priority, prompt length (shortest first: the least prefill delays the fewest requests)
        and arrival. A request is thus passed in at most `max_passed` steps."""
        bound = self.config.max_passed
        overdue = [r for r in self.waiting if self._passed.get(r.req_id, 0) >= bound]
        rest = [(i, r) for i, r in enumerate(self.waiting) if self._passed.get(r.req_id, 0) < bound]
        rest.sort(key=lambda ir: (ir[1].request.priority, ir[1].num_prompt_tokens, ir[0]))
        return overdue + [r for _, r in rest]

    def _group_budget(self) -> int:
        """Rows x columns a new group may prefill: the budget, times `idle_budget_factor` when
        no rows are decoding (nobody's next token waits on this step)."""
        if len(self.running):
            return self.prefill_budget
        return self.prefill_budget * self.config.idle_budget_factor

    def step_chunk(self) -> int:
        """Columns a long prompt's prefill runs this step: `busy_chunk` while rows decode,
        `idle_chunk` while none do."""
        return self.busy_chunk() if len(self.running) else self.idle_chunk

    def busy_chunk(self) -> int:
        """A long prompt's chunk while rows decode: the prefill budget in columns (what one
        step's prefill may cost the decoding rows), at most the prefix cache's `max_chunk`, on
        its block boundaries, at least `prefill_chunk`."""
        return self._chunk_within_layouts(self.prefill_budget)

    def _chunk_within_layouts(self, cols: int) -> int:
        """`cols` as a long prompt's chunk: at most the prefix cache's `max_chunk`, rounded
        down to its block size (times its `hit_blocks`), at least `prefill_chunk`."""
        prefix = self.prefix
        granule = prefix.block_size * prefix.hit_blocks
        cols = min(cols, prefix.max_chunk) // granule * granule
        return max(prefix.chunk, cols)

    def size_idle_chunk(self, tokens_per_s: float) -> None:
        """`idle_chunk` from the measured prefill rate: what the device prefills in
        `prefill_step_s`, at least `prefill_chunk`, at most the prefix cache's `max_chunk`, a
        multiple of its block size. (On a CPU, whose attention is not fused, that stays at
        about `prefill_chunk`: longer chunks cost more per token there.)"""
        cols = int(tokens_per_s * self.config.prefill_step_s)
        self.idle_chunk = self._chunk_within_layouts(cols)

    def chunk_widths(self) -> list[int]:
        """The chunk widths long prompts run at past `prefill_chunk` (the busy and the idle
        one, where they are wider)."""
        return sorted({w for w in (self.busy_chunk(), self.idle_chunk) if w > self.prefix.chunk})

    def _pick(self, long_ok: bool) -> list[RowMeta]:
        """The next group's rows in `_order`: one long prompt alone (only when `long_ok`: no
        long one is in progress), or short ones up to the group budget, while their memory
        fits (`_admits`). An overdue row that cannot start now (no room, no memory, a long one
        while another is in progress) stops the group: nothing later passes it."""
        cfg = self.config
        started = len(self.prefill.rows) if self.prefill is not None else 0
        room = cfg.max_num_seqs - len(self.running) - started
        chunk, budget = self.prefix.chunk, self._group_budget()
        rows: list[RowMeta] = []
        width = 0
        admitted = self._row_tokens(self._admitted())
        for row in self._order():
            if len(rows) >= room:
                break
            overdue = self._passed.get(row.req_id, 0) >= cfg.max_passed
            self.prefix.lookup(row)
            long = _need(row) > chunk
            cols = 0
            if not (long and (rows or not long_ok)
                    or rows and max(width, _need(row)) * (len(rows) + 1) > budget):
                cols = self._admits(rows, row, admitted, self.step_chunk() if long else chunk)
            if not cols:
                if overdue or not long:
                    break  # shortest first: what follows is no shorter
                continue  # a long one waits for the long slot; shorter ones may go
            rows.append(row)
            self._picked_chunk = cols
            width = max(width, _need(row))  # `_admits` may have dropped the row's prefix hit
            if _need(row) > chunk:
                break
        return rows

    # -- memory ----------------------------------------------------------------------------
    def _admitted(self) -> list[RowMeta]:
        return self.running.rows + (self.prefill.rows if self.prefill is not None else [])

    def _row_tokens(self, rows: list[RowMeta]) -> list[int]:
        return [self.budget.row_tokens(r.num_prompt_tokens, r.max_new_tokens) for r in rows]

    def kv_reserved(self, extra: Sequence[RowMeta] = ()) -> int:
        """KV the admitted rows (running, prefilling) and `extra` will allocate at their longest:
        one batch, every row as wide as the longest (engine.kv.memory); and the running
        batch's free slots."""
        return self._kv_held(self._row_tokens([*self._admitted(), *extra]))

    def _kv_held(self, tokens: list[int]) -> int:
        """KV rows of these `_row_tokens` allocate at their longest, plus the running batch's
        free slots."""
        return self.budget.kv_bytes(tokens) + kvb.spare_bytes(self.running.caches)

    def reserved_bytes(self) -> int:
        """Memory held or promised besides the weights: the admitted rows' KV at their longest
        and the prefix cache's blocks."""
        return self.kv_reserved() + self.prefix.nbytes

    def _prefill_transient(self, rows: Sequence[RowMeta], chunk: int) -> int:
        """Activations of the costliest chunk (at most `chunk` columns) a group of these rows
        runs: its last, whose queries attend to the whole prompt."""
        if not rows:
            return 0
        cols = min(max(_need(r) for r in rows), chunk)
        return self.budget.transient(len(rows) * cols, max(r.num_prompt_tokens for r in rows))

    def _step_transient(self, group: Sequence[RowMeta], tokens: list[int], chunk: int) -> int:
        """Activations of a step: a prefill chunk (the long prompt in progress or `group`,
        whichever costs more), the decode of every admitted row at its longest (`tokens`: the
        columns each admitted row and each row of `group` may reach; `chunk`: the most columns
        a step of `group` runs), and the copies attention reads quantized KV through."""
        decode = self.budget.transient(len(tokens), max(tokens, default=0))
        started = self.prefill
        ongoing = self._prefill_transient(started.rows, started.chunk) if started else 0
        prefill = max(ongoing, self._prefill_transient(group, chunk))
        return decode + prefill + self.budget.read_bytes(tokens)

    def _free(self, group: Sequence[RowMeta] = (), admitted: list[int] | None = None,
              chunk: int | None = None) -> int:
        """What the weights, the KV of the admitted rows and `group`, and a step's activations
        leave of the budget: the most the prefix cache may hold. `admitted`: the admitted
        rows' `_row_tokens`, when the caller has them; `chunk`: the most columns a step of
        `group` runs (default `step_chunk`)."""
        if admitted is None:
            admitted = self._row_tokens(self._admitted())
        if chunk is None:
            chunk = self.step_chunk()
        tokens = admitted + self._row_tokens(list(group))
        held = self.budget.weights + self.budget.others + self.budget.side + self._kv_held(tokens)
        return self.budget.budget - held - self._step_transient(group, tokens, chunk)

    def _admits(self, picked: list[RowMeta], row: RowMeta, admitted: list[int], chunk: int) -> int:
        """Whether `row` may join the group `picked` now: its KV and activations fit next to
        what is admitted (`admitted`: those rows' `_row_tokens`), once least recently used
        prefix-cache blocks are evicted (never the blocks the group's own hits restore). Alone
        (nothing else admitted) it always starts, its own hit given up if that is what it
        takes: it fits the budget by itself (`MemoryBudget.fits_alone`, checked when the
        request came in, with `prefill_chunk`-column steps).

        Returns the most columns a step of the group may run: `chunk`, or for a row alone
        `prefill_chunk` when only that fits; 0 when the row does not fit now."""
        group = [*picked, row]
        least = self.prefix.chunk
        for cols in dict.fromkeys((chunk,) if picked else (chunk, least)):
            if self.prefix.make_room(self._free(group, admitted, cols), group):
                return cols
        if picked or admitted:
            return 0  # it waits; the rows that finish give their memory back
        self.prefix.drop_hit(row)
        self.prefix.make_room(max(0, self._free(group, admitted, least)))
        return least

    def _give_prefix_room(self, group: PrefillGroup | None = None) -> None:
        """Tell the prefix cache what it may hold until the next step: what the budget leaves
        (`_free`, with `group`: a group that starts this step) less one prefill chunk's
        activations, so that work between steps (an embedding batch) or a new short prompt
        finds room without evicting."""
        chunk = self.prefix.chunk
        free = self._free(group.rows, chunk=group.chunk) if group is not None else self._free()
        self.prefix.set_room(free - self.budget.transient(chunk, chunk))

    def _form_group(self, long_ok: bool = True) -> PrefillGroup | None:
        picked = self._pick(long_ok)
        if not picked:
            return None
        self._take_waiting(picked)
        rows, sampler = self._sampler_for(picked)
        if not rows:
            return None
        token_lists = [r.request.prompt_ids[r.num_cached_tokens :] for r in rows]
        spec = self.spec.admit(rows, len(self.running) + len(rows))
        caches = self.prefix.group_caches(rows)
        batch = RunningBatch(rows, None, sampler, caches, spec)
        return PrefillGroup(batch, token_lists, chunk=self._picked_chunk)

    def _take_waiting(self, picked: list[RowMeta]) -> None:
        """Move `picked` off the queue; every row still waiting that arrived before one of them
        has been passed once more (this step)."""
        ids = {r.req_id for r in picked}
        now = time.perf_counter()
        for row in picked:
            row.started_at = now
        latest = max(i for i, r in enumerate(self.waiting) if r.req_id in ids)
        keep: deque[RowMeta] = deque()
        for i, row in enumerate(self.waiting):
            if row.req_id in ids:
                self._passed.pop(row.req_id, None)
                continue
            if i < latest:
                self._passed[row.req_id] = self._passed.get(row.req_id, 0) + 1
            keep.append(row)
        self.waiting = keep
        if len(self._passed) > len(keep):  # rows that left the queue otherwise (a failed step)
            waiting = {r.req_id for r in keep}
            self._passed = {k: v for k, v in self._passed.items() if k in waiting}

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
            if group.finished and group is self.prefill:  # its rows joined the batch this step
                self.prefill = None
        events, self._failed = self._failed, []
        events += self.row_events(result)
        self.prefix.advance(self.running.rows, self.running.caches)
        self.drop_finished()
        self._give_prefix_room()  # finished rows gave their KV back
        return events

    def row_events(self, result: StepResult) -> list[TokenEvent]:
        """The events of `result`'s rows (`update`; the runner's early first tokens, before
        the rows join the batch, on their own)."""
        events = []
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
        first = row.num_generated == 0
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
        if finish is not None:
            event.accepted_prediction = row.accepted_prediction
        if first and ids and row.started_at:
            event.queue_s = max(0.0, row.started_at - row.queued_at) if row.queued_at else None
            event.prefill_s = time.perf_counter() - row.started_at
        if params.logprobs and ids and result.logprobs is not None:
            event.logprobs = result.logprobs[i][: len(ids)]
            if params.top_logprobs and result.top_logprobs is not None:
                tops = result.top_logprobs[i][: len(ids)]
                event.top_logprobs = [t[: params.top_logprobs] for t in tops]
        return event

    def drop_finished(self) -> None:
        running = self.running
        drop = {i for i, r in enumerate(running.rows) if r.finished}
        if drop:
            running.take(compact_order(len(running.rows), drop))

    def abort_event(self, row: RowMeta, reason: str = FINISH_ABORT, error: str | None = None) -> TokenEvent:
        return TokenEvent(
            req_id=row.req_id,
            token_ids=[],
            finish_reason=reason,
            num_prompt_tokens=row.num_prompt_tokens,
            num_cached_tokens=row.num_cached_tokens,
            error=error,
        )


def _need(row: RowMeta) -> int:
    """Prompt tokens the row's prefill runs: all but the cached prefix (at least one)."""
    return row.num_prompt_tokens - row.num_cached_tokens


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
