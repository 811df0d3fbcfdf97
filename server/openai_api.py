"""POST /v1/chat/completions and /v1/completions: requests → engine choices → OpenAI shapes."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from engine.api import EngineClient, SamplingParams, ScoreRequest, ScoreResult
from server.config import ServerConfig
from server.detokenize import IncrementalDetokenizer
from server.errors import APIError, bad_request, error_body
from server.generation import (
    ChoiceSpec,
    Generation,
    GenerationError,
    TokenLogprob,
    collect_all,
    start_all,
    stream_all,
    usage_numbers,
)
from server.models import ModelRouter, parse_keep_alive
from server.params import SamplingRequest, build_params
from server.prepare import Preparer, off_loop
from server.prompts import (
    ServedModel,
    check_prompt_ids,
    effort_template_kwargs,
    encode,
    prediction_ids,
    render_chat,
    template_messages,
)
from server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    _SamplingRequest,
)
from server.sse import DONE, SSEResponse, run_until_disconnect, sse_event

try:
    from importlib.metadata import version as _version

    SYSTEM_FINGERPRINT = "mlxd-" + _version("mlxd")
except Exception:  # not installed (running from a checkout)
    SYSTEM_FINGERPRINT = "mlxd-dev"

router = APIRouter()
log = logging.getLogger("mlxd.server")


@dataclass(slots=True)
class AppState:
    client: EngineClient
    config: ServerConfig
    model: ServedModel  # the default model
    models: ModelRouter = field(init=False)  # a request's `model` → the ServedModel it runs on
    preparer: Preparer = field(init=False)  # template rendering and tokenizing threads

    def __post_init__(self) -> None:
        self.models = ModelRouter(self.client, self.model)
        self.preparer = Preparer(self.config.prepare_threads)


def app_state(request: Request) -> AppState:
    return request.app.state.mlxd


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


# -- request → SamplingParams ---------------------------------------------------------------


def sampling_request(
    body: _SamplingRequest, *, logprobs: bool = False, top_logprobs: int = 0, constraint: Any = None
) -> SamplingRequest:
    """OpenAI's field names → the shared conversion's input (server.params)."""
    chat = isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None
    return SamplingRequest(
        max_tokens=body.requested_max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        logit_bias=body.logit_bias,
        seed=body.seed,
        stop_token_ids=body.stop_token_ids,
        ignore_eos=bool(body.ignore_eos),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        constraint=constraint,
        max_tokens_param="max_completion_tokens" if chat else "max_tokens",
        refuse_over_context=True,
    )


def sampling_params(
    body: _SamplingRequest,
    config: ServerConfig,
    model: ServedModel,
    prompt_ids: Sequence[int],
    *,
    logprobs: bool = False,
    top_logprobs: int = 0,
    constraint: Any = None,
    prompt_param: str = "messages",
) -> SamplingParams:
    """Request fields (or the server's defaults) → the engine's SamplingParams; the prompt is
    checked here too (server.params.build_params)."""
    req = sampling_request(body, logprobs=logprobs, top_logprobs=top_logprobs, constraint=constraint)
    return build_params(req, config, model, prompt_ids, prompt_param)


def _choice_seed(seed: int | None, i: int) -> int | None:
    if seed is None or i == 0:
        return seed
    return (seed + i + 2**63) % 2**64 - 2**63


def make_specs(
    req_prefix: str,
    prompts: Sequence[list[int]],
    params: Sequence[SamplingParams],
    n: int,
    body: _SamplingRequest,
) -> list[ChoiceSpec]:
    """n choices per prompt; choice index = prompt_index * n + i; seeds seed + i."""
    specs = []
    for p, (ids, base) in enumerate(zip(prompts, params, strict=True)):
        for i in range(n):
            index = p * n + i
            specs.append(
                ChoiceSpec(
                    index=index,
                    req_id=f"{req_prefix}-{index}",
                    prompt_ids=ids,
                    params=dataclasses.replace(
                        base, seed=_choice_seed(base.seed, i), logit_bias=dict(base.logit_bias)
                    ),
                    stop=body.stop,
                    include_stop_str=bool(body.include_stop_str_in_output),
                    skip_special_tokens=body.skip_special_tokens is not False,
                    prompt_index=p,
                )
            )
    return specs


async def attach_prediction(
    request: Request, model: ServedModel, body: ChatCompletionRequest, specs: Sequence[ChoiceSpec]
) -> None:
    """A chat request's predicted output, tokenized, on each of its choices (a lookup drafter
    copies drafts from it; usage counts its accepted and rejected tokens)."""
    text = body.prediction_text()
    if text:
        ids = await off_loop(request, prediction_ids, model, text)
        for s in specs:
            s.prediction_ids = ids


def _log_start(request: Request, cid: str, specs: Sequence[ChoiceSpec]) -> None:
    if log.isEnabledFor(logging.DEBUG):
        rid = getattr(request.state, "request_id", "-")
        n_prompt = sum(len(s.prompt_ids) for s in specs)
        log.debug("request %s: %s, %d choices, %d prompt tokens", rid, cid, len(specs), n_prompt)


def abort_all(gens: Sequence[Generation]) -> None:
    for g in gens:
        g.abort()


# -- logprob shapes -------------------------------------------------------------------------


def chat_logprobs(model: ServedModel, entries: Sequence[TokenLogprob], k: int) -> dict[str, Any]:
    vocab = model.vocab
    assert vocab is not None
    content = []
    for e in entries:
        content.append(
            {
                "token": vocab.token_str(e.token_id),
                "logprob": e.logprob,
                "bytes": list(vocab.token_bytes(e.token_id)),
                "top_logprobs": [
                    {
                        "token": vocab.token_str(t),
                        "logprob": lp,
                        "bytes": list(vocab.token_bytes(t)),
                    }
                    for t, lp in e.top[:k]
                ],
            }
        )
    return {"content": content, "refusal": None}


def completion_logprobs(
    model: ServedModel, entries: Sequence[TokenLogprob], k: int, offset: int
) -> dict[str, Any]:
    vocab = model.vocab
    assert vocab is not None
    tokens, token_lps, tops, offsets = [], [], [], []
    for e in entries:
        s = vocab.token_str(e.token_id)
        tokens.append(s)
        token_lps.append(e.logprob)
        top = {vocab.token_str(t): lp for t, lp in e.top[:k]}
        top.setdefault(s, e.logprob)  # OpenAI: the sampled token is always listed
        tops.append(top)
        offsets.append(offset + e.offset)
    return {
        "tokens": tokens,
        "token_logprobs": token_lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def prompt_logprobs(model: ServedModel, ids: Sequence[int], scored: ScoreResult, k: int,
                    special_text: bool = False) -> dict[str, Any]:
    """The completions logprobs object of a prompt's tokens (`echo` with `logprobs`): the first
    token has no logprob (null, as on OpenAI), the others the model's, with the k best
    alternatives and the token itself; offsets are character offsets in the echoed text, which
    holds special tokens' text when the prompt came as ids (`special_text`), not when it came
    as a string (a BOS the tokenizer added is not in it)."""
    vocab = model.vocab
    assert vocab is not None
    detok = IncrementalDetokenizer(model.tokenizer, skip_special_tokens=not special_text)
    offsets: list[int] = []
    pos, group_start = 0, None
    for t in ids:  # a token whose text is pending (part of a character) starts where its group does
        start = pos if group_start is None else group_start
        offsets.append(start)
        piece = detok.add(t)
        if piece is None:
            group_start = start
        else:
            group_start = None
            pos += len(piece)
    first = {"tokens": [vocab.token_str(ids[0])], "token_logprobs": [None], "top_logprobs": [None],
             "text_offset": offsets[:1]}
    rest = [TokenLogprob(t, lp, top, off) for t, lp, top, off in
            zip(ids[1:], scored.logprobs, scored.top_logprobs, offsets[1:], strict=True)]
    return cast(dict[str, Any], joined_logprobs(first, completion_logprobs(model, rest, k, 0)))


def joined_logprobs(first: dict[str, Any] | None, second: dict[str, Any] | None) -> dict[str, Any] | None:
    """Two completions logprobs objects one after the other (the echoed prompt's, then the
    generated tokens')."""
    if first is None or second is None:
        return first or second
    return {key: first[key] + second[key] for key in first}


def vllm_prompt_logprobs(model: ServedModel, ids: Sequence[int], scored: ScoreResult,
                         k: int) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs` of a choice: null for the first token, then per token a map from
    token id to its logprob, rank and text, for the token itself and the k most likely."""
    decoded = functools.cache(lambda i: model.tokenizer.decode([i]))  # ids recur across positions
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for t, lp, rank, top in zip(ids[1:], scored.logprobs, scored.ranks, scored.top_logprobs,
                                strict=True):
        entry = {str(i): {"logprob": v, "rank": r, "decoded_token": decoded(i)}
                 for r, (i, v) in enumerate(top[:k], start=1)}
        entry[str(t)] = {"logprob": lp, "rank": rank, "decoded_token": decoded(t)}
        out.append(entry)
    return out


async def chat_prompt_logprobs(
    request: Request, client: EngineClient, model: ServedModel, body: ChatCompletionRequest,
    ids: list[int],
) -> tuple[bool, dict[str, Any]]:
    """A chat request's vLLM `prompt_logprobs` (the rendered prompt's tokens), as the response's
    extra field: ({} when not asked); False when the client left first."""
    if body.prompt_logprobs is None:
        return True, {}
    scores = await score_prompts(request, client, model, [ids], body.prompt_logprobs)
    if scores is None:
        return False, {}
    return True, {"prompt_logprobs": vllm_prompt_logprobs(model, ids, scores[0],
                                                          body.prompt_logprobs)}


async def score_prompts(
    request: Request, client: EngineClient, model: ServedModel, prompts: list[list[int]], k: int
) -> list[ScoreResult] | None:
    """Each prompt's logprobs (engine.score, the prompts at once); None when the client left
    first."""
    if model.adapter is not None:
        raise APIError(400, f"'{model.name}' is a LoRA adapter; prompt logprobs (echo with "
                            "logprobs) come from the base model only.", param="echo",
                       code="unsupported_model")
    reqs = [ScoreRequest(new_id("score"), ids, k, model=model.engine_name) for ids in prompts]
    return await run_until_disconnect(request, lambda: asyncio.gather(*map(client.score, reqs)))


# -- /v1/chat/completions -------------------------------------------------------------------


def chat_prompt_ids(model: ServedModel, body: ChatCompletionRequest) -> list[int]:
    """The plain path's prompt: messages through the chat template, tokenized (a worker thread)."""
    text = render_chat(
        model,
        template_messages(body.messages),
        add_generation_prompt=bool(body.add_generation_prompt),
        continue_final_message=bool(body.continue_final_message),
        template_kwargs=effort_template_kwargs(body.reasoning_effort, body.chat_template_kwargs),
        tools=body.tools if body.tools and body.tool_choice != "none" else None,
    )
    return encode(model, text, add_special_tokens=False, param="messages")


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    st = app_state(request)
    body: ChatCompletionRequest = ChatCompletionRequest.parse(await request.body())
    keep_alive = parse_keep_alive(body.keep_alive)
    model = await st.models.select(body.model)
    from server.agent_chat import chat_completions_agent, wants_agent_path  # imports this module

    if wants_agent_path(body, model):  # tools, response_format, reasoning: server/agent_chat.py
        body.check_supported(agent=True)
        return await chat_completions_agent(request, body, st, model, keep_alive)
    body.check_supported()
    ids = await off_loop(request, chat_prompt_ids, model, body)
    want_lp = bool(body.logprobs)
    k = body.top_logprobs or 0
    params = sampling_params(body, st.config, model, ids, logprobs=want_lp, top_logprobs=k)
    cid = new_id("chatcmpl")
    specs = make_specs(cid, [ids], [params], body.n or 1, body)
    await attach_prediction(request, model, body, specs)
    here, scored = await chat_prompt_logprobs(request, st.client, model, body, ids)
    if not here:
        return Response(status_code=499)
    gens = await start_all(st.client, specs, model, keep_alive)
    _log_start(request, cid, specs)
    created = int(time.time())
    if body.stream:
        return SSEResponse(
            _chat_stream(gens, model, cid, created, body, want_lp, k),
            on_close=lambda: abort_all(gens),
        )
    results = await _collect(request, gens)
    if isinstance(results, Response):
        return results
    choices = [
        {
            "index": r.index,
            "message": {"role": "assistant", "content": r.text, "refusal": None},
            "logprobs": chat_logprobs(model, r.logprobs, k) if want_lp else None,
            "finish_reason": r.finish_reason,
        }
        for r in results
    ]
    return JSONResponse(
        {
            "id": cid,
            "object": "chat.completion",
            "created": created,
            "model": model.name,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": choices,
            "usage": usage_numbers(gens),
            **scored,
        }
    )


def chunk_writer(
    gens: list[Generation], body: Any, cid: str, created: int, model: ServedModel, obj: str
) -> Callable[..., bytes]:
    """`chunk(choices, usage=None)` → one SSE event of a streamed completion (`obj`: its object
    name); with `stream_options.include_usage` every chunk carries `usage` (null, or the running
    totals with `continuous_usage_stats`), the last one the whole answer's."""
    head = {"id": cid, "object": obj, "created": created, "model": model.name,
            "system_fingerprint": SYSTEM_FINGERPRINT}
    include_usage, continuous = body.include_usage, body.continuous_usage

    def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
        out = dict(head, choices=choices)
        if include_usage:
            out["usage"] = usage if usage is not None or not continuous else usage_numbers(gens)
        return sse_event(out)

    return chunk


async def openai_stream(
    choices: AsyncGenerator[bytes, None], gens: list[Generation], include_usage: bool,
    chunk: Callable[..., bytes],
) -> AsyncIterator[bytes]:
    """A streamed completion's chunks (`choices`) and the tail every OpenAI stream shares: the
    usage chunk when `stream_options.include_usage` asks for it, then `[DONE]`; a generation that
    fails mid-stream ends it with an error event and `[DONE]`. Closing this closes `choices`,
    whose cleanup aborts the rows."""
    try:
        async with contextlib.aclosing(choices) as events:
            async for event in events:
                yield event
    except GenerationError as exc:
        yield sse_event(error_body(str(exc), "server_error", None, "generation_failed"))
        yield sse_event(DONE)
        return
    if include_usage:
        yield chunk([], usage_numbers(gens))
    yield sse_event(DONE)


def _chat_stream(
    gens: list[Generation],
    model: ServedModel,
    cid: str,
    created: int,
    body: ChatCompletionRequest,
    want_lp: bool,
    k: int,
) -> AsyncIterator[bytes]:
    chunk = chunk_writer(gens, body, cid, created, model, "chat.completion.chunk")

    def one(index: int, delta: dict[str, Any], lps: Any = None, finish: str | None = None) -> bytes:
        return chunk([{"index": index, "delta": delta, "logprobs": lps, "finish_reason": finish}])

    async def choices() -> AsyncGenerator[bytes, None]:
        for g in gens:
            yield one(g.spec.index, {"role": "assistant", "content": ""})
        async for d in stream_all(gens):
            if d.text or d.logprobs:
                yield one(d.index, {"content": d.text}, chat_logprobs(model, d.logprobs, k) if want_lp else None)
            if d.finish_reason:
                yield one(d.index, {}, finish=d.finish_reason)

    return openai_stream(choices(), gens, body.include_usage, chunk)


# -- /v1/completions ------------------------------------------------------------------------


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    st = app_state(request)
    body: CompletionRequest = CompletionRequest.parse(await request.body())
    keep_alive = parse_keep_alive(body.keep_alive)
    model = await st.models.select(body.model)
    body.check_supported()
    n = body.n or 1
    if len(body.prompt) * n > st.config.max_choices:
        raise bad_request(f"at most {st.config.max_choices} choices (prompts x n) per request", "n")
    params_of = [_prompt_param(body, j) for j in range(len(body.prompt))]
    prompts = await off_loop(request, completion_prompts, model, body, params_of)
    want_lp = body.logprobs is not None
    k = body.logprobs or 0
    cid = new_id("cmpl")
    created = int(time.time())
    echo_only = bool(body.echo) and body.max_tokens == 0  # nothing to generate
    if echo_only:
        for ids, param in zip(prompts, params_of, strict=True):
            check_prompt_ids(model, ids, param)
    else:
        params = [
            sampling_params(body, st.config, model, ids, logprobs=want_lp, top_logprobs=k,
                            prompt_param=param)
            for ids, param in zip(prompts, params_of, strict=True)
        ]
    scored: list[dict[str, Any]] | None = None  # the echoed prompts' logprobs objects
    vllm_lp: list[Any] | None = None  # vLLM's prompt_logprobs, per prompt
    echo_lp = bool(body.echo) and want_lp
    if echo_lp or body.prompt_logprobs is not None:
        scores = await score_prompts(request, st.client, model, prompts,
                                     max(k if echo_lp else 0, body.prompt_logprobs or 0))
        if scores is None:  # the client left
            return Response(status_code=499)
        if echo_lp:
            scored = [prompt_logprobs(model, ids, r, k, not isinstance(p, str))
                      for ids, r, p in zip(prompts, scores, body.prompt, strict=True)]
        if body.prompt_logprobs is not None:
            vllm_lp = [vllm_prompt_logprobs(model, ids, r, body.prompt_logprobs)
                       for ids, r in zip(prompts, scores, strict=True)]
    if echo_only:
        return _echo_only(cid, created, model, prompts, _echoes(model, body, prompts), n, body, scored,
                          vllm_lp)
    echoes = _echoes(model, body, prompts)
    specs = make_specs(cid, prompts, params, n, body)
    echo_of = {s.index: (echoes[s.prompt_index] if body.echo else "") for s in specs}
    echo_lp_of = {s.index: scored[s.prompt_index] if scored else None for s in specs}
    extra_of = {s.index: {"prompt_logprobs": vllm_lp[s.prompt_index]} if vllm_lp else {} for s in specs}
    gens = await start_all(st.client, specs, model, keep_alive)
    _log_start(request, cid, specs)
    if body.stream:
        return SSEResponse(
            _completion_stream(gens, model, cid, created, body, echo_of, k, echo_lp_of, extra_of),
            on_close=lambda: abort_all(gens),
        )
    results = await _collect(request, gens)
    if isinstance(results, Response):
        return results
    choices = []
    for r in results:
        echo = echo_of[r.index]
        choices.append(
            {
                "index": r.index,
                "text": echo + r.text,
                "logprobs": joined_logprobs(echo_lp_of[r.index],
                                            completion_logprobs(model, r.logprobs, k, len(echo)))
                if want_lp
                else None,
                "finish_reason": r.finish_reason,
                **extra_of[r.index],
            }
        )
    return JSONResponse(
        {
            "id": cid,
            "object": "text_completion",
            "created": created,
            "model": model.name,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": choices,
            "usage": usage_numbers(gens),
        }
    )


def _prompt_param(body: CompletionRequest, j: int) -> str:
    return "prompt" if len(body.prompt) == 1 else f"prompt[{j}]"


def completion_prompts(
    model: ServedModel, body: CompletionRequest, params_of: Sequence[str]
) -> list[list[int]]:
    """Each prompt as token ids (a worker thread: tokenizing long texts takes a while)."""
    return [
        encode(model, p, add_special_tokens=True, param=param) if isinstance(p, str) else p
        for p, param in zip(body.prompt, params_of, strict=True)
    ]


def _echoes(model: ServedModel, body: CompletionRequest, prompts: list[list[int]]) -> list[str]:
    """The text `echo` repeats per prompt (ids checked already, so decoding is safe)."""
    if not body.echo:
        return [""] * len(prompts)
    return [
        p if isinstance(p, str) else str(model.tokenizer.decode(ids))
        for p, ids in zip(body.prompt, prompts, strict=True)
    ]


def _echo_only(
    cid: str,
    created: int,
    model: ServedModel,
    prompts: list[list[int]],
    echoes: list[str],
    n: int,
    body: CompletionRequest,
    scored: list[dict[str, Any]] | None,
    vllm_lp: list[Any] | None,
) -> Response:
    choices = [
        {"index": p * n + i, "text": echoes[p], "logprobs": scored[p] if scored else None,
         "finish_reason": "length", **({"prompt_logprobs": vllm_lp[p]} if vllm_lp else {})}
        for p in range(len(prompts))
        for i in range(n)
    ]
    prompt_tokens = sum(len(p) for p in prompts)
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 0,
        "total_tokens": prompt_tokens,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    out = {
        "id": cid,
        "object": "text_completion",
        "created": created,
        "model": model.name,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "choices": choices,
        "usage": usage,
    }
    if not body.stream:
        return JSONResponse(out)

    async def events() -> AsyncIterator[bytes]:
        head = {k: out[k] for k in ("id", "object", "created", "model", "system_fingerprint")}
        for c in choices:
            yield sse_event(dict(head, choices=[c]))
        if body.include_usage:
            yield sse_event(dict(head, choices=[], usage=usage))
        yield sse_event(DONE)

    return SSEResponse(events())


def _completion_stream(
    gens: list[Generation],
    model: ServedModel,
    cid: str,
    created: int,
    body: CompletionRequest,
    echo_of: dict[int, str],
    k: int,
    echo_lp_of: dict[int, dict[str, Any] | None],
    extra_of: dict[int, dict[str, Any]],
) -> AsyncIterator[bytes]:
    want_lp = body.logprobs is not None
    chunk = chunk_writer(gens, body, cid, created, model, "text_completion")

    async def choices() -> AsyncGenerator[bytes, None]:
        for index, echo in echo_of.items():  # the prompt's part of each choice first
            if echo or extra_of[index]:
                yield chunk([{"index": index, "text": echo, "logprobs": echo_lp_of[index],
                              "finish_reason": None, **extra_of[index]}])
        async for d in stream_all(gens):
            if d.text or d.logprobs or d.finish_reason:
                lp = completion_logprobs(model, d.logprobs, k, len(echo_of[d.index])) if want_lp else None
                yield chunk([{"index": d.index, "text": d.text, "logprobs": lp, "finish_reason": d.finish_reason}])

    return openai_stream(choices(), gens, body.include_usage, chunk)


async def _collect(request: Request, gens: list) -> list | Response:
    """Whole results of a non-streamed request, or the response to send instead (a failed
    generation, or 499 when the client left); every row is aborted on the way out."""
    try:
        results = await run_until_disconnect(request, lambda: collect_all(gens))
    except GenerationError as exc:
        return JSONResponse(error_body(str(exc), "server_error", None, "generation_failed"), 500)
    finally:
        abort_all(gens)
    if results is None:
        return Response(status_code=499)
    return results
