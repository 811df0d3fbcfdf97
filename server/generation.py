"""From engine tokens to client text, shared by every endpoint (OpenAI now; Anthropic and
Responses later).

    specs = [ChoiceSpec(index=i, req_id=..., prompt_ids=..., params=..., stop=[...]) ...]
    gens = await start_all(client, specs, model)           # submits; EngineError before any text
    async for delta in stream_all(gens): ...               # Delta(index, text, logprobs, finish)
    results = await collect_all(gens)                      # or: whole texts, for non-streaming
    usage_numbers(gens)                                    # prompt/completion/cached tokens

Per choice, `TextPipeline` turns token ids into text: incremental detokenization (never a broken
character), stop strings (never a partial one in the stream; the engine row is aborted at the
match), and logprob entries released together with the text they belong to.

Leaving a stream early (client disconnect → cancellation, or `aclose`) aborts every engine row
that has not finished, synchronously, before any other cleanup awaits.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio

from engine.api import (
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    EngineClient,
    EngineError,
    Request,
    SamplingParams,
    TokenEvent,
)
from server.detokenize import IncrementalDetokenizer
from server.prompts import ServedModel
from server.reasoning import THINK_CLOSE, THINK_OPEN
from server.stops import StopMatcher

log = logging.getLogger("mlxd.server")


class GenerationError(Exception):
    """The engine failed a request after it was accepted (TokenEvent.error)."""


@dataclass(slots=True)
class ChoiceSpec:
    """One engine request = one choice in the response."""

    index: int  # choice index in the response
    req_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stop: Sequence[str] = ()
    include_stop_str: bool = False
    skip_special_tokens: bool = True
    prompt_index: int = 0  # which prompt (completions with a list of prompts), for usage
    # a reasoning budget: after this many output tokens with the reasoning still open, the
    # closing tokens are forced and the answer continues (`Generation.deltas`)
    think_budget: ThinkBudget | None = None
    prediction_ids: list[int] | None = None  # a predicted output (OpenAI's `prediction`)


@dataclass(slots=True)
class ThinkBudget:
    tokens: int  # output tokens the reasoning may take
    close_ids: list[int]  # the closing tag's tokens ("\n</think>\n\n")
    starts_in_reasoning: bool  # the prompt opened the reasoning (else `opening` must come first)
    opening: str = THINK_OPEN  # what opens and closes the reasoning in the text (harmony:
    closing: str = THINK_CLOSE  # the analysis channel's header and its <|end|>)


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # best first, as the engine gave them
    offset: int = 0  # character offset of the token's text within the choice's text


@dataclass(slots=True)
class Delta:
    index: int
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


MIN_LOGPROB = -9999.0  # what OpenAI reports for -inf (JSON has no infinities)


def _finite(value: float) -> float:
    value = float(value)
    return value if math.isfinite(value) else MIN_LOGPROB


class TextPipeline:
    """Token ids → (text, logprob entries) for one choice; synchronous and deterministic."""

    def __init__(
        self,
        tokenizer: Any,
        spec: ChoiceSpec,
        eos_token_ids: Iterable[int] = (),
        want_logprobs: bool | None = None,
    ):
        params = spec.params
        self.detok = IncrementalDetokenizer(
            tokenizer, skip_special_tokens=spec.skip_special_tokens, prompt_ids=spec.prompt_ids
        )
        self.matcher = StopMatcher(spec.stop, include_stop=spec.include_stop_str)
        self.want_logprobs = params.logprobs if want_logprobs is None else want_logprobs
        # the token that ended the row on "stop" carries no text (engines may or may not send it)
        self.end_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self.end_ids.update(eos_token_ids)
        self.num_tokens = 0  # tokens that count as completion tokens
        self.token_ids: list[int] = []  # those tokens
        self._detok_len = 0  # characters the detokenizer committed
        self._emitted_len = 0  # characters that passed the stop matcher
        self._group: list[TokenLogprob] = []  # tokens not yet committed by the detokenizer
        self._waiting: deque[tuple[TokenLogprob, int, int]] = deque()  # (entry, start, end)

    @property
    def stopped(self) -> bool:
        """A stop string matched: the rest of the generation is to be dropped."""
        return self.matcher.matched is not None

    def feed(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[float] | None = None,
        top_logprobs: Sequence[Sequence[tuple[int, float]]] | None = None,
        finish_reason: str | None = None,
    ) -> tuple[str, list[TokenLogprob]]:
        ids = list(token_ids)
        if finish_reason == FINISH_STOP and ids and ids[-1] in self.end_ids:
            ids.pop()
        self.num_tokens += len(ids)
        self.token_ids.extend(ids)
        text_parts: list[str] = []
        released: list[TokenLogprob] = []
        for i, token in enumerate(ids):
            if self.stopped:
                break
            if self.want_logprobs:
                lp = _finite(logprobs[i]) if logprobs is not None and i < len(logprobs) else 0.0
                top = (
                    [(int(t), _finite(v)) for t, v in top_logprobs[i]]
                    if top_logprobs is not None and i < len(top_logprobs)
                    else []
                )
                self._group.append(TokenLogprob(token, lp, top))
            piece = self.detok.add(token)
            if piece is not None:
                self._commit(piece, text_parts, released)
        if finish_reason is not None and not self.stopped:
            self._commit(self.detok.flush(), text_parts, released)
            tail = self.matcher.flush()
            self._emitted_len += len(tail)
            text_parts.append(tail)
            self._release(released, end="all")
        return "".join(text_parts), released

    def _commit(self, piece: str, text_parts: list[str], released: list[TokenLogprob]) -> None:
        start = self._detok_len
        self._detok_len += len(piece)
        if self._group:
            for entry in self._group:
                self._waiting.append((entry, start, self._detok_len))
            self._group = []
        out = self.matcher.push(piece)
        self._emitted_len += len(out)
        text_parts.append(out)
        self._release(released, end="cut" if self.stopped else None)

    def _release(self, released: list[TokenLogprob], end: str | None = None) -> None:
        """Hand out entries whose text is out. end="cut" (stop string): also those whose text
        starts before the cut, drop the rest; end="all" (the row finished): everything."""
        waiting = self._waiting
        limit = self._emitted_len
        while waiting and (
            end == "all" or waiting[0][2] <= limit or (end == "cut" and waiting[0][1] < limit)
        ):
            entry, start, _ = waiting.popleft()
            entry.offset = start
            released.append(entry)
        if end is not None:
            waiting.clear()
            self._group = []


class Generation:
    """One submitted engine request, consumed once through `deltas()`."""

    def __init__(
        self,
        client: EngineClient,
        spec: ChoiceSpec,
        stream: AsyncIterator[TokenEvent],
        eos_token_ids: Iterable[int],
        tokenizer: Any = None,  # None: the default model's
        request: Request | None = None,  # what was submitted (a reasoning budget resubmits it)
    ):
        self.client = client
        self.spec = spec
        self.pipeline = TextPipeline(tokenizer or client.model.tokenizer, spec, eos_token_ids)
        self._stream = stream
        self._request = request
        self._req_id = spec.req_id  # the engine row now running this choice
        self._seen = ""  # text a reasoning budget still watches: the start, then a tail
        self._opened = bool(spec.think_budget and spec.think_budget.starts_in_reasoning)
        self._budget_spent = False
        self.finished = False  # the engine row is done (finished, failed, or aborted by us)
        self.finish_reason: str | None = None
        self.num_prompt_tokens = len(spec.prompt_ids)
        self.num_cached_tokens = 0
        self.accepted_prediction = 0  # of the prediction's tokens, those speculation accepted

    @property
    def num_completion_tokens(self) -> int:
        return self.pipeline.num_tokens

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self.client.abort(self._req_id)

    async def deltas(self) -> AsyncGenerator[Delta, None]:
        index = self.spec.index
        try:
            while True:
                over_budget = False
                async for ev in self._stream:
                    if self._req_id == self.spec.req_id:  # a continued row's prompt is not the request's
                        if ev.num_prompt_tokens:
                            self.num_prompt_tokens = ev.num_prompt_tokens
                        self.num_cached_tokens = max(self.num_cached_tokens, ev.num_cached_tokens)
                    self.accepted_prediction += ev.accepted_prediction
                    if ev.finish_reason == FINISH_ERROR:
                        self.finished = True
                        raise GenerationError(ev.error or "the engine failed this request")
                    text, lps = self.pipeline.feed(
                        ev.token_ids, ev.logprobs, ev.top_logprobs, ev.finish_reason
                    )
                    finish = ev.finish_reason
                    if self.pipeline.stopped:
                        self.abort()  # the stop string matched: free the row now
                        finish = FINISH_STOP
                    elif finish is not None:
                        self.finished = True
                    if text or lps or finish:
                        if finish:
                            self.finish_reason = finish
                        yield Delta(index, text, lps, finish)
                    if finish:
                        return
                    if self._over_budget(text):
                        over_budget = True
                        break
                if not over_budget:
                    break
                delta = await self._close_reasoning()
                yield delta
                if delta.finish_reason:
                    return
            # the stream ended without a finish reason: the engine dropped the row
            self.finished = True
            self.finish_reason = FINISH_ABORT
            yield Delta(index, "", [], FINISH_ABORT)
        finally:
            self.abort()  # no-op when finished; on cancellation this runs before any await
            await self._close_stream()

    async def _close_stream(self) -> None:
        """Close the engine stream being read (at most 2 s, even when cancelled)."""
        aclose = getattr(self._stream, "aclose", None)
        if aclose is not None:
            with anyio.move_on_after(2.0, shield=True):
                await aclose()

    def _over_budget(self, text: str) -> bool:
        """The reasoning is still open after the budget's tokens (checked once per event)."""
        budget = self.spec.think_budget
        if budget is None or self._budget_spent or self._request is None:
            return False
        seen = self._seen + text
        if not self._opened:  # the answer must start with the tag
            head = seen.lstrip()
            if head.startswith(budget.opening):
                self._opened, seen = True, head[len(budget.opening):]
            elif budget.opening.startswith(head):  # "", "<", "<th": not decided yet
                self._seen = seen
                return False
            else:
                self._budget_spent = True  # no reasoning: nothing to watch
                return False
        if budget.closing in seen:
            self._budget_spent = True  # the model closed it itself
            return False
        self._seen = seen[-(len(budget.closing) - 1):]  # a tag cut between two events
        return self.pipeline.num_tokens >= budget.tokens

    async def _close_reasoning(self) -> Delta:
        """End the running row, write the closing tag as if the model had, and go on from the
        prompt, the tokens so far and the tag in a new row (with the rest of max_tokens)."""
        budget, request = self.spec.think_budget, self._request
        assert budget is not None and request is not None
        self._budget_spent = True
        self.client.abort(self._req_id)
        await self._close_stream()
        text, lps = self.pipeline.feed(budget.close_ids)
        limit = request.params.max_tokens
        left = None if limit is None else limit - self.pipeline.num_tokens
        if left is None or left > 0:
            self._req_id = f"{self.spec.req_id}-answer"
            constraint = request.params.constraint
            if isinstance(constraint, dict) and "reasoning" in constraint:  # the answer is next
                constraint = {k: v for k, v in constraint.items() if k != "reasoning"}
            try:
                self._stream = await self.client.submit(dataclasses.replace(
                    request, req_id=self._req_id,
                    prompt_ids=list(self.spec.prompt_ids) + self.pipeline.token_ids,
                    params=dataclasses.replace(request.params, max_tokens=left, constraint=constraint)))
                return Delta(self.spec.index, text, lps)
            except EngineError as exc:  # the context is full, or the queue: the answer ends here
                log.info("%s: the answer after the reasoning budget was refused: %s",
                         self.spec.req_id, exc)
        self.finished = True  # max_tokens spent at the tag, or the continuation refused
        self.finish_reason = FINISH_LENGTH
        return Delta(self.spec.index, text, lps, FINISH_LENGTH)


async def start_all(
    client: EngineClient, specs: Sequence[ChoiceSpec], model: ServedModel,
    keep_alive: float | None = None,
) -> list[Generation]:
    """Submit every choice on `model` (the one the request's `model` selected, with its LoRA
    adapter if it is one; server.models); if one is refused (EngineError), abort the ones
    already queued. `keep_alive`: seconds the model stays loaded once idle (Request)."""
    eos = tuple(model.info.eos_token_ids)
    gens: list[Generation] = []
    try:
        for spec in specs:
            request = Request(req_id=spec.req_id, prompt_ids=spec.prompt_ids, params=spec.params,
                              adapter=model.adapter, model=model.engine_name,
                              keep_alive=keep_alive, prediction_ids=spec.prediction_ids)
            stream = await client.submit(request)
            gens.append(Generation(client, spec, stream, eos, model.tokenizer, request))
    except BaseException:
        for g in gens:
            g.abort()
            aclose = getattr(g._stream, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
        raise
    return gens


_DONE = object()


async def stream_all(gens: Sequence[Generation]) -> AsyncGenerator[Delta, None]:
    """The deltas of all choices, interleaved as they come; abort the rest if we stop early."""
    if len(gens) == 1:
        async with contextlib.aclosing(gens[0].deltas()) as it:
            async for delta in it:
                yield delta
        return
    queue: asyncio.Queue[Any] = asyncio.Queue()

    async def pump(gen: Generation) -> None:
        try:
            async with contextlib.aclosing(gen.deltas()) as it:
                async for delta in it:
                    queue.put_nowait(delta)
        except Exception as exc:  # surfaced to the consumer
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(_DONE)

    tasks = [asyncio.create_task(pump(g)) for g in gens]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for g in gens:
            g.abort()
        for t in tasks:
            t.cancel()
        with anyio.move_on_after(2.0, shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)


@dataclass(slots=True)
class ChoiceResult:
    index: int
    text: str
    logprobs: list[TokenLogprob]
    finish_reason: str | None


async def collect_all(gens: Sequence[Generation]) -> list[ChoiceResult]:
    """Run every choice to the end; results ordered by choice index."""
    texts: dict[int, list[str]] = {g.spec.index: [] for g in gens}
    lps: dict[int, list[TokenLogprob]] = {g.spec.index: [] for g in gens}
    finish: dict[int, str | None] = {}
    async with contextlib.aclosing(stream_all(gens)) as it:
        async for d in it:
            texts[d.index].append(d.text)
            lps[d.index].extend(d.logprobs)
            if d.finish_reason:
                finish[d.index] = d.finish_reason
    return [ChoiceResult(i, "".join(texts[i]), lps[i], finish.get(i)) for i in sorted(texts)]


def usage_numbers(gens: Sequence[Generation]) -> dict[str, Any]:
    """OpenAI usage; a prompt shared by n choices counts once."""
    prompts: dict[int, tuple[int, int]] = {}
    for g in gens:
        prompts.setdefault(g.spec.prompt_index, (g.num_prompt_tokens, g.num_cached_tokens))
    prompt_tokens = sum(p for p, _ in prompts.values())
    cached = sum(c for _, c in prompts.values())
    completion = sum(g.num_completion_tokens for g in gens)
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    predicted = [g for g in gens if g.spec.prediction_ids]
    if predicted:  # OpenAI's counts: the prediction's tokens used, and the rest
        accepted = sum(g.accepted_prediction for g in predicted)
        total = sum(len(g.spec.prediction_ids or ()) for g in predicted)
        usage["completion_tokens_details"] = {
            "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": max(0, total - accepted),
        }
    return usage
