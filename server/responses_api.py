"""OpenAI Responses: POST /v1/responses, GET /v1/responses/{id}, POST /v1/responses/{id}/cancel,
DELETE /v1/responses/{id}.

Input items become chat messages for `server.turn` (messages; function_call → an assistant tool
call; function_call_output → a tool message); output items are reasoning, message and
function_call. Tools: function tools; namespace tools (Codex's grouping of MCP tools) unpacked
into their functions, which the prompt names `namespace + name` and function_call items give back
as `name` and `namespace`; custom tools (free-text input, such as Codex's apply_patch) offered as
a function of one string argument, `input`, and given back as custom_tool_call items (input
items of that type go back into the prompt the same way); hosted tools (web_search, image_generation, ...) and other types this
server cannot run are left out of the prompt, logged once per type. A whole answer is written by
the same item writer as a stream, so both have the same output items.

`previous_response_id` continues a stored conversation: each stored response keeps
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
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, cast

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.responses import JSONResponse, Response

from server.errors import APIError, bad_request, error_body, from_validation_error
from server.generation import (
    ChoiceSpec,
    Generation,
    GenerationError,
    TokenLogprob,
    start_all,
    usage_numbers,
)
from server.openai_api import app_state, chat_logprobs
from server.params import SamplingRequest, build_params
from server.prepare import off_loop
from server.prompts import ServedModel, effort_template_kwargs, message_text
from server.sse import SSEResponse, run_until_disconnect
from server.structured import response_format_constraint
from server.tools import CallArgs, CallEnd, CallStart, TextEvent, ToolCall, function_specs
from server.turn import (
    ReasoningEvent,
    Step,
    TurnPlan,
    TurnResult,
    parse_tool_choice,
    plan_turn,
    turn_steps,
)

router = APIRouter()
log = logging.getLogger("mlxd.server")

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
    top_logprobs: int | None = Field(None, ge=0, le=20)
    include: list[str] | None = None
    stream: bool = False
    store: bool = True
    background: bool = False
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    truncation: str | None = None

    @property
    def want_logprobs(self) -> bool:
        """The output text's token logprobs were asked for (`include`)."""
        return LOGPROBS_INCLUDE in (self.include or [])


LOGPROBS_INCLUDE = "message.output_text.logprobs"


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
    reasoning = ""  # a reasoning item's text, for the assistant message after it
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
            name = str(item.get("name") or "")
            if isinstance(item.get("namespace"), str) and item["namespace"]:
                name = flat_name(item["namespace"], name)
            _add_call(out, item, name, str(item.get("arguments") or "{}"))
        elif kind == "custom_tool_call":  # a custom tool's free-text input, as its function's argument
            _add_call(out, item, str(item.get("name") or ""),
                      json.dumps({CUSTOM_INPUT: str(item.get("input") or "")}))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = item.get("output")
            text = output if isinstance(output, str) else json.dumps(output)
            out.append({"role": "tool", "tool_call_id": str(item.get("call_id") or ""), "content": text})
        elif kind == "reasoning":
            reasoning += _reasoning_text(item)
            continue
        elif kind == "item_reference":
            continue  # references are resolved by id only
        else:
            raise bad_request(f"{where}: input items of type {kind!r} are not supported", where)
        if reasoning and out[-1]["role"] == "assistant":
            out[-1]["reasoning_content"] = out[-1].get("reasoning_content", "") + reasoning
        reasoning = ""
    return out


def _reasoning_text(item: dict[str, Any]) -> str:
    """A reasoning input item's text (its reasoning_text parts, as mlxd gives them out; else its
    summary): the next assistant message's `reasoning_content`, which templates that show the
    current tool loop's reasoning render (encrypted content is OpenAI's own and skipped)."""
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list):
        return ""
    return "".join(str(p.get("text") or "") for p in parts if isinstance(p, dict))


def _add_call(out: list[dict[str, Any]], item: dict[str, Any], name: str, arguments: str) -> None:
    """A call input item as a tool call of the assistant message it belongs to."""
    call = {"id": str(item.get("call_id") or ""), "type": "function",
            "function": {"name": name, "arguments": arguments}}
    if out and out[-1]["role"] == "assistant":
        out[-1].setdefault("tool_calls", []).append(call)
    else:
        out.append({"role": "assistant", "content": "", "tool_calls": [call]})


@dataclass(slots=True)
class ToolSet:
    """The request's tools as the prompt sees them: function specs (a namespace's functions under
    their flat names) and, for each flat name, the (namespace, name) the client calls back."""

    functions: list[dict[str, Any]] = field(default_factory=list)
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)
    custom: set[str] = field(default_factory=set)  # custom tools: called with free text

    def call_name(self, flat: str) -> dict[str, str]:
        """A function_call item's name fields: {"name"} or {"name", "namespace"}."""
        if flat in self.namespaced:
            namespace, name = self.namespaced[flat]
            return {"name": name, "namespace": namespace}
        return {"name": flat}


def flat_name(namespace: str, name: str) -> str:
    """One name for a namespaced function in the prompt: Codex's MCP namespaces end in "__"
    ("mcp__server__" + "tool"); others get "__" between."""
    return f"{namespace}{name}" if namespace.endswith("__") else f"{namespace}__{name}"


_NOT_RUN_LOGGED: set[str] = set()  # tool types already logged as left out


def _not_run(kind: str) -> None:
    if kind not in _NOT_RUN_LOGGED:
        _NOT_RUN_LOGGED.add(kind)
        log.warning("tools of type %r are not run by this server; left out of the prompt", kind)


def _function_spec(t: dict[str, Any], where: str, name: Any) -> dict[str, Any]:
    if not isinstance(name, str) or not name:
        raise bad_request(f"{where}.name must be a non-empty string", "tools")
    fn = {k: t[k] for k in ("description", "parameters", "strict") if t.get(k) is not None}
    try:
        return function_specs([{"type": "function", "function": {**fn, "name": name}}])[0]
    except ValueError as exc:
        raise bad_request(str(exc).replace("tools[0].function", where, 1).replace("tools[0]", where, 1),
                          "tools") from None


def tool_set(body: ResponsesRequest) -> ToolSet:
    """Function tools; namespace tools (Codex groups MCP tools so) unpacked into their functions;
    hosted tools (web_search, file_search, ...) and other types this server cannot run left out,
    logged once per type."""
    out = ToolSet()
    for i, t in enumerate(body.tools or []):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or not isinstance(t.get("type"), str):
            raise bad_request(f"{where} must be an object with a string 'type'", "tools")
        if t["type"] == "function":
            out.functions.append(_function_spec(t, where, t.get("name")))
        elif t["type"] == "namespace":
            _unpack_namespace(t, where, out)
        elif t["type"] == "custom":
            out.functions.append(_custom_spec(t, where))
            out.custom.add(out.functions[-1]["name"])
        else:
            _not_run(t["type"])
    if len({f["name"] for f in out.functions}) != len(out.functions):
        raise bad_request("tools: tool names must be unique (a namespace's tools count as "
                          "namespace + name)", "tools")
    return out


CUSTOM_INPUT = "input"  # the one argument a custom tool is offered with


def _custom_spec(t: dict[str, Any], where: str) -> dict[str, Any]:
    """A custom tool (free-text input, e.g. Codex's apply_patch) as the function the model is
    trained to call: one string argument, `input`, with the tool's grammar, if it has one, in
    its description. A regex grammar is also enforced (the argument's whole text must match it;
    the function is strict); a Lark grammar is not."""
    fmt = t.get("format")
    description = str(t.get("description") or "")
    prop: dict[str, Any] = {"type": "string", "description": "The tool's input, as free text."}
    strict = None
    if isinstance(fmt, dict) and fmt.get("type") == "grammar" and isinstance(fmt.get("definition"), str):
        syntax = fmt.get("syntax") or "lark"
        description += f"\n\nThe input must follow this {syntax} grammar:\n{fmt['definition']}"
        if syntax == "regex":  # a JSON-schema pattern matches anywhere in the string: anchored
            prop["pattern"], strict = f"^(?:{fmt['definition']})$", True
    params = {"type": "object", "additionalProperties": False, "required": [CUSTOM_INPUT],
              "properties": {CUSTOM_INPUT: prop}}
    return _function_spec({"description": description.strip() or None, "parameters": params, "strict": strict},
                          where, t.get("name"))


def _custom_input(arguments: str) -> str:
    """A custom tool call's input back from its function arguments (the raw text when the model
    wrote something else)."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    if isinstance(value, dict) and isinstance(value.get(CUSTOM_INPUT), str):
        return value[CUSTOM_INPUT]
    return arguments


def _unpack_namespace(t: dict[str, Any], where: str, out: ToolSet) -> None:
    namespace, inner = t.get("name"), t.get("tools")
    if not isinstance(namespace, str) or not namespace:
        raise bad_request(f"{where}.name must be a non-empty string", "tools")
    if not isinstance(inner, list):
        raise bad_request(f"{where}.tools must be a list of function tools", "tools")
    for j, f in enumerate(inner):
        fwhere = f"{where}.tools[{j}]"
        if not isinstance(f, dict) or f.get("type", "function") != "function":
            _not_run(f"{f.get('type')} (in a namespace)" if isinstance(f, dict) else "non-object")
            continue
        spec = _function_spec(f, fwhere, f.get("name"))
        name = spec["name"]
        spec["name"] = flat_name(namespace, name)
        out.functions.append(spec)
        out.namespaced[spec["name"]] = (namespace, name)


def _tool_choice(value: Any) -> Any:
    """A tool_choice naming a namespaced function ({"type": "function", "namespace", "name"})
    names it by its flat name; one naming a custom tool names its function."""
    if isinstance(value, dict) and isinstance(value.get("namespace"), str) and isinstance(value.get("name"), str):
        return {"type": "function", "name": flat_name(value["namespace"], value["name"])}
    if isinstance(value, dict) and value.get("type") == "custom":
        return {"type": "function", "name": value.get("name")}
    return value


# -- output -----------------------------------------------------------------------------------


def _new(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def _set_status(item: dict[str, Any], cut: bool) -> None:
    """A finished item's status. `cut`: the output limit ended the response with this item
    open. A message or custom tool call cut so is "incomplete"; a function call is "incomplete" when its arguments
    are no JSON object (cut inside them, or malformed), whatever ended it; else "completed".
    Reasoning items have none."""
    kind = item["type"]
    if kind == "reasoning":
        item.pop("status", None)
    elif (kind in ("message", "custom_tool_call") and cut) or (
            kind == "function_call" and not _is_json_object(item["arguments"])):
        item["status"] = "incomplete"
    else:
        item["status"] = "completed"


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
        "top_logprobs": body.top_logprobs or 0,
        "tools": body.tools or [], "tool_choice": body.tool_choice or "auto",
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "text": body.text or {"format": {"type": "text"}}, "reasoning": body.reasoning,
        "metadata": body.metadata or {}, "store": body.store, "background": body.background,
        "truncation": body.truncation or "disabled", "usage": None,
    }


def _finish(resp: dict[str, Any], items: _ItemWriter, gens: list[Generation]) -> None:
    r = items.result
    resp["output"] = items.items
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
                           logprobs=body.want_logprobs, top_logprobs=body.top_logprobs or 0,
                           max_tokens_param="max_output_tokens")


@dataclass(slots=True)
class _Prepared:
    rid: str
    body: ResponsesRequest
    plan: TurnPlan
    parallel: bool
    messages: list[dict[str, Any]]
    gens: list[Generation]
    tools: ToolSet
    model: ServedModel  # what the request's `model` selected


async def _prepare(request: Request) -> _Prepared:
    st = app_state(request)
    raw = await request.body()
    if not raw.strip():
        raise bad_request("The request body is empty; send a JSON object.")
    try:
        body = ResponsesRequest.model_validate_json(raw)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
    model = await st.models.select(body.model)
    history: list[dict[str, Any]] = []
    if body.previous_response_id:
        prev = store_of(request).get(body.previous_response_id)
        if prev is None:
            raise APIError(404, f"Previous response with id '{body.previous_response_id}' not found.",
                           param="previous_response_id", code="previous_response_not_found")
        if prev.response["status"] == "in_progress":
            raise bad_request("The previous response is still in progress.", "previous_response_id")
        history = prev.messages  # less its instructions: they do not carry over (other system messages do)
        if prev.response.get("instructions"):
            history = history[1:]
    messages = [*history, *input_messages(body)]
    if body.instructions:
        messages = [{"role": "system", "content": body.instructions}, *messages]
    tools = tool_set(body)
    functions = tools.functions
    choice = parse_tool_choice(_tool_choice(body.tool_choice), functions)
    parallel = body.parallel_tool_calls is not False
    fmt = (body.text or {}).get("format")
    effort = (body.reasoning or {}).get("effort")
    constraint = response_format_constraint(fmt, "text.format")
    template_kwargs = effort_template_kwargs(effort, None, "reasoning.effort")

    def plan_of(msgs: list[dict[str, Any]]) -> TurnPlan:
        return plan_turn(model, msgs, functions, choice, parallel=parallel, constraint=constraint,
                         param="input", template_kwargs=template_kwargs)

    if body.truncation == "auto":
        plan = await off_loop(request, _fitted, model, messages, plan_of, body.max_output_tokens or 1)
    else:
        plan = await off_loop(request, plan_of, messages)
    params = build_params(sampling_request(body, plan), st.config, model, plan.prompt_ids, "input")
    rid = _new("resp")
    spec = ChoiceSpec(index=0, req_id=rid, prompt_ids=plan.prompt_ids, params=params,
                      skip_special_tokens=plan.skip_special_tokens)
    gens = await start_all(st.client, [spec], model)
    return _Prepared(rid, body, plan, parallel, messages, gens, tools, model)


def _fitted(model: ServedModel, messages: list[dict[str, Any]],
            plan_of: Callable[[list[dict[str, Any]]], TurnPlan], room: int) -> TurnPlan:
    """`truncation: auto`: the plan of the conversation less its oldest turns (a user message
    and all that answers it), then, within the last turn, less its oldest assistant messages
    (each with the tool results that answer its calls: an agent's long tool loop), as few
    dropped as make the prompt leave `room` tokens of the context; the leading system messages
    and the last user message always stay. Where nothing dropped is enough, the plan of the
    whole (a context-length 400, as without)."""

    def attempt(msgs: list[dict[str, Any]]) -> tuple[TurnPlan | None, APIError | None]:
        try:
            return plan_of(msgs), None
        except APIError as exc:
            if exc.code != "context_length_exceeded":
                raise
            return None, exc

    def fits(plan: TurnPlan | None) -> bool:
        return plan is not None and len(plan.prompt_ids) + room <= model.context_length

    whole, error = attempt(messages)
    if fits(whole):
        return cast(TurnPlan, whole)
    lead = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    users = [i for i in range(lead, len(messages)) if messages[i]["role"] == "user"]
    last = users[-1] if users else lead
    # (start, pinned): messages[start:] after the system messages, and the last user message
    # before them where it was cut off; from dropping the least to the most: whole turns, then
    # the last turn's oldest replies
    cuts = [(u, False) for u in users[1:]] + [
        (a, True) for a in range(last + 2, len(messages)) if users and messages[a]["role"] == "assistant"]
    best, lo, hi = None, 0, len(cuts) - 1
    while lo <= hi:  # the fewest dropped (a shorter tail fits wherever a longer one does)
        mid = (lo + hi) // 2
        start, pinned = cuts[mid]
        plan, _ = attempt(messages[:lead] + ([messages[last]] if pinned else []) + messages[start:])
        if fits(plan):
            best, hi = plan, mid - 1
        else:
            lo = mid + 1
    if best is not None:
        return best
    if whole is None:  # the whole conversation's context-length 400
        raise cast(APIError, error)
    return whole


@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    p = await _prepare(request)
    model = p.model
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
        items = await run_until_disconnect(request, lambda: _collect(p))
    except GenerationError as exc:
        resp["status"] = "failed"
        resp["error"] = {"code": "server_error", "message": str(exc)}
        return JSONResponse(error_body(str(exc), "server_error", None, "generation_failed"), 500)
    finally:
        p.gens[0].abort()
    if items is None:
        store.pop(p.rid)
        return Response(status_code=499)
    _finish(resp, items, p.gens)
    stored.messages = _history(p.messages, items.result)
    return JSONResponse(resp)


async def _collect(p: _Prepared) -> _ItemWriter:
    """The whole answer: the same item writer a stream uses, its events not sent, so a whole
    response and a streamed one have the same output items."""
    items = _ItemWriter(_Events(send=False), p.tools, _logprobs_of(p))
    async for step in turn_steps(p.gens, p.plan, p.parallel):
        items.feed(step)
    items.end()
    return items


async def _run_background(p: _Prepared, stored: Stored) -> None:
    resp = stored.response
    try:
        items = await _collect(p)
        if resp["status"] != "cancelled":
            _finish(resp, items, p.gens)
        stored.messages = _history(p.messages, items.result)
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
    """Numbered stream events; with send=False only counted (a whole answer's writer)."""

    def __init__(self, send: bool = True) -> None:
        self.seq = 0
        self.send = send

    def __call__(self, kind: str, **data: Any) -> bytes:
        if not self.send:
            return b""
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


async def _stream_events(p: _Prepared, resp: dict[str, Any], stored: Stored) -> AsyncGenerator[bytes, None]:
    ev = _Events()
    yield ev("response.created", response=dict(resp))
    yield ev("response.in_progress", response=dict(resp))
    items = _ItemWriter(ev, p.tools, _logprobs_of(p))
    try:
        async for step in turn_steps(p.gens, p.plan, p.parallel):
            for b in items.feed(step):
                yield b
    except GenerationError as exc:
        resp["status"] = "failed"
        resp["error"] = {"code": "server_error", "message": str(exc)}
        yield ev("response.failed", response=resp)
        return
    for b in items.end():
        yield b
    _finish(resp, items, p.gens)
    stored.messages = _history(p.messages, items.result)
    kind = "response.completed" if resp["status"] == "completed" else "response.incomplete"
    yield ev(kind, response=resp)


def _logprobs_of(p: _Prepared) -> Callable[[list[TokenLogprob]], list[dict[str, Any]]] | None:
    """Token entries → the output text's logprob objects (chat's shape: token, logprob, bytes,
    top_logprobs), or None when the request did not include them."""
    if not p.body.want_logprobs:
        return None
    model, k = p.model, p.body.top_logprobs or 0
    return lambda entries: cast(list[dict[str, Any]], chat_logprobs(model, entries, k)["content"])


class _ItemWriter:
    """Turn events → output item events; one item open at a time. A message's
    output_item.added carries no content yet (its part follows in content_part.added), as
    OpenAI's does. Whitespace-only text between tool calls is held and dropped if no real text
    follows; a message's trailing whitespace is held until more text comes, dropped when another
    item follows. With `logprobs`, a step's token entries go with the message text it emitted
    (its delta event's `logprobs` and the part's); entries of tokens that opened a reasoning or
    function-call item are not the output text's and are dropped."""

    def __init__(self, ev: _Events, tools: ToolSet,
                 logprobs: Callable[[list[TokenLogprob]], list[dict[str, Any]]] | None = None):
        self.ev = ev
        self.tools = tools
        self.logprobs = logprobs
        self.pending_lps: list[TokenLogprob] = []  # entries whose text has not gone out yet
        self.out_index = -1
        self.open_item: dict[str, Any] | None = None
        self.result = TurnResult()
        self.pending_ws = ""
        self.tail_ws = ""  # trailing whitespace of the open message, not sent yet
        self.items: list[dict[str, Any]] = []  # the closed items: the response's output

    def feed(self, step: Step) -> list[bytes]:
        if self.logprobs is not None:
            self.pending_lps.extend(step.logprobs)
        out = [b for e in step.events for b in self.write(e)]
        if step.finish_reason:
            self.result.finish_reason = step.finish_reason
        return out

    def end(self) -> list[bytes]:
        """The end of the answer: an open message keeps its trailing whitespace."""
        out = []
        if self.open_item is not None and self.open_item["type"] == "message" and self.tail_ws:
            out.append(self._text_delta(self.tail_ws))
        return out + self.close(cut=self.result.finish_reason == "length")

    def close(self, cut: bool = False) -> list[bytes]:
        """Close the open item; `cut`: the output limit ended the response with it open."""
        item, self.open_item = self.open_item, None
        self.tail_ws = ""
        if item is None:
            return []
        ev, where = self.ev, {"item_id": item["id"], "output_index": self.out_index}
        out = []
        if item["type"] == "message":
            part = item["content"][0]
            out.append(ev("response.output_text.done", **where, content_index=0, text=part["text"]))
            out.append(ev("response.content_part.done", **where, content_index=0, part=part))
        elif item["type"] == "reasoning":
            out.append(ev("response.reasoning_text.done", **where, content_index=0,
                          text=item["content"][0]["text"]))
        elif item["type"] == "function_call":
            out.append(ev("response.function_call_arguments.done", **where, arguments=item["arguments"]))
        elif item["type"] == "custom_tool_call":  # its input is known once its arguments are whole
            item["input"] = _custom_input(self.result.calls[-1].arguments)
            if item["input"]:
                out.append(ev("response.custom_tool_call_input.delta", **where, delta=item["input"]))
            out.append(ev("response.custom_tool_call_input.done", **where, input=item["input"]))
        _set_status(item, cut)
        self.items.append(item)
        out.append(ev("response.output_item.done", output_index=self.out_index, item=item))
        return out

    def _open(self, item: dict[str, Any]) -> list[bytes]:
        out = self.close()
        self.out_index += 1
        self.open_item = item
        shown = {**item, "content": []} if item["type"] == "message" else item
        out.append(self.ev("response.output_item.added", output_index=self.out_index, item=shown))
        if item["type"] == "message":
            part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": []}
            if self.logprobs is not None:
                part["logprobs"] = item["content"][0]["logprobs"] = []
            out.append(self.ev("response.content_part.added", item_id=item["id"], output_index=self.out_index,
                               content_index=0, part=part))
        else:
            self.pending_lps = []  # the item's own tokens: not output text
        return out

    def write(self, e: Any) -> list[bytes]:
        if isinstance(e, ReasoningEvent):
            out = self._reasoning(e.text)
        elif isinstance(e, TextEvent):
            out = self._text(e.text)
        elif isinstance(e, CallStart):
            self.pending_ws = ""
            self.result.calls.append(ToolCall(e.id, e.name, ""))
            key = e.id.removeprefix("call_")
            if e.name in self.tools.custom:
                out = self._open({"type": "custom_tool_call", "id": "ctc_" + key, "call_id": e.id, "name": e.name,
                                  "input": "", "status": "in_progress"})
            else:
                out = self._open({"type": "function_call", "id": "fc_" + key, "call_id": e.id,
                                  **self.tools.call_name(e.name), "arguments": "", "status": "in_progress"})
        elif isinstance(e, CallArgs):
            out = self._args(e)
        elif isinstance(e, CallEnd):
            out = self.close()
        else:
            out = []
        return out

    def _reasoning(self, text: str) -> list[bytes]:
        self.result.reasoning = (self.result.reasoning or "") + text
        out: list[bytes] = []
        if self.open_item is None or self.open_item["type"] != "reasoning":
            out += self._open({"type": "reasoning", "id": _new("rs"), "summary": [],
                               "content": [{"type": "reasoning_text", "text": ""}]})
        assert self.open_item is not None
        self.open_item["content"][0]["text"] += text
        out.append(self.ev("response.reasoning_text.delta", item_id=self.open_item["id"],
                           output_index=self.out_index, content_index=0, delta=text))
        return out

    def _text(self, text: str) -> list[bytes]:
        self.result.text += text
        out: list[bytes] = []
        if self.open_item is None or self.open_item["type"] != "message":
            if not (self.pending_ws + text).strip():
                self.pending_ws += text
                return out
            text = (self.pending_ws + text).lstrip() if self.out_index >= 0 else self.pending_ws + text
            self.pending_ws = ""
            out += self._open({"type": "message", "id": _new("msg"),
                               "status": "in_progress", "role": "assistant",
                               "content": [{"type": "output_text", "text": "", "annotations": []}]})
        text = self.tail_ws + text
        body = text.rstrip()
        self.tail_ws = text[len(body):]
        if body:
            out.append(self._text_delta(body))
        return out

    def _text_delta(self, text: str) -> bytes:
        item = self.open_item
        assert item is not None
        part = item["content"][0]
        part["text"] += text
        extra: dict[str, Any] = {}
        if self.logprobs is not None:
            extra["logprobs"] = self.logprobs(self.pending_lps)
            self.pending_lps = []
            part["logprobs"].extend(extra["logprobs"])
        return self.ev("response.output_text.delta", item_id=item["id"], output_index=self.out_index,
                       content_index=0, delta=text, **extra)

    def _args(self, e: CallArgs) -> list[bytes]:
        self.result.calls[e.index].arguments += e.fragment
        item = self.open_item
        if item is None or item["type"] != "function_call":
            return []
        item["arguments"] += e.fragment
        return [self.ev("response.function_call_arguments.delta", item_id=item["id"], output_index=self.out_index,
                        delta=e.fragment)]
