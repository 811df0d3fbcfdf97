"""Anthropic Messages: POST /v1/messages (+ streaming) and POST /v1/messages/count_tokens.

Requests become OpenAI-style chat messages for `server.turn` (system, and system messages
inside `messages`, → system messages where they stand; tool_use blocks → assistant tool_calls;
tool_result blocks → tool messages); the turn's events become Anthropic content blocks: thinking,
text, tool_use. Streaming sends Anthropic's events:

    message_start, ping, (content_block_start, content_block_delta*, content_block_stop)*,
    message_delta (stop_reason, usage), message_stop

A whole answer is written by the same block writer as a stream, so both have the same blocks in
the order the model wrote them. Usage counts `input_tokens` as Anthropic does (prompt tokens not
read from the prefix cache) beside `cache_read_input_tokens`, in message_start, message_delta and
whole answers.

Errors have Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`, including
401s from the key check and 400s from the engine (`AnthropicRoute` converts them).
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from fastapi import APIRouter, Request
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import from_json
from starlette.responses import JSONResponse, Response

from engine.api import EngineError
from server.errors import APIError, bad_request, from_engine_error, from_validation_error
from server.generation import (
    ChoiceSpec,
    Generation,
    GenerationError,
    ThinkBudget,
    start_all,
    usage_numbers,
)
from server.harmony import HARMONY_ANALYSIS, HARMONY_NEXT
from server.openai_api import app_state
from server.params import SamplingRequest, build_params
from server.prepare import off_loop
from server.prompts import ServedModel
from server.reasoning import THINK_CLOSE
from server.sse import SSEResponse, run_until_disconnect
from server.tools import HARMONY_FINAL, CallArgs, CallEnd, CallStart, TextEvent
from server.turn import (
    ReasoningEvent,
    Step,
    ToolChoice,
    TurnPlan,
    plan_turn,
    turn_steps,
)

log = logging.getLogger("mlxd.server")

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}


def anthropic_error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return JSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status, headers=headers)


class AnthropicRoute(APIRoute):
    """Every error on these routes (the key check included) in Anthropic's shape."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except APIError as exc:
                return anthropic_error(exc.status, exc.message, exc.headers)
            except EngineError as exc:
                err = from_engine_error(exc)
                return anthropic_error(err.status, err.message, err.headers)

        return route


router = APIRouter(route_class=AnthropicRoute)


# -- request models ---------------------------------------------------------------------------


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class MessageParam(_Model):
    role: str  # user | assistant | system (checked in chat_messages, in Anthropic's words)
    content: str | list[dict[str, Any]]


class ToolParam(_Model):
    type: str | None = None  # None or "custom": a client tool with its input_schema
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    strict: bool | None = None  # calls follow input_schema exactly (grammar-constrained)


class CountTokensRequest(_Model):
    model: str | None = None
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = Field(None, max_length=16)
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None


def _parse(model_cls: type[BaseModel], raw: bytes) -> Any:
    if not raw.strip():
        raise bad_request("The request body is empty; send a JSON object.")
    try:
        return model_cls.model_validate_json(raw)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


# -- Anthropic → chat messages ----------------------------------------------------------------


def _block_text(block: dict[str, Any], where: str) -> str:
    kind = block.get("type")
    if kind == "text":
        text = block.get("text")
        if not isinstance(text, str):
            raise bad_request(f"{where}: a text block needs a string 'text'")
        return text
    if kind == "image":
        raise bad_request(f"{where}: image input is not supported: this model has no vision")
    if kind == "document":
        return _document_text(block, where)
    if kind == "search_result":
        parts = [block.get("title"), block.get("source")]
        body = block.get("content")
        if not isinstance(body, list):
            raise bad_request(f"{where}: a search_result block needs a list of text blocks as 'content'")
        parts.append("\n".join(_block_text(b, f"{where}.content[{i}]") for i, b in enumerate(body)))
        return "\n".join(p for p in parts if isinstance(p, str) and p)
    if kind == "container_upload":
        raise bad_request(f"{where}: '{kind}' blocks are not supported: text only")
    raise bad_request(f"{where}: unexpected content block type {kind!r}")


def _document_text(block: dict[str, Any], where: str) -> str:
    """A document of text (a `text` source, or a `content` source of text blocks) reads as its
    title, context and text; PDF, image and URL sources are refused (text-only models, no network)."""
    source = block.get("source")
    if not isinstance(source, dict):
        source = {}
    kind = source.get("type")
    if kind == "text" and isinstance(source.get("data"), str):
        text = source["data"]
    elif kind == "content" and isinstance(source.get("content"), (str, list)):
        content = source["content"]
        text = content if isinstance(content, str) else "\n".join(
            _block_text(b, f"{where}.source.content[{i}]") for i, b in enumerate(content))
    else:
        raise bad_request(f"{where}: 'document' blocks are supported with a text source only "
                          f"(this one: {kind!r}): this model reads text only")
    parts = [block.get("title"), block.get("context"), text]
    return "\n".join(p for p in parts if isinstance(p, str) and p)


def _tool_result_text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        return "".join(_block_text(b, where) for b in content if isinstance(b, dict))
    raise bad_request(f"{where}: tool_result content must be a string or a list of blocks")


def system_text(system: Any) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    return "\n".join(_block_text(b, f"system[{i}]") for i, b in enumerate(system))


ROLES = ("user", "assistant", "system")


def chat_messages(body: CountTokensRequest) -> list[dict[str, Any]]:
    """Anthropic messages → chat messages. A `system` message inside `messages` (Anthropic's
    mid-conversation system messages, which Claude Code sends; see
    https://platform.claude.com/docs/en/build-with-claude/mid-conversation-system-messages)
    stays where it stands; `server.turn` folds it for templates that refuse it there. An
    assistant message's thinking blocks become its `reasoning_content`, which templates that
    show the reasoning of the current tool loop (Qwen3's; gpt-oss's as `thinking`) render, so
    the prompt repeats what the model wrote and the prefix cache holds through it."""
    out: list[dict[str, Any]] = []
    system = system_text(body.system)
    if system:
        out.append({"role": "system", "content": system})
    for i, m in enumerate(body.messages):
        if m.role not in ROLES:  # Anthropic's wording: clients (Claude Code) match on it
            raise bad_request(f'messages.{i}: Unexpected role "{m.role}". The Messages API accepts '
                              'the roles "user", "assistant" and "system".')
        if m.role == "system":
            out.append({"role": "system", "content": _system_message_text(m.content, i)})
            continue
        blocks = [{"type": "text", "text": m.content}] if isinstance(m.content, str) else m.content
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        reasoning: list[str] = []
        for j, b in enumerate(blocks):
            where = f"messages[{i}].content[{j}]"
            kind = b.get("type")
            if kind == "tool_use" and m.role == "assistant":
                calls.append({"id": str(b.get("id") or ""), "type": "function", "function": {
                    "name": str(b.get("name") or ""), "arguments": json.dumps(b.get("input") or {})}})
            elif kind == "tool_result" and m.role == "user":
                out.append({"role": "tool", "tool_call_id": str(b.get("tool_use_id") or ""),
                            "content": _tool_result_text(b.get("content"), where)})
            elif kind == "thinking" and m.role == "assistant":
                reasoning.append(str(b.get("thinking") or ""))
            elif kind == "redacted_thinking" and m.role == "assistant":
                continue  # no text to show
            else:
                texts.append(_block_text(b, where))
        if texts or calls or (not blocks):
            msg: dict[str, Any] = {"role": m.role, "content": "".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            if thought := "".join(reasoning):
                msg["reasoning_content"] = thought
            out.append(msg)
    return out


def _system_message_text(content: str | list[dict[str, Any]], i: int) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(_block_text(b, f"messages[{i}].content[{j}]") for j, b in enumerate(content))


def functions_of(body: CountTokensRequest) -> list[dict[str, Any]]:
    tools = body.tools or []
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tools: tool names must be unique")
    for i, t in enumerate(tools):
        if t.type not in (None, "custom"):  # web_search_*, code_execution_*, bash_*, text_editor_*, ...
            raise bad_request(f"tools[{i}]: {t.type!r} is one of Anthropic's own tools (run on its servers, "
                              "or with a schema only its models know); mlxd takes custom tools with an "
                              "input_schema")
    return [{"name": t.name, "description": t.description or "", "parameters": t.input_schema,
             "strict": t.strict is True} for t in tools]


def tool_choice_of(body: CountTokensRequest, functions: list[dict[str, Any]]) -> tuple[ToolChoice, bool]:
    """Anthropic's {type: auto|any|tool|none, name, disable_parallel_tool_use} → (choice, parallel)."""
    tc = body.tool_choice or {}
    parallel = not tc.get("disable_parallel_tool_use", False)
    kind = tc.get("type", "auto" if functions else "none")
    if not functions or kind == "none":
        return ToolChoice("none"), parallel
    if kind == "auto":
        return ToolChoice("auto"), parallel
    if kind == "any":
        return ToolChoice("required"), parallel
    if kind == "tool":
        name = tc.get("name")
        if name not in {f["name"] for f in functions}:
            raise bad_request(f"tool_choice names a tool that is not in 'tools': {name!r}")
        return ToolChoice("function", name), False
    raise bad_request(f"tool_choice.type must be auto, any, tool or none, not {kind!r}")


def _plan(model: ServedModel, body: CountTokensRequest) -> tuple[TurnPlan, bool]:
    functions = functions_of(body)
    choice, parallel = tool_choice_of(body, functions)
    kwargs = None
    if body.thinking is not None:  # templates with a thinking switch (Qwen3's enable_thinking)
        kwargs = {"enable_thinking": body.thinking.get("type") == "enabled"}
    msgs = chat_messages(body)
    prefilled = _continues_assistant(body, msgs)
    plan = plan_turn(model, msgs, functions, choice, parallel=parallel, template_kwargs=kwargs,
                     add_generation_prompt=not prefilled, continue_final_message=prefilled)
    return plan, parallel


def _continues_assistant(body: CountTokensRequest, msgs: list[dict[str, Any]]) -> bool:
    """A conversation that ends with an assistant message of text is a prefill: the answer
    continues that text (the response holds only what follows it), as Anthropic's API does."""
    return (
        bool(body.messages) and body.messages[-1].role == "assistant"
        and bool(msgs) and msgs[-1]["role"] == "assistant"
        and not msgs[-1].get("tool_calls") and bool(msgs[-1]["content"])
    )


def _think_budget(body: MessagesRequest, plan: TurnPlan, model: ServedModel) -> ThinkBudget | None:
    """`thinking: {type: enabled, budget_tokens: N}` on a model that writes <think> reasoning
    (or gpt-oss's analysis channel): after N output tokens an unclosed reasoning is closed and
    the answer follows."""
    thinking = body.thinking or {}
    budget = thinking.get("budget_tokens")
    if thinking.get("type") != "enabled" or not (plan.thinks or plan.harmony):
        return None
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise bad_request("thinking.budget_tokens must be a positive integer")
    if plan.harmony:
        close = model.tokenizer.encode(HARMONY_NEXT + HARMONY_FINAL, add_special_tokens=False)
        return ThinkBudget(budget, list(close), False, HARMONY_ANALYSIS, HARMONY_NEXT)
    close = model.tokenizer.encode("\n" + THINK_CLOSE + "\n\n", add_special_tokens=False)
    return ThinkBudget(budget, list(close), plan.starts_in_reasoning)


def sampling_request(body: MessagesRequest, plan: TurnPlan) -> SamplingRequest:
    """Anthropic's field names → the shared conversion's input (server.params)."""
    return SamplingRequest(max_tokens=body.max_tokens, temperature=body.temperature,
                           top_p=body.top_p, top_k=body.top_k, constraint=plan.constraint)


# -- routes -----------------------------------------------------------------------------------


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> Response:
    st = app_state(request)
    body = _parse(CountTokensRequest, await request.body())
    model = await st.models.select(body.model)
    plan, _ = await off_loop(request, _plan, model, body)
    return JSONResponse({"input_tokens": len(plan.prompt_ids)})


@router.post("/v1/messages")
async def messages(request: Request) -> Response:
    st = app_state(request)
    body: MessagesRequest = _parse(MessagesRequest, await request.body())
    model = await st.models.select(body.model)
    plan, parallel = await off_loop(request, _plan, model, body)
    params = build_params(sampling_request(body, plan), st.config, model, plan.prompt_ids, "messages")
    mid = "msg_" + secrets.token_hex(12)
    stops = [s for s in (body.stop_sequences or []) if s]
    spec = ChoiceSpec(index=0, req_id=mid, prompt_ids=plan.prompt_ids, params=params, stop=stops,
                      skip_special_tokens=plan.skip_special_tokens,
                      think_budget=_think_budget(body, plan, model))
    gens = await start_all(st.client, [spec], model)
    if body.stream:
        return SSEResponse(_stream(gens[0], plan, parallel, model, mid), on_close=gens[0].abort)
    try:
        blocks = await run_until_disconnect(request, lambda: _collect(gens[0], plan, parallel))
    except GenerationError as exc:
        return anthropic_error(500, str(exc))
    finally:
        gens[0].abort()
    if blocks is None:
        return Response(status_code=499)
    return JSONResponse(_message(mid, model, blocks, gens[0]))


async def _collect(gen: Generation, plan: TurnPlan, parallel: bool) -> _BlockWriter:
    blocks = _BlockWriter(send=False)
    async for step in turn_steps([gen], plan, parallel):
        blocks.feed(step)
    blocks.close()
    return blocks


def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _input_of(arguments: str) -> dict[str, Any]:
    """A tool_use block's input: what parsed of the call's arguments.

    A call cut by max_tokens stays in the answer, as on Anthropic's API: stop_reason
    "max_tokens" with the incomplete tool_use block last, which the client retries with a higher
    max_tokens (https://platform.claude.com/docs/en/agents-and-tools/tool-use/implement-tool-use,
    "Handling the max_tokens stop reason").
    Its input is the partial JSON read the way Anthropic's SDKs read the streamed
    input_json_delta fragments (complete members kept, an unfinished string or key dropped), so a
    whole answer and a streamed one end with the same blocks. Arguments that are no JSON object
    at all give {}."""
    try:
        value = from_json(arguments, allow_partial=True) if arguments else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _stop(gen: Generation, finish: str | None) -> tuple[str, str | None]:
    matched = gen.pipeline.matcher.matched
    if matched is not None:
        return "stop_sequence", matched
    return STOP_REASONS.get(finish or "stop", "end_turn"), None


def _usage(gen: Generation) -> dict[str, Any]:
    u = usage_numbers([gen])
    cached = u["prompt_tokens_details"]["cached_tokens"]
    return {"input_tokens": u["prompt_tokens"] - cached, "output_tokens": u["completion_tokens"],
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def _message(mid: str, model: ServedModel, blocks: _BlockWriter, gen: Generation) -> dict[str, Any]:
    stop_reason, stop_sequence = _stop(gen, blocks.finish)
    return {"id": mid, "type": "message", "role": "assistant", "model": model.name, "content": blocks.content,
            "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": _usage(gen)}


def sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()


def _message_start(mid: str, model: ServedModel, gen: Generation) -> list[bytes]:
    start: dict[str, Any] = {"id": mid, "type": "message", "role": "assistant", "model": model.name, "content": [],
             "stop_reason": None, "stop_sequence": None, "usage": _usage(gen)}
    return [sse("message_start", {"type": "message_start", "message": start}), sse("ping", {"type": "ping"})]


async def _stream(gen: Generation, plan: TurnPlan, parallel: bool, model: ServedModel, mid: str) -> AsyncIterator[bytes]:
    """message_start goes out with the first step, once the engine has said how much of the
    prompt the prefix cache served (its usage then splits input and cache reads as the final
    message_delta does)."""
    started = False
    blocks = _BlockWriter()
    last_ping = time.monotonic()
    try:
        async for step in turn_steps([gen], plan, parallel):
            if not started:
                started = True
                for out in _message_start(mid, model, gen):
                    yield out
            for out in blocks.feed(step):
                yield out
            if time.monotonic() - last_ping > 10.0:  # keep idle proxies from closing the stream
                last_ping = time.monotonic()
                yield sse("ping", {"type": "ping"})
    except GenerationError as exc:
        yield sse("error", {"type": "error", "error": {"type": "api_error", "message": str(exc)}})
        return
    if not started:
        for out in _message_start(mid, model, gen):
            yield out
    for out in blocks.close():
        yield out
    stop_reason, stop_sequence = _stop(gen, blocks.finish)
    yield sse("message_delta", {"type": "message_delta",
                                "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                "usage": _usage(gen)})  # cumulative, as Anthropic's
    yield sse("message_stop", {"type": "message_stop"})


class _BlockWriter:
    """Turn events → content_block_* events, one block open at a time, and the message content
    they make (`content`): a whole answer is written by the same writer with send=False, so it
    has the blocks a streamed one ends with. Whitespace-only text between tool calls is held and
    dropped if no real text follows; a text block's trailing whitespace is held until more text
    comes, dropped when another block follows."""

    def __init__(self, send: bool = True) -> None:
        self.send = send
        self.index = -1
        self.open: str | None = None  # thinking | text | tool_use
        self.pending_ws = ""
        self.tail_ws = ""  # trailing whitespace of the open text block, not sent yet
        self.json = ""  # the open tool_use block's arguments so far
        self.content: list[dict[str, Any]] = []
        self.finish: str | None = None

    def _event(self, event: str, data: dict[str, Any]) -> list[bytes]:
        return [sse(event, data)] if self.send else []

    def _start(self, block: dict[str, Any]) -> list[bytes]:
        out = self._stop()
        self.index += 1
        self.open = block["type"]
        self.content.append({**block, "signature": ""} if block["type"] == "thinking" else dict(block))
        self.json = ""
        return out + self._event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                         "content_block": block})

    def _stop(self) -> list[bytes]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":
            out += self._delta({"type": "signature_delta", "signature": ""})
        elif self.open == "tool_use":
            self.content[-1]["input"] = _input_of(self.json)
        out += self._event("content_block_stop", {"type": "content_block_stop", "index": self.index})
        self.open = None
        return out

    def _delta(self, delta: dict[str, Any]) -> list[bytes]:
        return self._event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def feed(self, step: Step) -> list[bytes]:
        if step.finish_reason:
            self.finish = step.finish_reason
        return [b for e in step.events for b in self.write(e)]

    def write(self, e: Any) -> list[bytes]:
        out: list[bytes] = []
        if isinstance(e, ReasoningEvent):
            if self.open != "thinking":
                out += self._start({"type": "thinking", "thinking": ""})
            self.content[-1]["thinking"] += e.text
            out += self._delta({"type": "thinking_delta", "thinking": e.text})
        elif isinstance(e, TextEvent):
            out += self._text(e.text)
        elif isinstance(e, CallStart):
            self.pending_ws = self.tail_ws = ""
            out += self._start({"type": "tool_use", "id": _tool_id(e.id), "name": e.name, "input": {}})
        elif isinstance(e, CallArgs):
            self.json += e.fragment
            out += self._delta({"type": "input_json_delta", "partial_json": e.fragment})
        elif isinstance(e, CallEnd):
            out += self._stop()
        return out

    def _text(self, text: str) -> list[bytes]:
        out: list[bytes] = []
        if self.open != "text":
            if not (self.pending_ws + text).strip():
                self.pending_ws += text
                return out
            text = (self.pending_ws + text).lstrip() if self.index >= 0 else self.pending_ws + text
            self.pending_ws = ""
            out += self._start({"type": "text", "text": ""})
        text = self.tail_ws + text
        body = text.rstrip()
        self.tail_ws = text[len(body):]
        if body:
            self.content[-1]["text"] += body
            out += self._delta({"type": "text_delta", "text": body})
        return out

    def close(self) -> list[bytes]:
        """The end of the answer: an open text block keeps its trailing whitespace."""
        out = []
        if self.open == "text" and self.tail_ws:
            self.content[-1]["text"] += self.tail_ws
            out += self._delta({"type": "text_delta", "text": self.tail_ws})
        self.tail_ws = ""
        return out + self._stop()
