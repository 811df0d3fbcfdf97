"""OpenAI Responses: POST /v1/responses, GET /v1/responses/{id}, POST /v1/responses/{id}/cancel,
DELETE /v1/responses/{id}.

Input items become chat messages for `server.turn` (messages; function_call → an assistant tool
call; function_call_output → a tool message); output items are reasoning, message and
function_call. `previous_response_id` continues a stored conversation: each stored response keeps
the chat messages that led to it plus its own output, in a bounded in-memory LRU
(`ResponseStore`, default 1,024 responses; `store: false` keeps nothing). `background: true`
returns at once (status "in_progress"); GET polls, cancel aborts the engine rows.

Streaming events: response.created, response.in_progress, response.output_item.added,
response.content_part.added, response.output_text.delta / .done, response.content_part.done,
response.reasoning_text.delta / .done, response.function_call_arguments.delta / .done,
response.output_item.done, response.completed (or response.incomplete), each with a
sequence_number.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.responses import JSONResponse, Response

from server.errors import APIError, bad_request, error_body, from_validation_error
from server.generation import ChoiceSpec, Generation, GenerationError, start_all, usage_numbers
from server.openai_api import app_state
from server.params import SamplingRequest, build_params
from server.prepare import off_loop
from server.prompts import ServedModel, message_text
from server.sse import SSEResponse, run_until_disconnect
from server.structured import response_format_constraint
from server.tools import CallArgs, CallEnd, CallStart, TextEvent, ToolCall, function_specs
from server.turn import (
    ReasoningEvent,
    TurnPlan,
    TurnResult,
    collect_turn,
    parse_tool_choice,
    plan_turn,
    turn_steps,
)

router = APIRouter()

DEFAULT_STORE_SIZE = 1024


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    stream: bool = False
    store: bool = True
    background: bool = False
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    truncation: str | None = None


@dataclass(slots=True)
class Stored:
    response: dict[str, Any]
    messages: list[dict[str, Any]]  # the conversation up to and including this response's output
    gens: list[Generation] = field(default_factory=list)
    task: asyncio.Task[Any] | None = None


class ResponseStore:
    """Bounded LRU of responses by id (oldest out first)."""

    def __init__(self, max_size: int = DEFAULT_STORE_SIZE):
        self.max_size = max_size
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def put(self, rid: str, item: Stored) -> None:
        self._items[rid] = item
        self._items.move_to_end(rid)
        while len(self._items) > self.max_size:
            self._items.popitem(last=False)

    def get(self, rid: str) -> Stored | None:
        item = self._items.get(rid)
        if item is not None:
            self._items.move_to_end(rid)
        return item

    def pop(self, rid: str) -> Stored | None:
        return self._items.pop(rid, None)

    def __len__(self) -> int:
        return len(self._items)


def store_of(request: Request) -> ResponseStore:
    state = request.app.state
    if not hasattr(state, "responses_store"):
        state.responses_store = ResponseStore()
    return state.responses_store


# -- input items → chat messages --------------------------------------------------------------


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of parts", where)
    return message_text(content, where) or ""


def input_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(body.input):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"{where}.role must be user, assistant, system or developer", where)
            out.append({"role": "system" if role == "developer" else role,
                        "content": _content_text(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": str(item.get("call_id") or ""), "type": "function",
                    "function": {"name": str(item.get("name") or ""), "arguments": str(item.get("arguments") or "{}")}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else json.dumps(output)
            out.append({"role": "tool", "tool_call_id": str(item.get("call_id") or ""), "content": text})
        elif kind in ("reasoning", "item_reference"):
            continue  # earlier reasoning is not replayed; references are resolved by id only
        else:
            raise bad_request(f"{where}: input items of type {kind!r} are not supported", where)
    return out


def _functions(body: ResponsesRequest) -> list[dict[str, Any]]:
    tools = []
    for i, t in enumerate(body.tools or []):
        if not isinstance(t, dict) or t.get("type") != "function":
            raise bad_request(f"tools[{i}]: only function tools are supported", "tools")
        tools.append({"type": "function", "function": {k: t.get(k) for k in ("name", "description", "parameters")
                                                       if t.get(k) is not None}})
    try:
        return function_specs(tools)
    except ValueError as exc:
        raise bad_request(str(exc), "tools") from None


# -- output -----------------------------------------------------------------------------------


def _new(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def output_items(r: TurnResult, ids: dict[str, str]) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if r.reasoning:
        items.append({"type": "reasoning", "id": ids.setdefault("rs", _new("rs")), "summary": [],
                      "content": [{"type": "reasoning_text", "text": r.reasoning}]})
    text = r.text.strip() if r.calls else r.text
    if text or not r.calls:
        items.append({"type": "message", "id": ids.setdefault("msg", _new("msg")), "status": "completed",
                      "role": "assistant",
                      "content": [{"type": "output_text", "text": text, "annotations": []}]})
    for c in r.calls:
        items.append({"type": "function_call", "id": "fc_" + c.id.removeprefix("call_"), "call_id": c.id,
                      "name": c.name, "arguments": c.arguments,
                      "status": "completed" if _is_json_object(c.arguments) else "incomplete"})
    return items


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def _usage(gens: list[Generation], reasoning_tokens: int = 0) -> dict[str, Any]:
    u = usage_numbers(gens)
    return {"input_tokens": u["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": u["total_tokens"]}


def _skeleton(rid: str, body: ResponsesRequest, model: ServedModel, status: str) -> dict[str, Any]:
    return {
        "id": rid, "object": "response", "created_at": int(time.time()), "status": status,
        "model": model.name, "output": [], "error": None, "incomplete_details": None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "previous_response_id": body.previous_response_id,
        "temperature": body.temperature if body.temperature is not None else 1.0,
        "top_p": body.top_p if body.top_p is not None else 1.0,
        "tools": body.tools or [], "tool_choice": body.tool_choice or "auto",
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "text": body.text or {"format": {"type": "text"}}, "reasoning": body.reasoning,
        "metadata": body.metadata or {}, "store": body.store, "background": body.background,
        "truncation": body.truncation or "disabled", "usage": None,
    }


def _finish(resp: dict[str, Any], r: TurnResult, gens: list[Generation], ids: dict[str, str]) -> None:
    resp["output"] = output_items(r, ids)
    resp["usage"] = _usage(gens)
    if r.finish_reason == "length":
        resp["status"] = "incomplete"
        resp["incomplete_details"] = {"reason": "max_output_tokens"}
    elif r.finish_reason == "abort":
        resp["status"] = "cancelled"
    else:
        resp["status"] = "completed"


def _history(messages: list[dict[str, Any]], r: TurnResult) -> list[dict[str, Any]]:
    msg: dict[str, Any] = {"role": "assistant", "content": r.text.strip() if r.calls else r.text}
    if r.calls:
        msg["tool_calls"] = [c.openai() for c in r.calls]
    return [*messages, msg]


# -- routes -----------------------------------------------------------------------------------


def sampling_request(body: ResponsesRequest, plan: TurnPlan) -> SamplingRequest:
    """The Responses API's field names → the shared conversion's input (server.params)."""
    return SamplingRequest(max_tokens=body.max_output_tokens, temperature=body.temperature,
                           top_p=body.top_p, constraint=plan.constraint,
                           max_tokens_param="max_output_tokens")


@dataclass(slots=True)
class _Prepared:
    rid: str
    body: ResponsesRequest
    plan: TurnPlan
    parallel: bool
    messages: list[dict[str, Any]]
    gens: list[Generation]


async def _prepare(request: Request) -> _Prepared:
    st = app_state(request)
    model = st.model
    raw = await request.body()
    if not raw.strip():
        raise bad_request("The request body is empty; send a JSON object.")
    try:
        body = ResponsesRequest.model_validate_json(raw)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
    if body.model is not None and body.model not in model.aliases:
        raise APIError(404, f"The model '{body.model}' does not exist; this server serves '{model.name}'.",
                       param="model", code="model_not_found")
    history: list[dict[str, Any]] = []
    if body.previous_response_id:
        prev = store_of(request).get(body.previous_response_id)
        if prev is None:
            raise APIError(404, f"Previous response with id '{body.previous_response_id}' not found.",
                           param="previous_response_id", code="previous_response_not_found")
        if prev.response["status"] == "in_progress":
            raise bad_request("The previous response is still in progress.", "previous_response_id")
        history = [m for m in prev.messages if m["role"] != "system"]  # instructions do not carry over
    messages = [*history, *input_messages(body)]
    if body.instructions:
        messages = [{"role": "system", "content": body.instructions}, *messages]
    functions = _functions(body)
    choice = parse_tool_choice(body.tool_choice, functions)
    parallel = body.parallel_tool_calls is not False
    fmt = (body.text or {}).get("format")
    plan = await off_loop(request, plan_turn, model, messages, functions, choice, parallel=parallel,
                          constraint=response_format_constraint(fmt, "text.format"), param="input")
    params = build_params(sampling_request(body, plan), st.config, model, plan.prompt_ids, "input")
    rid = _new("resp")
    spec = ChoiceSpec(index=0, req_id=rid, prompt_ids=plan.prompt_ids, params=params,
                      skip_special_tokens=plan.skip_special_tokens)
    gens = await start_all(st.client, [spec], model.info.eos_token_ids)
    return _Prepared(rid, body, plan, parallel, messages, gens)


@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    p = await _prepare(request)
    model = app_state(request).model
    store = store_of(request)
    resp = _skeleton(p.rid, p.body, model, "in_progress")
    stored = Stored(resp, p.messages, p.gens)
    if p.body.store or p.body.background:
        store.put(p.rid, stored)
    if p.body.background:
        stored.task = asyncio.create_task(_run_background(p, stored))
        return JSONResponse(resp)
    if p.body.stream:
        return SSEResponse(_stream(p, resp, stored), on_close=p.gens[0].abort)
    try:
        results = await run_until_disconnect(request, lambda: collect_turn(p.gens, p.plan, p.parallel))
    except GenerationError as exc:
        resp["status"] = "failed"
        resp["error"] = {"code": "server_error", "message": str(exc)}
        return JSONResponse(error_body(str(exc), "server_error", None, "generation_failed"), 500)
    finally:
        p.gens[0].abort()
    if results is None:
        store.pop(p.rid)
        return Response(status_code=499)
    _finish(resp, results[0], p.gens, {})
    stored.messages = _history(p.messages, results[0])
    return JSONResponse(resp)


async def _run_background(p: _Prepared, stored: Stored) -> None:
    resp = stored.response
    try:
        results = await collect_turn(p.gens, p.plan, p.parallel)
        if resp["status"] != "cancelled":
            _finish(resp, results[0], p.gens, {})
        stored.messages = _history(p.messages, results[0])
    except GenerationError as exc:
        resp["status"] = "failed"
        resp["error"] = {"code": "server_error", "message": str(exc)}
    except asyncio.CancelledError:
        resp["status"] = "cancelled"
    finally:
        p.gens[0].abort()


@router.get("/v1/responses/{rid}")
async def get_response(rid: str, request: Request) -> Response:
    item = store_of(request).get(rid)
    if item is None:
        raise APIError(404, f"Response with id '{rid}' not found.", param="response_id", code="not_found")
    return JSONResponse(item.response)


@router.delete("/v1/responses/{rid}")
async def delete_response(rid: str, request: Request) -> Response:
    item = store_of(request).pop(rid)
    if item is None:
        raise APIError(404, f"Response with id '{rid}' not found.", param="response_id", code="not_found")
    _cancel(item)
    return JSONResponse({"id": rid, "object": "response.deleted", "deleted": True})


def _cancel(item: Stored) -> None:
    for g in item.gens:
        g.abort()
    if item.task is not None and not item.task.done():
        item.task.cancel()
    if item.response["status"] in ("in_progress", "queued"):
        item.response["status"] = "cancelled"


@router.post("/v1/responses/{rid}/cancel")
async def cancel_response(rid: str, request: Request) -> Response:
    item = store_of(request).get(rid)
    if item is None:
        raise APIError(404, f"Response with id '{rid}' not found.", param="response_id", code="not_found")
    _cancel(item)
    if item.task is not None:
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(asyncio.shield(item.task), 2.0)
    return JSONResponse(item.response)


# -- streaming --------------------------------------------------------------------------------


class _Events:
    def __init__(self) -> None:
        self.seq = 0

    def __call__(self, kind: str, **data: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()


async def _stream(p: _Prepared, resp: dict[str, Any], stored: Stored) -> AsyncIterator[bytes]:
    try:
        async with contextlib.aclosing(_stream_events(p, resp, stored)) as events:
            async for chunk in events:
                yield chunk
    finally:
        if resp["status"] == "in_progress":  # the client left mid-stream
            resp["status"] = "cancelled"


async def _stream_events(p: _Prepared, resp: dict[str, Any], stored: Stored) -> AsyncIterator[bytes]:
    ev = _Events()
    yield ev("response.created", response=dict(resp))
    yield ev("response.in_progress", response=dict(resp))
    out_index = -1
    open_item: dict[str, Any] | None = None  # the output item being streamed
    result = TurnResult()
    ids: dict[str, str] = {}
    calls: list[ToolCall] = []

    def close_item() -> list[bytes]:
        nonlocal open_item
        item, open_item = open_item, None
        if item is None:
            return []
        out = []
        if item["type"] == "message":
            part = item["content"][0]
            out.append(ev("response.output_text.done", item_id=item["id"], output_index=out_index,
                          content_index=0, text=part["text"]))
            out.append(ev("response.content_part.done", item_id=item["id"], output_index=out_index,
                          content_index=0, part=part))
        elif item["type"] == "reasoning":
            text = item["content"][0]["text"]
            out.append(ev("response.reasoning_text.done", item_id=item["id"], output_index=out_index,
                          content_index=0, text=text))
        elif item["type"] == "function_call":
            out.append(ev("response.function_call_arguments.done", item_id=item["id"], output_index=out_index,
                          arguments=item["arguments"]))
        item["status"] = "completed" if item["type"] != "reasoning" else item.get("status")
        if item["type"] == "reasoning":
            item.pop("status", None)
        out.append(ev("response.output_item.done", output_index=out_index, item=item))
        return out

    def open_new(item: dict[str, Any]) -> list[bytes]:
        nonlocal open_item, out_index
        out = close_item()
        out_index += 1
        open_item = item
        out.append(ev("response.output_item.added", output_index=out_index, item=item))
        if item["type"] == "message":
            out.append(ev("response.content_part.added", item_id=item["id"], output_index=out_index,
                          content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        return out

    pending_ws = ""
    try:
        async for step in turn_steps(p.gens, p.plan, p.parallel):
            for e in step.events:
                if isinstance(e, ReasoningEvent):
                    result.reasoning = (result.reasoning or "") + e.text
                    if open_item is None or open_item["type"] != "reasoning":
                        for b in open_new({"type": "reasoning", "id": ids.setdefault("rs", _new("rs")),
                                           "summary": [], "content": [{"type": "reasoning_text", "text": ""}]}):
                            yield b
                    open_item["content"][0]["text"] += e.text
                    yield ev("response.reasoning_text.delta", item_id=open_item["id"], output_index=out_index,
                             content_index=0, delta=e.text)
                elif isinstance(e, TextEvent):
                    result.text += e.text
                    text = e.text
                    if open_item is None or open_item["type"] != "message":
                        if not (pending_ws + text).strip():
                            pending_ws += text
                            continue
                        text, pending_ws = (pending_ws + text).lstrip() if out_index >= 0 else pending_ws + text, ""
                        for b in open_new({"type": "message", "id": ids.setdefault("msg", _new("msg")),
                                           "status": "in_progress", "role": "assistant",
                                           "content": [{"type": "output_text", "text": "", "annotations": []}]}):
                            yield b
                    open_item["content"][0]["text"] += text
                    yield ev("response.output_text.delta", item_id=open_item["id"], output_index=out_index,
                             content_index=0, delta=text)
                elif isinstance(e, CallStart):
                    pending_ws = ""
                    calls.append(ToolCall(e.id, e.name, ""))
                    for b in open_new({"type": "function_call", "id": "fc_" + e.id.removeprefix("call_"),
                                       "call_id": e.id, "name": e.name, "arguments": "", "status": "in_progress"}):
                        yield b
                elif isinstance(e, CallArgs):
                    calls[e.index].arguments += e.fragment
                    if open_item is not None and open_item["type"] == "function_call":
                        open_item["arguments"] += e.fragment
                        yield ev("response.function_call_arguments.delta", item_id=open_item["id"],
                                 output_index=out_index, delta=e.fragment)
                elif isinstance(e, CallEnd):
                    for b in close_item():
                        yield b
            if step.finish_reason:
                result.finish_reason = step.finish_reason
    except GenerationError as exc:
        resp["status"] = "failed"
        resp["error"] = {"code": "server_error", "message": str(exc)}
        yield ev("response.failed", response=resp)
        return
    for b in close_item():
        yield b
    result.calls = calls
    _finish(resp, result, p.gens, ids)
    stored.messages = _history(p.messages, result)
    kind = "response.completed" if resp["status"] == "completed" else "response.incomplete"
    yield ev(kind, response=resp)
