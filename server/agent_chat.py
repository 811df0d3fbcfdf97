"""/v1/chat/completions for agents: tools, tool_choice, parallel_tool_calls, response_format, and
reasoning_content. `server.openai_api.chat_completions` hands a request here when it uses any of
these (or the model thinks in tags, or writes gpt-oss's harmony channels); plain chat stays on
the plain path.

Streaming follows OpenAI: a tool call's first delta carries its index, id, type and name with
empty arguments; later deltas carry argument fragments only; the last chunk's finish_reason is
"tool_calls" when the model called a tool.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import Request
from starlette.responses import JSONResponse, Response

from server.errors import bad_request, error_body
from server.generation import Generation, GenerationError, start_all, usage_numbers
from server.harmony import is_harmony
from server.openai_api import (
    SYSTEM_FINGERPRINT,
    AppState,
    abort_all,
    attach_prediction,
    chat_logprobs,
    chat_prompt_logprobs,
    chunk_writer,
    make_specs,
    new_id,
    openai_stream,
    sampling_params,
)
from server.prepare import off_loop
from server.prompts import ServedModel, effort_template_kwargs, template_messages
from server.protocol import ChatCompletionRequest
from server.reasoning import model_thinks
from server.sse import SSEResponse, run_until_disconnect
from server.structured import response_format_constraint
from server.tools import CallArgs, CallStart, TextEvent, function_specs
from server.turn import (
    ReasoningEvent,
    TurnPlan,
    collect_turn,
    parse_tool_choice,
    plan_turn,
    turn_steps,
)


def wants_agent_path(body: ChatCompletionRequest, model: ServedModel) -> bool:
    rf = body.response_format
    template = model.info.chat_template or getattr(model.tokenizer, "chat_template", None)
    return bool(
        body.tools
        or body.functions
        or (rf and rf.get("type") not in (None, "text"))
        or model_thinks(template, model.tokenizer)
        or is_harmony(template)
    )


def _functions(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    tools = body.tools
    if not tools and body.functions:  # the deprecated `functions` field
        tools = [{"type": "function", "function": f} for f in body.functions]
    try:
        return function_specs(tools)
    except ValueError as exc:
        raise bad_request(str(exc), "tools") from None


def _tool_choice(body: ChatCompletionRequest) -> Any:
    if body.tool_choice is not None or body.function_call is None:
        return body.tool_choice
    fc = body.function_call  # deprecated: "none" | "auto" | {"name": ...}
    return {"type": "function", "function": fc} if isinstance(fc, dict) else fc


async def chat_completions_agent(request: Request, body: ChatCompletionRequest, st: AppState,
                                 model: ServedModel, keep_alive: float | None = None) -> Response:
    functions = _functions(body)
    choice = parse_tool_choice(_tool_choice(body), functions)
    parallel = body.parallel_tool_calls is not False
    plan = await off_loop(
        request,
        plan_turn,
        model,
        template_messages(body.messages),
        functions,
        choice,
        parallel=parallel,
        constraint=response_format_constraint(body.response_format),
        template_kwargs=effort_template_kwargs(body.reasoning_effort, body.chat_template_kwargs),
        add_generation_prompt=bool(body.add_generation_prompt),
        continue_final_message=bool(body.continue_final_message),
    )
    want_lp = bool(body.logprobs)
    k = body.top_logprobs or 0
    params = sampling_params(body, st.config, model, plan.prompt_ids, logprobs=want_lp, top_logprobs=k,
                             constraint=plan.constraint)
    cid = new_id("chatcmpl")
    specs = make_specs(cid, [plan.prompt_ids], [params], body.n or 1, body)
    for s in specs:
        s.skip_special_tokens = s.skip_special_tokens and plan.skip_special_tokens
    await attach_prediction(request, model, body, specs)
    here, scored = await chat_prompt_logprobs(request, st.client, model, body, plan.prompt_ids)
    if not here:
        return Response(status_code=499)
    gens = await start_all(st.client, specs, model, keep_alive)  # EngineError → 400 etc.
    created = int(time.time())
    if body.stream:
        return SSEResponse(
            _stream(gens, plan, parallel, model, cid, created, body, want_lp, k),
            on_close=lambda: abort_all(gens),
        )
    try:
        results = await run_until_disconnect(request, lambda: collect_turn(gens, plan, parallel))
    except GenerationError as exc:
        return JSONResponse(error_body(str(exc), "server_error", None, "generation_failed"), 500)
    finally:
        for g in gens:
            g.abort()
    if results is None:
        return Response(status_code=499)
    choices = []
    for index in sorted(results):
        r = results[index]
        message: dict[str, Any] = {"role": "assistant", "content": r.text, "refusal": None}
        if r.calls:
            message["tool_calls"] = [c.openai() for c in r.calls]
            message["content"] = r.text.strip() or None
        if r.reasoning is not None:
            message["reasoning_content"] = r.reasoning
        choices.append({
            "index": index,
            "message": message,
            "logprobs": chat_logprobs(model, r.logprobs, k) if want_lp else None,
            "finish_reason": r.finish_reason,
        })
    return JSONResponse({
        "id": cid,
        "object": "chat.completion",
        "created": created,
        "model": model.name,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "choices": choices,
        "usage": usage_numbers(gens),
        **scored,
    })


def _stream(
    gens: list[Generation],
    plan: TurnPlan,
    parallel: bool,
    model: ServedModel,
    cid: str,
    created: int,
    body: ChatCompletionRequest,
    want_lp: bool,
    k: int,
) -> AsyncIterator[bytes]:
    write = chunk_writer(gens, body, cid, created, model, "chat.completion.chunk")

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None, lps: Any = None) -> bytes:
        return write([{"index": index, "delta": delta, "logprobs": lps, "finish_reason": finish}])

    async def choices() -> AsyncGenerator[bytes, None]:
        for g in gens:
            yield chunk(g.spec.index, {"role": "assistant", "content": ""})
        async for step in turn_steps(gens, plan, parallel):
            lps = chat_logprobs(model, step.logprobs, k) if want_lp and step.logprobs else None
            for e in step.events:
                if isinstance(e, ReasoningEvent):
                    delta: dict[str, Any] = {"reasoning_content": e.text}
                elif isinstance(e, TextEvent):
                    delta = {"content": e.text}
                elif isinstance(e, CallStart):
                    delta = {"tool_calls": [{"index": e.index, "id": e.id, "type": "function",
                                             "function": {"name": e.name, "arguments": ""}}]}
                elif isinstance(e, CallArgs):
                    delta = {"tool_calls": [{"index": e.index, "function": {"arguments": e.fragment}}]}
                else:
                    continue
                yield chunk(step.index, delta, lps=lps)
                lps = None
            if lps is not None:
                yield chunk(step.index, {}, lps=lps)
            if step.finish_reason:
                yield chunk(step.index, {}, step.finish_reason)

    return openai_stream(choices(), gens, body.include_usage, write)
