"""A small draft model (same tokenizer) proposes k tokens per row, k batched one-token steps.

The draft keeps its own batched KV (our engine/kv layouts, one list per model, built by
`engine.models.make_batch_layouts`), carried by the running batch so it follows the target's
rows through merge/extend and filter, and rolled back per row after verification.

Invariant: the draft's KV holds a prefix of each row's context; `pending = context[n_draft:]`
(at least the next input token) is fed at the start of the next proposal. After a round in
which row b accepted `a` of its drafts, the draft keeps the pending tokens plus
`min(a, K - 1)` drafts (it never fed its own last draft d_K), so the next round's pending is
at most 2 tokens (`d_K`, bonus) and goes in as a right-padded first step (up to `MAX_MERGED`
tokens do, e.g. after a two-step plain probe). More pending tokens (the row decoded plainly
while speculation was off, or its draft prefill was deferred) are caught up first, outside the
checkpoint, in one right-padded forward (chunked).

Worked example (K = 3): context ends with next input x; the draft holds everything before x.
Round: feed [x] -> d1, feed [d1] -> d2, feed [d2] -> d3; the draft now holds x d1 d2 (3 new
columns). The target accepts 1 draft and emits d1 then t: keep 1 + min(1, 2) = 2 columns
(x d1); pending for the next round = [t]. Had it accepted all 3 (emitting d1 d2 d3 b), keep
1 + 2 = 3 columns (x d1 d2); pending = [d3 b].
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from engine.kv import batch as kvb
from engine.kv.recurrent import RecurrentLayout
from engine.models import make_batch_layouts, prepare_model
from engine.sampling import process_logits
from engine.spec.accept import STREAM_DRAFT, draw_stream, plain_greedy
from engine.spec.base import Proposal, ProposeContext, register_drafter

MAX_MERGED = 4  # pending tokens fed as the (right-padded) first draft step, not caught up apart


class DraftKV:
    """The draft model's batched layouts for the running rows (moved with them)."""

    __slots__ = ("layouts",)

    def __init__(self, layouts: list[Any]) -> None:
        self.layouts = layouts

    def take(self, keep: Sequence[int]) -> None:
        kvb.filter_rows(self.layouts, list(keep))

    def concat(self, other: DraftKV) -> None:
        self.layouts = kvb.extend(self.layouts, other.layouts)

    @property
    def nbytes(self) -> int:
        return kvb.nbytes(self.layouts)


@register_drafter("draft")
class DraftModelDrafter:
    name = "draft"
    point_mass = False
    catches_up = True
    prices_drafts = True  # a greedy round stops where its drafts are worth less than their columns

    def __init__(
        self,
        model: Any,
        max_draft: int,
        vocab_size: int | None = None,
        prefill_chunk: int = 512,
        **_: Any,
    ) -> None:
        self.model = model
        self.max_draft = max_draft
        self.vocab_size = vocab_size
        self.prefill_chunk = prefill_chunk
        prepare_model(model)
        self.has_recurrent = any(isinstance(x, RecurrentLayout) for x in self._layouts(0))
        self.num_fed_tokens = 0  # prompt and catch-up tokens fed outside proposals
        self.prefill_seconds = 0.0  # prefill of admitted rows (recurring with admissions)
        self.catch_up_seconds = 0.0  # catch-up after plain stretches (once per stretch)
        self.caught_up = False  # the last propose() had to catch up (the step is not typical)
        self.draft_steps = 0  # one-token draft forwards in proposals
        self.stopped_rounds = 0  # greedy rounds that stopped drafting below the ceiling

    max_merged = MAX_MERGED

    def lag(self, state: DraftKV, context_lengths: Sequence[int]) -> np.ndarray:
        """[B] tokens each row's draft KV has not seen yet (1 = in step)."""
        return np.asarray(context_lengths, np.int64) - np.asarray(
            kvb.num_tokens(state.layouts), np.int64
        )

    def _layouts(self, num_rows: int) -> list[Any]:
        # ring slack: a round writes up to MAX_MERGED pending + K - 1 draft columns past the
        # checkpoint and keeps at least one
        return make_batch_layouts(self.model, num_rows, max_draft=self.max_draft + MAX_MERGED)

    def release(self, state: DraftKV) -> None:
        """Drop every row's draft KV: speculation is off at this batch size, and rows leaving
        the batch would otherwise move their draft KV too (at 64 rows on the CPU the moves cost
        0.57 s in a 10-s run). A row asked for drafts again is caught up from its prompt (the
        KV holds a prefix of each context, the empty one included)."""
        held = kvb.num_tokens(state.layouts)
        if any(n > 0 for n in held):
            state.layouts = self._layouts(len(held))

    # -- rows ------------------------------------------------------------------------------
    def admit(self, contexts: Sequence[Sequence[int]], warm: bool,
              predictions: Sequence[Sequence[int] | None] = ()) -> DraftKV:
        del predictions  # the draft model drafts from its own distribution
        state = DraftKV(self._layouts(len(contexts)))
        if warm:  # prefill now; otherwise the first proposal catches the rows up
            t0 = time.perf_counter()
            self._feed(state.layouts, [list(c[:-1]) for c in contexts])
            self.prefill_seconds += time.perf_counter() - t0
        return state

    def _feed(self, layouts: list[Any], token_lists: list[list[int]]) -> None:
        """Append each row's tokens (right-padded, in chunks); outputs are not needed."""
        lengths = [len(t) for t in token_lists]
        width = max(lengths, default=0)
        if width == 0:
            return
        self.num_fed_tokens += sum(lengths)
        kvb.prepare(layouts, lengths=lengths)
        for start in range(0, width, self.prefill_chunk):
            end = min(width, start + self.prefill_chunk)
            rows = [t[start:end] + [0] * (end - start - len(t[start:end])) for t in token_lists]
            self.model(mx.array(rows, dtype=mx.int32), cache=layouts)
            kvb.eval_state(layouts)
        kvb.finalize(layouts)

    def _catch_up(self, state: DraftKV, token_lists: list[list[int]]) -> None:
        """`_feed`, but when a few rows need much more than the rest, only those rows go
        through the forward (split out and merged back in order: a copy of the draft KV
        instead of a forward over mostly padding)."""
        lengths = np.array([len(t) for t in token_lists])
        needy = np.flatnonzero(lengths > 0)
        if len(needy) == len(lengths) or len(lengths) * lengths.max() <= 2 * lengths.sum():
            self._feed(state.layouts, token_lists)
            return
        rows = [kvb.extract_row(state.layouts, i) for i in range(len(lengths))]
        sub = kvb.merge_rows(None, [rows[i] for i in needy])
        self._feed(sub, [token_lists[i] for i in needy])
        for j, i in enumerate(needy):
            rows[i] = kvb.extract_row(sub, j)
        state.layouts = kvb.merge_rows(None, rows)

    # -- rounds ----------------------------------------------------------------------------
    def propose(self, ctx: ProposeContext) -> Proposal:
        layouts = ctx.state.layouts
        K = ctx.max_drafts
        n_draft = kvb.num_tokens(layouts)
        active = ctx.num_drafts > 0  # rows without drafts feed nothing and keep nothing
        pending = [
            c[n:] if a else [] for c, n, a in zip(ctx.contexts, n_draft, active, strict=True)
        ]
        lengths = np.array([len(p) for p in pending], np.int64)
        if (lengths[active] < 1).any():
            raise RuntimeError("draft KV is ahead of its row's context")
        merged = 1 if self.has_recurrent else MAX_MERGED
        self.caught_up = bool(lengths.max(initial=1) > merged)
        if self.caught_up:
            t0 = time.perf_counter()
            self._catch_up(ctx.state, [p[:-1] for p in pending])
            self.catch_up_seconds += time.perf_counter() - t0
            layouts = ctx.state.layouts
            pending = [p[-1:] for p in pending]
            lengths = np.array([len(p) for p in pending], np.int64)
        kvb.checkpoint(layouts)
        logits = self._first_logits(layouts, pending, lengths, ctx.next_tokens)
        V = ctx.sampler.vocab_size
        drafts: list[mx.array] = []
        if plain_greedy(ctx.sampler):  # argmax chain: no sampler states, no q (point mass)
            need = ctx.min_gain
            if need is not None and not (need[1:K] > 0).any():
                need = None  # every column pays: no reads between the draft steps
            chance = np.ones(len(pending))  # per row: all its drafts so far accepted
            kept = K
            for j in range(K):
                if j:
                    logits = self.model(drafts[-1][:, None], cache=layouts)[:, -1, :]
                fitted = _fit_vocab(logits, V)
                drafts.append(mx.argmax(fitted, axis=-1).astype(mx.int32))
                if need is None or j + 1 == K:
                    mx.async_eval(drafts[-1])  # compute while the next step's graph is built
                    continue
                chance *= np.array(_top_probability(fitted))
                if j and chance[ctx.num_drafts > j].sum() < need[j]:
                    kept = j  # this draft is not worth its column: the round verifies j
                    break
            self.draft_steps += len(drafts)
            self.stopped_rounds += kept < K
            return Proposal(
                tokens=mx.stack(drafts, axis=1),
                num_drafts=np.minimum(ctx.num_drafts, kept),
                drafter_info=(lengths, len(drafts)),
            )
        states = [ctx.sampler]
        qs: list[mx.array] = []
        for j in range(K):
            if j:
                states.append(states[-1].record(drafts[-1]))
                logits = self.model(drafts[-1][:, None], cache=layouts)[:, -1, :]
            processed = process_logits(_fit_vocab(logits, V), states[j])
            drafts.append(draw_stream(processed, states[j], STREAM_DRAFT))
            qs.append(processed)
            mx.async_eval(drafts[-1])  # compute while the next step's graph is built
        self.draft_steps += K
        return Proposal(
            tokens=mx.stack(drafts, axis=1),
            num_drafts=ctx.num_drafts.copy(),
            draft_logits=mx.stack(qs, axis=1),
            column_states=states,
            drafter_info=(lengths, K),
        )

    def _first_logits(
        self, layouts: list[Any], pending: list[list[int]], lengths: np.ndarray, nxt: mx.array
    ) -> mx.array:
        if lengths.min() == lengths.max() == 1:
            return self.model(nxt[:, None], cache=layouts)[:, -1, :]
        width = int(lengths.max())
        kvb.prepare(layouts, lengths=lengths.tolist())
        rows = [p + [0] * (width - len(p)) for p in pending]
        out = self.model(mx.array(rows, dtype=mx.int32), cache=layouts)
        kvb.finalize(layouts)
        last = mx.array(np.maximum(lengths - 1, 0), dtype=mx.int32)[:, None, None]
        return mx.take_along_axis(out, last, axis=1)[:, 0, :]

    def observe(self, ctx: ProposeContext, proposal: Proposal, num_accepted: np.ndarray) -> None:
        lengths, K = proposal.drafter_info
        kvb.rollback(ctx.state.layouts, lengths + np.minimum(num_accepted, K - 1))

    def stats(self) -> dict[str, Any]:
        return {
            "fed_tokens": self.num_fed_tokens,
            "draft_steps": self.draft_steps,
            "stopped_rounds": self.stopped_rounds,
            "prefill_seconds": round(self.prefill_seconds, 3),
            "catch_up_seconds": round(self.catch_up_seconds, 3),
        }


def _fit_vocab(logits: mx.array, vocab_size: int) -> mx.array:
    """The draft's logits over the target's vocabulary (same tokenizer, maybe padded apart)."""
    V = logits.shape[-1]
    if V == vocab_size or vocab_size == 0:
        return logits
    if V > vocab_size:
        return logits[:, :vocab_size]
    pad = mx.full((logits.shape[0], vocab_size - V), float("-inf"), logits.dtype)
    return mx.concatenate([logits, pad], axis=1)


def _top_probability(logits: mx.array) -> mx.array:
    """[B] the draft's probability of its own greedy token: the chance it is accepted (the
    draft's confidence tracks its acceptance closely on tinycoder's pair, docs/speculative.md)."""
    x = logits.astype(mx.float32)
    return 1.0 / mx.exp(x - x.max(axis=-1, keepdims=True)).sum(axis=-1)
