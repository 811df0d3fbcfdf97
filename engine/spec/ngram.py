"""N-gram prompt lookup: continue a row's last tokens from where they occurred before.

For each row, find the longest suffix of its context (`max_ngram` down to `min_ngram` tokens)
that also ends at an earlier position `e`, taking the most recent such `e`, and propose the
tokens that followed it: `context[e + 1 : e + 1 + k]`. No model runs; proposals are point
masses (the verifier accepts a draft iff the target's own draw equals it), so the output
distribution is exactly the target's.

The search is O(1) per row per step: each row keeps a dict from n-gram to the last position
where it ended, updated incrementally with the tokens added since the previous call (prompt
tokens on the first call, then one or a few generated tokens per step).

Worked example (max_ngram 3): context `[5 6 7 8 | 9 5 6 7]` (the last token, 7, is the next
input). The suffix `5 6 7` ended before at position 2, so the proposal is `8 9 5 ...`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from engine.spec.base import Proposal, ProposeContext, register_drafter


class NGramIndex:
    """Last end position of every n-gram (n in [min_n, max_n]) of a token list's prefix."""

    __slots__ = ("min_n", "max_n", "ends", "num_indexed", "_last")

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.ends: dict[tuple[int, ...], int] = {}
        self.num_indexed = 0  # n-grams ending before this position are in `ends`
        # (context length, k, result) of the last lookup: a row's context only grows, so its
        # length names it; the step's `propose` repeats the decision's `available` lookup
        self._last: tuple[int, int, list[int]] = (-1, 0, [])

    def extend(self, tokens: Sequence[int], upto: int) -> None:
        """Index n-grams ending at positions [num_indexed, upto)."""
        start = self.num_indexed
        if upto <= start:
            return
        ends = self.ends
        if upto - start <= 8:  # a step's few tokens: the plain loop costs less than the slices
            for e in range(start, upto):
                for n in range(self.min_n, min(self.max_n, e + 1) + 1):
                    ends[tuple(tokens[e - n + 1 : e + 1])] = e
            self.num_indexed = upto
            return
        for n in range(self.min_n, self.max_n + 1):
            first = max(start, n - 1)  # the first end position with n tokens before it
            if first >= upto:
                continue
            # the n-grams ending at first..upto-1, built by zip in C (a prompt's whole index
            # in one call per n); a later end overwrites an earlier one's, as it must
            cols = [tokens[first - n + 1 + j : upto - n + 1 + j] for j in range(n)]
            ends.update(zip(zip(*cols, strict=True), range(first, upto), strict=True))
        self.num_indexed = upto

    def lookup(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest earlier occurrence of the context's suffix."""
        n_tok, k_last, found = self._last
        if n_tok == len(tokens) and (k <= k_last or len(found) < k_last):
            return found[:k]
        found = self._lookup(tokens, k)
        self._last = (len(tokens), k, found)
        return list(found)

    def _lookup(self, tokens: Sequence[int], k: int) -> list[int]:
        self.extend(tokens, len(tokens) - 1)  # never the suffix itself
        return self.follow(tokens, tokens, k)

    def follow(self, source: Sequence[int], context: Sequence[int], k: int) -> list[int]:
        """Up to k tokens of `source` (the indexed sequence) that followed the latest
        occurrence of the longest suffix of `context` found in the index."""
        last = len(context) - 1
        for n in range(min(self.max_n, last), self.min_n - 1, -1):
            e = self.ends.get(tuple(context[last - n + 1 :]))
            if e is not None:
                return list(source[e + 1 : e + 1 + k])
        return []


class Prediction:
    """A request's predicted output (OpenAI's `prediction`): drafts copied from it first.

    While the row's output so far is the prediction's beginning, the drafts are the
    prediction's next tokens (from the first generated token on, where no n-gram of the output
    exists yet); once they part, the longest suffix of the row's context that occurs in the
    prediction is continued from there (an edit that changed a few lines rejoins the
    prediction after them)."""

    __slots__ = ("tokens", "index", "prompt_len", "aligned", "checked")

    def __init__(self, tokens: Sequence[int], prompt_len: int, min_n: int, max_n: int) -> None:
        self.tokens = list(tokens)
        self.index = NGramIndex(min_n, max_n)
        self.index.extend(self.tokens, len(self.tokens))
        self.prompt_len = prompt_len
        self.aligned = True  # the output so far is the prediction's beginning
        self.checked = 0  # output tokens compared with the prediction so far

    def lookup(self, context: Sequence[int], k: int) -> list[int]:
        """Up to k tokens the prediction says follow `context` (prompt + output so far)."""
        pred, done = self.tokens, len(context) - self.prompt_len
        while self.aligned and self.checked < done:
            i = self.checked
            self.aligned = i < len(pred) and context[self.prompt_len + i] == pred[i]
            self.checked += 1
        if self.aligned:
            return pred[done : done + k]
        return self.index.follow(pred, context, k)


class NGramState:
    """Per-row indexes and predictions (Python lists moved with the rows)."""

    __slots__ = ("indexes", "predictions")

    def __init__(self, indexes: list[NGramIndex], predictions: list[Prediction | None]) -> None:
        self.indexes = indexes
        self.predictions = predictions

    def take(self, keep: Sequence[int]) -> None:
        self.indexes = [self.indexes[i] for i in keep]
        self.predictions = [self.predictions[i] for i in keep]

    def concat(self, other: NGramState) -> None:
        self.indexes = self.indexes + other.indexes
        self.predictions = self.predictions + other.predictions


@register_drafter("ngram")
class NGramDrafter:
    name = "ngram"
    point_mass = True
    catches_up = False  # the index extends lazily over whatever was generated

    def __init__(self, max_ngram: int = 4, min_ngram: int = 2, **_: Any) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._num_found = 0
        self._num_asked = 0

    def admit(self, contexts: Sequence[Sequence[int]], warm: bool,
              predictions: Sequence[Sequence[int] | None] = ()) -> NGramState:
        """Per-row state; `predictions[b]`: row b's predicted output, or None (empty: none
        has one). (Indexing of the context is lazy, at the first lookup.)"""
        del warm
        preds = list(predictions) or [None] * len(contexts)
        return NGramState(
            [NGramIndex(self.min_ngram, self.max_ngram) for _ in contexts],
            [Prediction(p, len(c), self.min_ngram, self.max_ngram) if p else None
             for c, p in zip(contexts, preds, strict=True)],
        )

    def _lookup(self, state: NGramState, b: int, context: list[int], k: int) -> tuple[list[int], bool]:
        """Row b's drafts, and whether they come from its prediction."""
        pred = state.predictions[b]
        if pred is not None:
            found = pred.lookup(context, k)
            if found:
                return found, True
        return state.indexes[b].lookup(context, k), False

    def propose(self, ctx: ProposeContext) -> Proposal:
        state: NGramState = ctx.state
        K = ctx.max_drafts
        B = len(ctx.contexts)
        drafts = np.zeros((B, K), np.int32)
        num = np.zeros(B, np.int64)
        predicted = np.zeros(B, bool)
        for b in np.flatnonzero(ctx.num_drafts > 0):  # short per-row lists; dict lookups
            found, predicted[b] = self._lookup(state, int(b), ctx.contexts[b], int(ctx.num_drafts[b]))
            self._num_asked += 1
            if found:
                self._num_found += 1
                drafts[b, : len(found)] = found
                num[b] = len(found)
        return Proposal(tokens=mx.array(drafts), num_drafts=num, host_tokens=drafts,
                        predicted=predicted)

    def available(self, ctx: ProposeContext) -> np.ndarray:
        """[B] how many drafts `propose` would offer each row (no device arrays)."""
        state: NGramState = ctx.state
        num = np.zeros(len(ctx.contexts), np.int64)
        for b in np.flatnonzero(ctx.num_drafts > 0):
            num[b] = len(self._lookup(state, int(b), ctx.contexts[b], int(ctx.num_drafts[b]))[0])
        return num

    def observe(self, ctx: ProposeContext, proposal: Proposal, num_accepted: np.ndarray) -> None:
        del ctx, proposal, num_accepted  # nothing to learn beyond the controller's statistics

    def stats(self) -> dict[str, Any]:
        return {
            "lookup_hit_rate": self._num_found / self._num_asked if self._num_asked else None,
            "max_ngram": self.max_ngram,
            "min_ngram": self.min_ngram,
        }


@register_drafter("prediction")
class PredictionDrafter(NGramDrafter):
    """Drafts only from the rows' predicted outputs (OpenAI's `prediction`), never from their
    prompts: what a server without a drafter of its own runs, so that a request that brings a
    prediction is sped up and every other row decodes plainly (`wants` is false while no row
    has one, and the speculation then does no work at all)."""

    name = "prediction"

    def _lookup(self, state: NGramState, b: int, context: list[int], k: int) -> tuple[list[int], bool]:
        pred = state.predictions[b]
        return (pred.lookup(context, k), True) if pred is not None else ([], False)

    def wants(self, state: NGramState) -> bool:
        """Whether any row could get drafts (has a prediction)."""
        return any(p is not None for p in state.predictions)
