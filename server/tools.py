"""Tool calls: formats by chat-template family, prompt fallback, parsing (whole and streamed).

A `ToolFormat` says how a model family writes calls; the registry (`FORMATS`) holds:

    hermes       <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>   (Hermes, Qwen 2/2.5/3)
    llama3_json  {"name": "f", "parameters": {...}}  at the very start, ";" between calls,
                 optionally after <|python_tag|>                               (Llama 3.1/3.2/3.3)
    mistral      [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]           (Mistral, Mixtral)
    mistral_v11  [TOOL_CALLS]f[ARGS]{...}[TOOL_CALLS]g[CALL_ID]abc123XYZ[ARGS]{...}
                                                       (Mistral Small 3.1+, Devstral, Magistral)
    qwen3_coder  <tool_call>\\n<function=f>\\n<parameter=city>\\nParis\\n</parameter>\\n</function>\\n</tool_call>
                 (Qwen3-Coder: each argument in its own tag, strings bare, other values as JSON,
                 typed by the tool's schema)
    glm          <tool_call>f\\n<arg_key>city</arg_key>\\n<arg_value>Paris</arg_value>\\n</tool_call>
                 (GLM-4.5/4.6; glm_compact: the same without newlines, GLM-4.7+)

and apart from them `HARMONY` (gpt-oss: `<|channel|>commentary to=functions.f <|constrain|>json
<|message|>{...}<|call|>` among channels for reasoning and answer), whose output server.harmony
parses; its format here is what a forced call writes.

`format_for_template(template)` picks one by what the chat template itself writes; a template
that does not handle `tools` at all (the bundled tinycoder's plain ChatML) gets Hermes, and the
tools are rendered into the system prompt by `tools_system_prompt` (the documented fallback).

`ToolCallParser` is one incremental parser used for both the streamed and the whole response, so
the two always agree: `feed(text)` returns events —

    TextEvent(text)                      ordinary content
    CallStart(index, id, name)           a call began (name known)
    CallArgs(index, fragment)            more of its arguments (raw JSON text as the model wrote it)
    CallEnd(index)

and `finish()` flushes what is held. Text that might be the start of a call marker is held back
(like a partial stop string) until it is decided. The arguments are streamed as they arrive once
the name is known and the arguments value has begun; the concatenated fragments equal the
non-streamed `arguments` string exactly.

A call that repeats an earlier call of the same output exactly (same name, same arguments text)
is dropped: that is a model looping on its call, not a second call (a constrained output also
ends there, see engine.constrain). While a call with an earlier call's name is still a prefix of
that call, its events are held back, so the repeat is never streamed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import secrets
import string
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from server.stops import partial_suffix

# -- formats --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class XmlTags:
    """An argument-per-tag call as the family writes it: function_open, the name, name_close,
    then per argument key_open, the key, key_close, the value (strings bare, other values as
    JSON; with value_newlines between a newline each side) and value_close, then
    function_close. The parser allows any whitespace between tags; a grammar writes these."""

    function_open: str  # "": the name right after the call marker
    name_close: str
    key_open: str
    key_close: str
    value_close: str
    function_close: str
    value_newlines: bool = False


@dataclass(frozen=True, slots=True)
class ToolFormat:
    name: str
    start_markers: tuple[str, ...]  # text that opens a tool-call section
    end_marker: str = ""  # text that closes one call's section ("" = none)
    args_keys: tuple[str, ...] = ("arguments",)  # accepted keys for the arguments, first = written
    # a bare "{" (or one in a ``` fence) at the start of the output opens calls too
    at_start_only: bool = False
    # for the constraint that forces a call (engine.constrain tool_calls spec)
    list_open: str = ""
    call_open: str = ""
    call_close: str = ""
    separator: str = ""
    list_close: str = ""
    # Mistral v11+: a call is call_open, the name, args_marker and the arguments object (no JSON
    # wrapper); the model may write id_marker and an id of its own between name and arguments
    args_marker: str = ""
    id_marker: str = ""
    # the family's templates accept only call ids of this many letters and digits (0: any)
    call_id_length: int = 0
    # an argument per tag (Qwen3-Coder, GLM): how a call's name and arguments are written
    xml: XmlTags | None = None
    # a call ends the output (harmony's <|call|>): one call a turn
    one_call: bool = False
    compact_json: bool = False  # forced arguments without spaces, as the family writes them
    # no marker opens calls inside free text (harmony: a call and a text answer each open with
    # their own header): the answer is a call, or this prefix and text (the spec's `or_text`)
    text_answer: str = ""

    def new_call_id(self) -> str:
        if self.call_id_length:
            return "".join(secrets.choice(_ALNUM) for _ in range(self.call_id_length))
        return new_call_id()

    @property
    def lazy_trigger(self) -> str | None:
        """The marker that opens the first call, when the format has one (Hermes' `<tool_call>`,
        Mistral's `[TOOL_CALLS]`): what a lazy constraint waits for. None for bare JSON."""
        first = self.list_open + self.call_open
        return next((m for m in self.start_markers if first.startswith(m)), None)

    def constraint(
        self, tools: Sequence[dict[str, Any]], parallel: bool, max_calls: int = 4, lazy: bool = False
    ) -> dict[str, Any]:
        """The engine's plain-data spec forcing one (or, if parallel, up to max_calls) valid calls;
        `lazy`: free text unless the output opens calls (`lazy_trigger`), which are then valid;
        for a format with `text_answer`, calls or that prefix and free text."""
        spec = {
            "type": "tool_calls",
            "tools": [{"name": t["name"], "parameters": t.get("parameters")} for t in tools],
            "format": {
                "list_open": self.list_open,
                "call_open": self.call_open,
                "call_close": self.call_close,
                "separator": self.separator,
                "list_close": self.list_close,
                "name_key": "name",
                "args_key": self.args_keys[0],
                "args_marker": self.args_marker,
                "xml": None if self.xml is None else dataclasses.asdict(self.xml),
                "compact_json": self.compact_json,
            },
            "parallel": parallel,
            "max_calls": max_calls,
        }
        if lazy and self.text_answer:
            spec["or_text"] = self.text_answer
        elif lazy:
            spec.update(lazy=True, trigger=self.lazy_trigger)
        return spec


HERMES = ToolFormat(
    name="hermes",
    start_markers=("<tool_call>",),
    end_marker="</tool_call>",
    at_start_only=True,  # Qwen2.5(-Coder) often writes its call bare, or in a ```json fence
    call_open="<tool_call>\n",
    call_close="\n</tool_call>",
    separator="\n",
)
LLAMA3_JSON = ToolFormat(
    name="llama3_json",
    start_markers=("<|python_tag|>",),
    args_keys=("parameters", "arguments"),
    at_start_only=True,
    separator="; ",
)
MISTRAL = ToolFormat(
    name="mistral",
    start_markers=("[TOOL_CALLS]",),
    list_open="[TOOL_CALLS][",
    separator=", ",
    list_close="]",
    call_id_length=9,
)
MISTRAL_V11 = ToolFormat(
    name="mistral_v11",
    start_markers=("[TOOL_CALLS]",),
    call_open="[TOOL_CALLS]",
    args_marker="[ARGS]",
    id_marker="[CALL_ID]",
    call_id_length=9,
)
QWEN3_CODER = ToolFormat(
    name="qwen3_coder",
    start_markers=("<tool_call>",),
    end_marker="</tool_call>",
    call_open="<tool_call>\n",
    call_close="\n</tool_call>",
    separator="\n",
    xml=XmlTags("<function=", ">\n", "<parameter=", ">", "</parameter>\n", "</function>",
                value_newlines=True),
)
# GLM-4.5 / 4.6 (a newline after the name and after each tag); GLM-4.7+ writes them compact
GLM = ToolFormat(
    name="glm",
    start_markers=("<tool_call>",),
    call_open="<tool_call>",
    separator="\n",
    xml=XmlTags("", "\n", "<arg_key>", "</arg_key>\n<arg_value>", "</arg_value>\n", "</tool_call>"),
)
GLM_COMPACT = dataclasses.replace(
    GLM, name="glm_compact", separator="",
    xml=XmlTags("", "", "<arg_key>", "</arg_key><arg_value>", "</arg_value>", "</tool_call>"))
# gpt-oss: its output is parsed by server.harmony; this is how a forced call is written, and
# how its answer opens (server.harmony's tokens)
HARMONY_FINAL = "<|channel|>final<|message|>"
HARMONY = ToolFormat(
    name="harmony",
    start_markers=(),
    call_open="<|channel|>commentary to=functions.",
    args_marker=" <|constrain|>json<|message|>",
    one_call=True,
    compact_json=True,
    text_answer=HARMONY_FINAL,
)
FORMATS: dict[str, ToolFormat] = {
    f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL, MISTRAL_V11, QWEN3_CODER, GLM, GLM_COMPACT)}
_ALNUM = string.ascii_letters + string.digits
_ALNUM_SET = frozenset(_ALNUM)


def template_call_id(call_id: Any, length: int) -> str:
    """A call id as a template that takes only `length` letters and digits accepts it (Mistral's
    raise on anything else): such an id unchanged (the ids mlxd gives out), any other derived
    from it, so that a call and the tool result answering it keep matching."""
    text = str(call_id)
    if len(text) == length and _ALNUM_SET.issuperset(text):
        return text
    digest = hashlib.sha256(text.encode()).digest()
    return "".join(_ALNUM[b % len(_ALNUM)] for b in digest[:length])


def template_handles_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template  # type: ignore[operator]


def format_for_template(template: str | None) -> ToolFormat:
    """The call format a chat template's family uses (Hermes when it shows none)."""
    t = template or ""
    if "<|channel|>" in t:
        return HARMONY
    if "[TOOL_CALLS]" in t:
        return MISTRAL_V11 if "[ARGS]" in t else MISTRAL
    if "<function=" in t and "<parameter=" in t:
        return QWEN3_CODER
    if "<arg_key>" in t:
        return GLM_COMPACT if "</arg_key><arg_value>" in t else GLM
    if "<tool_call>" in t:
        return HERMES
    if "<|python_tag|>" in t or ("<|start_header_id|>" in t and "tools" in t):
        return LLAMA3_JSON
    return HERMES


# -- request side ---------------------------------------------------------------------------


NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


def function_specs(tools: Sequence[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """OpenAI `tools` ([{"type": "function", "function": {...}}]) → [{"name", "description",
    "parameters"}]. Raises ValueError with a reason for a malformed entry."""
    out = []
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict):
            raise ValueError(f"tools[{i}] must be an object")
        fn = tool.get("function") if tool.get("type", "function") == "function" else None
        if not isinstance(fn, dict):
            raise ValueError(
                f"tools[{i}]: only {{'type': 'function', 'function': {{...}}}} tools are supported"
            )
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"tools[{i}].function.name must be a non-empty string")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON Schema object")
        out.append(
            {
                "name": name,
                "description": fn.get("description") or "",
                # OpenAI: "omitting parameters defines a function with an empty parameter list"
                "parameters": params if params is not None else dict(NO_PARAMETERS),
                # calls to it must follow its schema, also where the model may answer in text
                "strict": fn.get("strict") is True,
            }
        )
    names = [t["name"] for t in out]
    if len(set(names)) != len(names):
        raise ValueError("tool names must be unique")
    return out


def template_tools(functions: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The function specs as OpenAI `tools` for a prompt (`strict` is ours, not the prompt's)."""
    return [{"type": "function", "function": {k: v for k, v in f.items() if k != "strict"}}
            for f in functions]


def tools_system_prompt(functions: Sequence[dict[str, Any]], fmt: ToolFormat = HERMES) -> str:
    """Tools described in the system prompt, for templates that ignore `tools` (Hermes style)."""
    sigs = "\n".join(json.dumps(t, ensure_ascii=False) for t in template_tools(functions))
    example = json.dumps({"name": "<function-name>", fmt.args_keys[0]: {"<arg>": "<value>"}})
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{sigs}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n"
        f"<tool_call>\n{example}\n</tool_call>"
    )


def history_for_fallback(
    messages: list[dict[str, Any]], fmt: ToolFormat = HERMES
) -> list[dict[str, Any]]:
    """Assistant tool calls and tool results as plain text, for templates without tool support."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if m.get("role") == "assistant" and calls:
            parts = [m.get("content") or ""]
            for c in calls:
                fn = c.get("function", {})
                args = fn.get("arguments", "{}")
                try:
                    args_obj = json.loads(args) if isinstance(args, str) else args
                except json.JSONDecodeError:
                    args_obj = args
                call = json.dumps(
                    {"name": fn.get("name"), fmt.args_keys[0]: args_obj}, ensure_ascii=False
                )
                parts.append(f"{fmt.call_open or ''}{call}{fmt.call_close or ''}")
            m["content"] = "\n".join(p for p in parts if p)
        elif m.get("role") == "tool":
            m["content"] = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            m.pop("tool_call_id", None)
        out.append(m)
    return out


# -- parsing --------------------------------------------------------------------------------


@dataclass(slots=True)
class TextEvent:
    text: str


@dataclass(slots=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(slots=True)
class CallArgs:
    index: int
    fragment: str


@dataclass(slots=True)
class CallEnd:
    index: int


Event = TextEvent | CallStart | CallArgs | CallEnd


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


class _JsonObjectScanner:
    """Follows one JSON object char by char: top-level keys, the name value, the span of the
    arguments value, and where the object ends."""

    def __init__(self, args_keys: tuple[str, ...]):
        self.args_keys = args_keys
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.text: list[str] = []
        self.key: str | None = None  # the top-level key whose value is being read
        self.expect = "key"  # at depth 1: "key" | "colon" | "value" | "comma"
        self.str_start = -1
        self.value_start = -1  # index in text of the current top-level value
        self.name: str | None = None
        self.args_start = -1
        self.args_end = -1
        self.done = False

    def push(self, ch: str) -> None:
        i = len(self.text)
        self.text.append(ch)
        if self.in_string:
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_string = False
                if self.depth == 1 and self.expect == "key":
                    self.key = json.loads("".join(self.text[self.str_start : i + 1]))
                    self.expect = "colon"
                elif self.depth == 1 and self.expect == "value":
                    self._value_end(i + 1)
            return
        if ch == '"':
            self.in_string = True
            if self.depth == 1 and self.expect in ("key", "value"):
                self.str_start = i
                if self.expect == "value":
                    self.value_start = i
            return
        if ch in "{[":
            self.depth += 1
            if self.depth == 2 and self.expect == "value":
                self.value_start = i
            return
        if ch in "}]":
            self.depth -= 1
            if self.depth == 1 and self.expect == "value":
                self._value_end(i + 1)
            elif self.depth == 0:
                if self.expect == "value" and self.value_start >= 0:  # a bare value before "}"
                    self._value_end(i)
                self.done = True
            return
        if self.depth != 1:
            return
        if ch == ":" and self.expect == "colon":
            self.expect = "value"
            self.value_start = -1
        elif ch == "," and self.expect in ("value", "comma"):
            if self.expect == "value" and self.value_start >= 0:
                self._value_end(i)
            self.expect = "key"
        elif not ch.isspace() and self.expect == "value" and self.value_start < 0:
            self.value_start = i  # a number, true, false or null

    def _value_end(self, end: int) -> None:
        raw = "".join(self.text[self.value_start : end]).strip()
        if self.key == "name" and self.name is None:
            try:
                value = json.loads(raw)
            except json.JSONDecodeError:
                value = None
            if isinstance(value, str):
                self.name = value
        elif self.key in self.args_keys and self.args_start < 0:
            self.args_start, self.args_end = self.value_start, end
        self.expect = "comma"
        self.value_start = -1

    @property
    def args_open(self) -> bool:
        """Inside the arguments value, which is an object (streamable as it comes)."""
        return (
            self.key in self.args_keys
            and self.expect == "value"
            and self.value_start >= 0
            and self.args_start < 0
            and self.text[self.value_start] == "{"
        )


class ToolCallParser:
    """Text deltas → content and tool-call events, for one choice (see the module docstring)."""

    def __init__(self, fmt: ToolFormat, tool_names: Sequence[str] | None = None,
                 schemas: dict[str, Any] | None = None):
        self.fmt = fmt
        self.tool_names = set(tool_names) if tool_names else None
        self._schemas = schemas or {}  # tool name -> parameters schema (types XML arguments)
        self._xml: _XmlCall | None = None
        self._xml_parts: list[str] = []  # the value read so far of an argument parsed when whole
        self._xml_string_open = False  # a string argument is being streamed
        self._xml_key = ""  # the argument being read
        self.calls: list[ToolCall] = []
        # text | calls | object | name (args_marker formats) | xml (formats with tags)
        self._state = "text"
        self._held = ""  # text that may be the start of a marker
        self._seen_text = False  # non-whitespace content was emitted (for at_start_only)
        self._obj: _JsonObjectScanner | None = None
        self._obj_raw = ""  # raw text since the section opened, returned as text on failure
        self._sent_args = 0  # characters of the current call's arguments already streamed
        self._started = False  # the current object is a call (its name is one of the tools)
        # the current call's events, held while it repeats an earlier call of this turn so far
        self._repeat: list[Event] | None = None
        self._name = ""  # args_marker formats: the name read so far
        self._in_id = False  # ... reading the model's own call id (after id_marker)
        self._fenced = False  # the calls began in a ``` fence (at_start_only), closed by one

    # public ----------------------------------------------------------------------------------
    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        buf = self._held + text
        self._held = ""
        self._run(buf, events)
        return _merge_text(events)

    def _run(self, buf: str, events: list[Event]) -> None:
        i = 0
        while i < len(buf):
            if self._state == "text":
                i = self._scan_text(buf, i, events)
            elif self._state == "calls":
                i = self._scan_calls(buf, i, events)
            elif self._state == "name":
                i = self._scan_name(buf, i, events)
            elif self._state == "xml":
                i = self._scan_xml(buf, i, events)
            else:
                i = self._scan_object(buf, i, events)

    def finish(self) -> list[Event]:
        """The generation ended: flush held text; an unfinished call is closed with what arrived
        if its name did; otherwise its markup becomes text, unless a call of this section came
        before it (then it is the cut-off start of another call, never content)."""
        events: list[Event] = []
        after_call = self._state != "text" and bool(self.calls)
        if self._state == "xml" and self._xml is not None:
            if self._started:
                self._xml_close(events, complete=False)
            elif not after_call:
                events.append(TextEvent(self._obj_raw + self._xml.buf))
        elif self._state == "name":
            if not after_call:
                events.append(TextEvent(self._obj_raw + self._held))
        elif self._state != "object" and self._held:
            if not after_call:
                events.append(TextEvent(self._held))
        elif self._state == "object" and self._obj is not None:
            if self._started:
                self._close_object(events, complete=False)
            elif not after_call:
                events.append(TextEvent(self._obj_raw))
        self._held = ""
        self._state = "text"
        return _merge_text(events)

    # states ----------------------------------------------------------------------------------
    def _scan_text(self, buf: str, i: int, events: list[Event]) -> int:
        rest = buf[i:]
        markers = self.fmt.start_markers
        best = -1
        marker = ""
        for m in markers:
            j = rest.find(m)
            if j >= 0 and (best < 0 or j < best):
                best, marker = j, m
        bare = self.fmt.at_start_only and not self._seen_text and not self.calls
        if bare:  # Llama 3, Qwen2.5: a "{" before any content opens the calls, bare or fenced
            k = len(rest) - len(rest.lstrip())
            lead = rest[k:]
            fence = next((f for f in _FENCES if lead.startswith(f)), "")
            after = lead[len(fence):].lstrip()
            if after.startswith("{") and (best < 0 or k < best):
                self._emit_text(rest[:k], events)
                self._open_section(fence)
                self._fenced = bool(fence)
                return i + k + len(fence)
            if (not after if fence else not lead or any(f.startswith(lead) for f in _FENCES)):
                self._held = rest  # whitespace or a fence so far: a "{" may follow
                return len(buf)
        if best >= 0:
            self._emit_text(rest[:best], events)
            self._open_section(marker)
            return i + best + len(marker)
        keep = partial_suffix(rest, markers)
        self._emit_text(rest[: len(rest) - keep], events)
        self._held = rest[len(rest) - keep :]
        return len(buf)

    def _open_section(self, marker: str) -> None:
        self._state = "calls"
        self._obj_raw = marker

    def _scan_calls(self, buf: str, i: int, events: list[Event]) -> int:
        """Between calls: skip whitespace, separators and closers until a call begins ("{" of a
        JSON call; the name right after the marker, or a function tag, in the formats without
        the JSON wrapper) or other text."""
        end = self.fmt.end_marker
        while i < len(buf):
            ch = buf[i]
            if self.fmt.args_marker and _NAME_CHARS.issuperset(ch) and self._obj_raw.endswith(
                    self.fmt.start_markers):
                self._state, self._name, self._in_id, self._started = "name", "", False, False
                return i
            tags = self.fmt.xml
            if tags is not None and (
                    buf.startswith(tags.function_open, i) if tags.function_open else
                    _NAME_CHARS.issuperset(ch) and self._obj_raw.endswith(self.fmt.start_markers)):
                self._state, self._xml, self._started = "xml", _XmlCall(tags), False
                return i
            if tags is not None and tags.function_open.startswith(buf[i:]):  # cut by the delta
                self._held = buf[i:]
                return len(buf)
            if ch == "{" and not self.fmt.args_marker and tags is None:
                self._obj = _JsonObjectScanner(self.fmt.args_keys)
                self._state = "object"
                self._sent_args = 0
                self._started = False
                return i
            if ch.isspace() or (ch in "[,;]" and not self.fmt.args_marker):
                self._obj_raw += ch
                i += 1
                continue
            for m in (end, *self.fmt.start_markers, *((_FENCE,) if self._fenced else ())):
                if m and buf.startswith(m, i):
                    self._obj_raw += m
                    i += len(m)
                    break
                if m and m.startswith(buf[i:]):  # a marker cut by the delta: wait for more
                    self._held = buf[i:]
                    return len(buf)
            else:
                self._state = "text"  # ordinary text after the calls
                self._seen_text = True
                return i
        return i

    def _scan_name(self, buf: str, i: int, events: list[Event]) -> int:
        """An args_marker format's call: the name (and the model's own id after id_marker) up to
        args_marker, where the call starts and its arguments object is read as an object."""
        fmt = self.fmt
        markers = [m for m in (fmt.args_marker, fmt.id_marker) if m]
        while i < len(buf):
            if buf.startswith(fmt.args_marker, i):
                self._obj_raw += fmt.args_marker
                self._start_call(self._name, events)
                self._obj = _JsonObjectScanner(())
                self._state = "object"
                return i + len(fmt.args_marker)
            if fmt.id_marker and buf.startswith(fmt.id_marker, i) and not self._in_id:
                self._obj_raw += fmt.id_marker
                self._in_id = True
                i += len(fmt.id_marker)
                continue
            if any(m.startswith(buf[i:]) for m in markers):  # a marker cut by the delta
                self._held = buf[i:]
                return len(buf)
            ch = buf[i]
            if not (ch.isalnum() if self._in_id else _NAME_CHARS.issuperset(ch)):
                events.append(TextEvent(self._obj_raw))  # not a call after all
                self._seen_text = True
                self._state = "text"
                return i
            self._obj_raw += ch
            if not self._in_id:
                self._name += ch
            i += 1
        return i

    def _scan_xml(self, buf: str, i: int, events: list[Event]) -> int:
        """A call of a format with tags (`XmlTags`): its name, its arguments, its closing tag.
        The arguments are streamed as JSON: a value the tool's schema declares a string as it
        arrives, any other once it is whole (it is parsed then)."""
        xml = self._xml
        assert xml is not None
        xml.buf += buf[i:]
        while True:
            step = xml.next()
            if step is None:  # more text needed
                return len(buf)
            kind, value = step
            if kind == "function":
                self._start_call(xml.name, events)
                self._xml_parts = []
            elif kind in ("open", "text", "close") and self._started:
                self._xml_argument(kind, value, events)
            elif kind in ("end", "bad"):
                self._xml = None
                if self._started:  # what follows is read again: it may hold earlier deltas' text
                    self._xml_close(events, complete=kind == "end")
                    self._state, self._obj_raw = "calls", ""
                    self._run(xml.buf, events)
                else:  # not a call of ours, or not a call at all: text
                    events.append(TextEvent(self._obj_raw + xml.taken + xml.buf))
                    self._seen_text = True
                    self._state = "text"
                return len(buf)

    def _xml_argument(self, kind: str, value: str, events: list[Event]) -> None:
        """One piece of a tagged argument into the call's arguments JSON."""
        xml = self._xml
        assert xml is not None
        call = self.calls[-1]
        if kind == "open":
            self._xml_key = value
        key = self._xml_key
        schema = ((self._schemas.get(xml.name) or {}).get("properties") or {}).get(key)
        streamed = isinstance(schema, dict) and schema.get("type") == "string"
        piece = ""
        if kind == "open":
            self._xml_parts = []
            if streamed:
                piece = ("{" if not call.arguments else ", ") + json.dumps(value) + ': "'
        elif streamed:
            piece = json.dumps(value, ensure_ascii=False)[1:-1] + ('"' if kind == "close" else "")
        else:
            self._xml_parts.append(value)
            if kind == "close":
                arg = _xml_value("".join(self._xml_parts), schema)
                piece = ("{" if not call.arguments else ", ") + json.dumps(key) + ": " + json.dumps(
                    arg, ensure_ascii=False)
        self._xml_string_open = streamed and kind != "close"
        if piece:
            call.arguments += piece
            self._call_event(CallArgs(len(self.calls) - 1, piece), events)

    def _xml_close(self, events: list[Event], complete: bool) -> None:
        call = self.calls[-1]
        string_open, self._xml_string_open = self._xml_string_open, False
        if self._repeat is not None and not complete:  # the cut-off start of a repeat, before
            self._end_call(events, complete)  # its closing "}" could release it
            return
        # cut off: the arguments that were whole, a string value as far as it came
        tail = ('"' if string_open else "") + ("}" if call.arguments else "{}")
        call.arguments += tail
        self._call_event(CallArgs(len(self.calls) - 1, tail), events)
        self._end_call(events, complete)

    def _scan_object(self, buf: str, i: int, events: list[Event]) -> int:
        obj = self._obj
        assert obj is not None
        start = i
        while i < len(buf) and not obj.done:
            obj.push(buf[i])
            i += 1
        self._obj_raw += buf[start:i]
        if not self._started and obj.name is not None:
            self._start_call(obj.name, events)
        if self._started and self.fmt.args_marker:  # the object is the arguments
            self._stream_args(obj, len(obj.text), events)
        elif self._started:
            if obj.args_open:
                self._stream_args(obj, len(obj.text), events)
            elif obj.args_start >= 0 and obj.text[obj.args_start] == "{":
                self._stream_args(obj, obj.args_end, events)
        if obj.done:
            if self._started:
                self._close_object(events, complete=True)
            else:  # not a call of ours: it was text after all
                events.append(TextEvent(self._obj_raw))
                self._seen_text = True
                self._state = "text"
                self._obj = None
                return i
            self._state = "calls"
            self._obj_raw = ""
        return i

    def _start_call(self, name: str, events: list[Event]) -> None:
        """A call of one of the tools begins (others stay text)."""
        if self.tool_names is not None and name not in self.tool_names:
            return
        self.calls.append(ToolCall(self.fmt.new_call_id(), name, ""))
        self._started = True
        self._sent_args = 0
        self._repeat = [] if any(c.name == name for c in self.calls[:-1]) else None
        self._call_event(CallStart(len(self.calls) - 1, self.calls[-1].id, name), events)

    def _stream_args(self, obj: _JsonObjectScanner, upto: int, events: list[Event]) -> None:
        if self.fmt.args_marker:
            begin = 0
        else:
            begin = obj.value_start if obj.args_start < 0 else obj.args_start
        fragment = "".join(obj.text[begin + self._sent_args : upto])
        if fragment:
            self._sent_args += len(fragment)
            call = self.calls[-1]
            call.arguments += fragment
            self._call_event(CallArgs(len(self.calls) - 1, fragment), events)

    def _close_object(self, events: list[Event], complete: bool) -> None:
        obj = self._obj
        assert obj is not None
        call = self.calls[-1]
        if self.fmt.args_marker:
            self._stream_args(obj, len(obj.text), events)
            if complete and not call.arguments.strip():
                call.arguments = "{}"
                self._call_event(CallArgs(len(self.calls) - 1, "{}"), events)
        elif obj.args_start >= 0:
            raw = "".join(obj.text[obj.args_start : obj.args_end])
            if self._sent_args == 0 and raw.startswith('"'):  # arguments written as a JSON string
                try:
                    raw = json.loads(raw)
                except json.JSONDecodeError:
                    pass
                if isinstance(raw, str):
                    call.arguments = raw
                    self._call_event(CallArgs(len(self.calls) - 1, raw), events)
            else:
                self._stream_args(obj, obj.args_end, events)
        elif not complete and self._sent_args:
            pass  # cut off mid-arguments: what arrived is what we have
        elif not call.arguments:
            call.arguments = "{}"
            self._call_event(CallArgs(len(self.calls) - 1, "{}"), events)
        self._obj = None
        self._end_call(events, complete)

    def _end_call(self, events: list[Event], complete: bool) -> None:
        """The current call's end: dropped where it repeats an earlier call of this turn (or is
        the cut-off start of one), else its CallEnd."""
        if self._repeat is not None and (not complete or self._repeats(self.calls[-1], exact=True)):
            self.calls.pop()
            self._repeat = None
            return
        self._call_event(CallEnd(len(self.calls) - 1), events)

    def _call_event(self, event: Event, events: list[Event]) -> None:
        """Emit an event of the current call, or hold it while the call is, so far, a repeat of an
        earlier call of this turn: a model looping on its call repeats it exactly, and a repeat
        is dropped (the constrained path ends the output at the first one)."""
        if self._repeat is None:
            events.append(event)
            return
        self._repeat.append(event)
        if isinstance(event, CallEnd) or not self._repeats(self.calls[-1], exact=False):
            events.extend(self._repeat)
            self._repeat = None

    def _repeats(self, call: ToolCall, exact: bool) -> bool:
        earlier = (c for c in self.calls[:-1] if c.name == call.name)
        if exact:
            return any(c.arguments == call.arguments for c in earlier)
        return any(c.arguments.startswith(call.arguments) for c in earlier)

    def _emit_text(self, text: str, events: list[Event]) -> None:
        if text:
            events.append(TextEvent(text))
            if text.strip():
                self._seen_text = True


_FENCE = "```"
_FENCES = (_FENCE + "json\n", _FENCE + "\n")  # the fences a bare call may come in
_TAG = re.compile(r"</?[^<>\s]+>")


class _XmlCall:
    """The text of one tagged call (`XmlTags`) as it arrives, cut into its pieces: `next()`
    gives ("function", None) once the name is read, per argument ("open", its key), its value's
    text as it comes (("text", a piece), then ("close", the last piece)), ("end", None) at the
    closing tag, ("bad", None) where the text is not the format's, or None while more text is
    needed. `taken` is the text consumed so far."""

    __slots__ = ("buf", "tags", "name", "opened", "key", "lead", "taken", "_key_end", "_value_open",
                 "_value_end", "_end")

    def __init__(self, tags: XmlTags) -> None:
        self.buf = ""
        self.tags = tags
        self.name = ""
        self.opened = False
        self.key: str | None = None  # the argument whose value is being read
        self.lead = False  # its value's first character was looked at
        self.taken = ""
        # the tags as the parser looks for them (whitespace around them is free)
        close = _TAG.findall(tags.key_close)  # "</arg_key>", "<arg_value>"; or just ">"
        self._key_end = close[0] if close else tags.key_close.strip()
        self._value_open = close[1] if len(close) > 1 else ""
        self._value_end = tags.value_close.strip()
        self._end = tags.function_close.strip()

    def _take(self, n: int) -> str:
        text, self.buf = self.buf[:n], self.buf[n:]
        self.taken += text
        return text

    def next(self) -> tuple[str, Any] | None:
        if not self.opened:
            return self._function()
        if self.key is not None:
            return self._value()
        rest = self.buf.lstrip()
        skip = len(self.buf) - len(rest)
        if rest.startswith(self._end):
            self._take(skip + len(self._end))
            return "end", None
        key_open = self.tags.key_open
        if not rest or self._end.startswith(rest) or key_open.startswith(rest):
            return None
        if not rest.startswith(key_open):
            return "bad", None
        close = rest.find(self._key_end)
        if close < 0:  # the key so far, maybe the start of its closing tag
            lt = rest.find("<", len(key_open))
            if "\n" in rest[len(key_open):lt if lt >= 0 else len(rest)]:
                return "bad", None
            return None if lt < 0 or self._key_end.startswith(rest[lt:]) else ("bad", None)
        key = rest[len(key_open):close]
        if "\n" in key or "<" in key:
            return "bad", None
        after = rest[close + len(self._key_end):]
        if self._value_open:  # GLM: <arg_value> after the key's closing tag
            inner = after.lstrip()
            if len(inner) < len(self._value_open):
                return None if self._value_open.startswith(inner) else ("bad", None)
            if not inner.startswith(self._value_open):
                return "bad", None
            self._take(skip + len(rest) - len(inner) + len(self._value_open))
        else:
            self._take(skip + close + len(self._key_end))
        if not key:
            return "bad", None
        self.key, self.lead = key, False
        return "open", key

    def _value(self) -> tuple[str, Any] | None:
        newlines = self.tags.value_newlines
        if newlines and not self.lead:  # the newline after the opening tag
            if not self.buf:
                return None
            if self.buf[0] == "\n":
                self._take(1)
        self.lead = True
        end = self.buf.find(self._value_end)
        if end >= 0:
            text = self._take(end)
            self._take(len(self._value_end))
            self.key = None
            return "close", text[:-1] if newlines and text.endswith("\n") else text
        keep = partial_suffix(self.buf, [("\n" if newlines else "") + self._value_end])
        if keep == len(self.buf):
            return None
        return "text", self._take(len(self.buf) - keep)

    def _function(self) -> tuple[str, Any] | None:
        rest = self.buf.lstrip() if self.tags.function_open else self.buf
        opening = self.tags.function_open
        if not rest.startswith(opening):
            return None if opening.startswith(rest) else ("bad", None)
        name_end = self.tags.name_close.strip()  # ">" after the name, or nothing: where it ends
        k = len(opening)
        while k < len(rest) and _NAME_CHARS.issuperset(rest[k]):
            k += 1
        if k == len(rest):
            return None
        name = rest[len(opening):k]
        if name_end:
            if not rest.startswith(name_end, k):
                return "bad", None
            k += len(name_end)
        if not name:
            return "bad", None
        self._take(len(self.buf) - len(rest) + k)
        self.name, self.opened = name, True
        return "function", None


def _xml_value(raw: str, schema: Any) -> Any:
    """An XML argument's text as its JSON value: by the parameter's declared type (a string
    stays the text as written), else JSON where it parses, else the text."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    kinds = set(kind) if isinstance(kind, list) else {kind}
    if "string" in kinds and len(kinds - {"null"}) == 1:
        return raw
    text = raw.strip()
    if kinds & {"boolean"} and text in ("True", "False"):  # Python's spelling, as templates write it
        return text == "True"
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return raw


_NAME_CHARS = frozenset(string.ascii_letters + string.digits + "_-.")


def _merge_text(events: list[Event]) -> list[Event]:
    out: list[Event] = []
    for e in events:
        if isinstance(e, TextEvent):
            if not e.text:
                continue
            if out and isinstance(out[-1], TextEvent):
                out[-1] = TextEvent(out[-1].text + e.text)
                continue
        out.append(e)
    return out


@dataclass(slots=True)
class ParsedOutput:
    content: str
    calls: list[ToolCall] = field(default_factory=list)


def parse_tool_calls(
    text: str, fmt: ToolFormat, tool_names: Sequence[str] | None = None,
    schemas: dict[str, Any] | None = None,
) -> ParsedOutput:
    """A whole output → (content outside the calls, calls)."""
    parser = ToolCallParser(fmt, tool_names, schemas)
    events = parser.feed(text) + parser.finish()
    content = "".join(e.text for e in events if isinstance(e, TextEvent))
    return ParsedOutput(content, parser.calls)
