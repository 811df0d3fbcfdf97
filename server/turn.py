"""One assistant turn for agent-facing endpoints (chat completions with tools, Anthropic
Messages, Responses): prompt with tools → engine → reasoning, text and tool-call events.

    plan = plan_turn(model, messages, functions, choice, parallel=True, constraint=None)
    gens = await start_all(client, [ChoiceSpec(... plan.prompt_ids, params_with(plan) ...)], model)
    async for step in turn_steps(gens, plan):   # Step(index, events, logprobs, finish_reason)
        ...

Messages are OpenAI chat dicts (role, content as a string, tool_calls, tool_call_id); every
endpoint converts its own shapes into them. System messages after the conversation started (agent
clients send them) reach the template where they stand; a template that refuses them, or drops
their text, gets them folded into the next user message (`fold_system_messages`). Templates that handle `tools` get them as-is (tool
call arguments as objects, the Hugging Face convention); others get the tools in the system
prompt and the tool history as Hermes text (server.tools). Each choice's text goes through the
reasoning splitter, then the tool-call parser, both incremental, so streamed and whole responses
are the same events; gpt-oss's harmony output goes through its channel parser (server.harmony)
instead, which gives the same events.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from server.errors import APIError, bad_request
from server.generation import Delta, Generation, TokenLogprob, stream_all
from server.harmony import HARMONY_ANALYSIS, HARMONY_NEXT, HarmonyParser, is_harmony
from server.prompts import ServedModel, encode, render_chat
from server.reasoning import (
    THINK_CLOSE,
    THINK_OPEN,
    ReasoningEvent,
    ReasoningSplitter,
    model_thinks,
    prompt_opens_thinking,
)
from server.tools import (
    HARMONY_FINAL,
    CallArgs,
    CallEnd,
    CallStart,
    Event,
    TextEvent,
    ToolCall,
    ToolCallParser,
    ToolFormat,
    format_for_template,
    history_for_fallback,
    template_call_id,
    template_handles_tools,
    template_tools,
    tools_system_prompt,
)

FINISH_TOOL_CALLS = "tool_calls"


@dataclass(slots=True)
class ToolChoice:
    mode: str = "auto"  # none | auto | required | function
    name: str | None = None  # with mode "function"


def parse_tool_choice(value: Any, functions: Sequence[dict[str, Any]], param: str = "tool_choice") -> ToolChoice:
    """OpenAI's tool_choice: "none" | "auto" | "required" | {"type": "function", "function":
    {"name"}} (and the Responses API's {"type": "function", "name"})."""
    names = {f["name"] for f in functions}
    if value is None:
        return ToolChoice("auto" if functions else "none")
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise bad_request(f"'{param}' must be none, auto, required or a named function", param)
        if value == "required" and not functions:
            raise bad_request(f"'{param}' is 'required' but no tools were given", param)
        return ToolChoice(value)
    if isinstance(value, dict) and value.get("type") == "function":
        inner = value.get("function")
        fn: dict[str, Any] = inner if isinstance(inner, dict) else value
        name = fn.get("name")
        if not isinstance(name, str) or name not in names:
            raise bad_request(f"'{param}' names a function that is not in 'tools': {name!r}", param)
        return ToolChoice("function", name)
    raise bad_request(f"'{param}' must be none, auto, required or a named function", param)


@dataclass(slots=True)
class TurnPlan:
    prompt_ids: list[int]
    prompt_text: str
    fmt: ToolFormat | None  # None: tool calls are not parsed
    tool_names: list[str]
    constraint: dict[str, Any] | None
    thinks: bool  # split <think> reasoning out
    starts_in_reasoning: bool
    skip_special_tokens: bool = True
    tool_schemas: dict[str, Any] = field(default_factory=dict)  # name -> parameters
    harmony: bool = False  # gpt-oss's channels (server.harmony) instead of the splitter and parser


def _for_native_template(messages: list[dict[str, Any]], fmt: ToolFormat) -> list[dict[str, Any]]:
    """Templates that handle tools expect call arguments as objects, not JSON text; a family
    whose templates accept only certain call ids (Mistral's) gets ids it accepts, the same in a
    call and in the tool result answering it (`template_call_id`); gpt-oss's template reads an
    assistant message's reasoning as `thinking` (clients send it back as `reasoning_content`)."""
    length = fmt.call_id_length
    out = []
    for m in messages:
        if fmt.name == "harmony" and m.get("reasoning_content") and not m.get("thinking"):
            m = dict(m, thinking=m["reasoning_content"])
        calls = m.get("tool_calls")
        if calls:
            m = dict(m)
            fixed = []
            for c in calls:
                c = dict(c)
                fn = dict(c.get("function") or {})
                args = fn.get("arguments")
                if isinstance(args, str):
                    with contextlib.suppress(json.JSONDecodeError):
                        fn["arguments"] = json.loads(args)
                c["function"] = fn
                if length:
                    c["id"] = template_call_id(c.get("id"), length)
                fixed.append(c)
            m["tool_calls"] = fixed
        if length and m.get("role") == "tool" and m.get("tool_call_id") is not None:
            m = dict(m, tool_call_id=template_call_id(m["tool_call_id"], length))
        out.append(m)
    return out


def _with_system(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0])
        first["content"] = f"{first.get('content') or ''}\n\n{text}".lstrip()
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _mid_system(messages: list[dict[str, Any]]) -> set[int]:
    """Indices of the system messages after the conversation started (not the leading run)."""
    out: set[int] = set()
    started = False
    for i, m in enumerate(messages):
        if m.get("role") != "system":
            started = True
        elif started:
            out.add(i)
    return out


def _joined(*texts: Any) -> str:
    return "\n\n".join(t for t in texts if isinstance(t, str) and t)


def fold_system_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same conversation for a template that takes one system prompt, at the start.

    The leading run of system messages becomes one; a later system message is put in front of
    the next user message, so it still comes before what follows it. One with no user message
    after it goes after the last message when that is a user message, else becomes a user
    message of its own."""
    mid = _mid_system(messages)
    out: list[dict[str, Any]] = []
    pending: list[str] = []
    for i, m in enumerate(messages):
        if i in mid:
            pending.append((m.get("content") or "").strip())
        elif m.get("role") == "system" and out:  # the leading run
            out[0] = {**out[0], "content": _joined(out[0].get("content"), m.get("content"))}
        elif m.get("role") == "user" and pending:
            out.append({**m, "content": _joined(*pending, m.get("content"))})
            pending = []
        else:
            out.append(dict(m))
    if pending and out and out[-1].get("role") == "user":
        out[-1] = {**out[-1], "content": _joined(out[-1].get("content"), *pending)}
    elif pending:
        out.append({"role": "user", "content": _joined(*pending)})
    return out


def _render(model: ServedModel, msgs: list[dict[str, Any]], **kwargs: Any) -> str:
    """The chat template's prompt. Mid-conversation system messages (Claude Code and Codex send
    them) go to the template where they stand; a template that refuses them, or renders without
    their text, gets them folded by `fold_system_messages` instead."""
    mid = [(msgs[i].get("content") or "").strip() for i in sorted(_mid_system(msgs))]
    try:
        text = render_chat(model, msgs, **kwargs)
    except APIError as exc:
        if not mid:
            raise
        try:
            return render_chat(model, fold_system_messages(msgs), **kwargs)
        except APIError:
            raise exc from None
    if all(t in text for t in mid):
        return text
    return render_chat(model, fold_system_messages(msgs), **kwargs)


def plan_turn(
    model: ServedModel,
    messages: list[dict[str, Any]],
    functions: Sequence[dict[str, Any]],
    choice: ToolChoice,
    *,
    parallel: bool = True,
    constraint: dict[str, Any] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    param: str = "messages",
) -> TurnPlan:
    template = model.info.chat_template or getattr(model.tokenizer, "chat_template", None)
    fmt = format_for_template(template)
    use_tools = bool(functions) and choice.mode != "none"
    native = template_handles_tools(template)
    if native:
        msgs = _for_native_template(messages, fmt)
    else:
        msgs = history_for_fallback(messages, fmt)
        if use_tools:
            msgs = _with_system(msgs, tools_system_prompt(functions, fmt))
    text = _render(
        model,
        msgs,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        template_kwargs=template_kwargs,
        tools=template_tools(functions) if use_tools and native else None,
    )
    ids = encode(model, text, add_special_tokens=False, param=param)  # checked in server.params
    if use_tools and choice.mode in ("required", "function"):
        forced = [f for f in functions if choice.mode == "required" or f["name"] == choice.name]
        constraint = fmt.constraint(forced, parallel=parallel and choice.mode == "required" and not fmt.one_call)
    elif (use_tools and choice.mode == "auto" and constraint is None and (fmt.lazy_trigger or fmt.text_answer)
          and any(f.get("strict") for f in functions)):
        # strict tools: text stays free, calls follow the schemas (a grammar compile per
        # request, and the batch waits for each step while a call is written: only where asked)
        constraint = fmt.constraint(functions, parallel=parallel and not fmt.one_call, lazy=True)
    special = set(getattr(model.tokenizer, "all_special_tokens", []) or [])
    harmony = is_harmony(template)
    thinks = model_thinks(template, model.tokenizer)
    opened = thinks and prompt_opens_thinking(text)
    return TurnPlan(
        prompt_ids=ids,
        prompt_text=text,
        fmt=fmt if use_tools else None,
        tool_names=[f["name"] for f in functions],
        tool_schemas={f["name"]: f.get("parameters") for f in functions},
        constraint=_reasoning_first(constraint, harmony=harmony, thinks=thinks, opened=opened),
        thinks=thinks,
        starts_in_reasoning=opened,
        # harmony's channels and tool-call markers are special tokens: its parser needs them
        skip_special_tokens=not (harmony or (use_tools and any(m in special for m in fmt.start_markers))),
        harmony=harmony,
    )


def _reasoning_first(constraint: dict[str, Any] | None, *, harmony: bool, thinks: bool,
                     opened: bool) -> dict[str, Any] | None:
    """A reasoning model's constrained answer (JSON, a regex, a forced call) comes after its reasoning,
    which stays free (engine.constrain's `reasoning`): held from the first token, the answer
    would land in the reasoning where the prompt opened it, and the model could not think."""
    if (constraint is None or constraint.get("lazy")
            or constraint.get("type") not in ("json_schema", "json_object", "regex", "tool_calls")):
        return constraint
    if harmony:
        answer = "" if constraint["type"] == "tool_calls" else HARMONY_FINAL  # a call has its header
        return {**constraint, "reasoning": {"open": HARMONY_ANALYSIS, "close": HARMONY_NEXT,
                                            "prefix": answer}}
    if thinks:
        return {**constraint, "reasoning": {"open": THINK_OPEN, "close": THINK_CLOSE, "opened": opened}}
    return constraint


# -- output -----------------------------------------------------------------------------------


TurnEvent = ReasoningEvent | Event


class TurnOutput:
    """One choice's text → reasoning / content / tool-call events (incremental)."""

    def __init__(self, plan: TurnPlan, parallel: bool = True):
        tools_on = plan.fmt is not None
        self.harmony = HarmonyParser(plan.tool_names if tools_on else None) if plan.harmony else None
        self.splitter = (ReasoningSplitter(in_reasoning=plan.starts_in_reasoning)
                         if plan.thinks and not plan.harmony else None)
        self.parser = (ToolCallParser(plan.fmt, plan.tool_names, plan.tool_schemas)
                       if plan.fmt is not None and not plan.harmony else None)
        self.parallel = parallel
        self.reasoning: list[str] = []
        self.content: list[str] = []

    @property
    def calls(self) -> list[ToolCall]:
        source = self.harmony or self.parser
        calls = source.calls if source is not None else []
        return calls if self.parallel else calls[:1]

    def feed(self, text: str) -> list[TurnEvent]:
        if self.harmony is not None:
            return self._keep(self.harmony.feed(text))
        return self._route(self.splitter.feed(text) if self.splitter else [("content", text)], final=False)

    def finish(self) -> list[TurnEvent]:
        if self.harmony is not None:
            return self._keep(self.harmony.finish())
        parts = self.splitter.finish() if self.splitter else []
        return self._route(parts, final=True)

    def _route(self, parts: list[tuple[str, str]], final: bool) -> list[TurnEvent]:
        out: list[TurnEvent] = []
        for kind, text in parts:
            if kind == "reasoning":
                out.extend(self._keep([ReasoningEvent(text)]))
            elif self.parser is None:
                out.extend(self._keep([TextEvent(text)]))
            else:
                out.extend(self._keep(self.parser.feed(text)))
        if final and self.parser is not None:
            out.extend(self._keep(self.parser.finish()))
        return out

    def _keep(self, events: Sequence[TurnEvent]) -> list[TurnEvent]:
        kept: list[TurnEvent] = []
        for e in events:
            if isinstance(e, ReasoningEvent):
                self.reasoning.append(e.text)
            elif isinstance(e, TextEvent):
                self.content.append(e.text)
            elif not self.parallel and isinstance(e, (CallStart, CallArgs, CallEnd)) and e.index > 0:
                continue  # parallel_tool_calls=false: the first call only
            kept.append(e)
        return kept

    @property
    def text(self) -> str:
        return "".join(self.content)

    @property
    def reasoning_text(self) -> str | None:
        return "".join(self.reasoning) if self.reasoning else None


@dataclass(slots=True)
class Step:
    index: int
    events: list[TurnEvent] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


async def turn_steps(
    gens: Sequence[Generation], plan: TurnPlan, parallel: bool = True
) -> AsyncGenerator[Step, None]:
    """The engine's deltas for every choice, as turn events; the finish reason becomes
    "tool_calls" when the choice called a tool and stopped."""
    outputs = {g.spec.index: TurnOutput(plan, parallel) for g in gens}
    source = cast("AsyncGenerator[Delta, None]", stream_all(gens))  # an async generator function
    async with contextlib.aclosing(source) as deltas:
        async for d in deltas:
            out = outputs[d.index]
            step = Step(d.index, out.feed(d.text) if d.text else [], list(d.logprobs))
            if d.finish_reason:
                step.events.extend(out.finish())
                reason = d.finish_reason
                if out.calls and reason == "stop":
                    reason = FINISH_TOOL_CALLS
                step.finish_reason = reason
            if step.events or step.logprobs or step.finish_reason:
                yield step


async def collect_turn(
    gens: Sequence[Generation], plan: TurnPlan, parallel: bool = True
) -> dict[int, TurnResult]:
    """Run every choice to the end (the same events a stream gives, gathered)."""
    results: dict[int, TurnResult] = {g.spec.index: TurnResult() for g in gens}
    async for step in turn_steps(gens, plan, parallel):
        r = results[step.index]
        r.logprobs.extend(step.logprobs)
        for e in step.events:
            if isinstance(e, ReasoningEvent):
                r.reasoning = (r.reasoning or "") + e.text
            elif isinstance(e, TextEvent):
                r.text += e.text
            elif isinstance(e, CallStart):
                r.calls.append(ToolCall(e.id, e.name, ""))
            elif isinstance(e, CallArgs):
                r.calls[e.index].arguments += e.fragment
        if step.finish_reason:
            r.finish_reason = step.finish_reason
    return results


@dataclass(slots=True)
class TurnResult:
    text: str = ""
    reasoning: str | None = None
    calls: list[ToolCall] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
