"""Plain-data constraint specs → llguidance grammars (JSON schema, regex, Lark, tool calls).

Tool calls: each call is a JSON object whose name is one of the tools and whose arguments follow
that tool's schema; the format (how calls are wrapped and separated) comes from the chat-template
family, e.g. Hermes/Qwen::

    call_open "<tool_call>\\n", call_close "\\n</tool_call>", separator "\\n"
    → <tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>

and Mistral: list_open "[TOOL_CALLS][", separator ", ", list_close "]". The name key comes first
in the object so that a streaming parser sees the name before the arguments. Mistral v11+ writes
no JSON wrapper: with `args_marker` "[ARGS]" (and call_open "[TOOL_CALLS]") a call is
`[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}`.

A lazy tool-call spec (`"lazy": true`, `"trigger": "<tool_call>"`) leaves the output free until
it writes the trigger (a prefix of list_open + call_open), which may never come: text, or text
followed by calls that the grammar then holds to the tools' schemas (an llguidance lazy lexeme,
so the trigger is found across token boundaries). It is what `strict` tools ask for when the
model may also answer in text.

Markup that is a special token of the model's tokenizer (Mistral's `[TOOL_CALLS]` and `[ARGS]`,
harmony's `<|channel|>`) is written as that token, never spelled out in text; a special-token
trigger ends the free text by itself. The tags of argument-per-tag formats stay text.

An eager spec with `"or_text": PREFIX` lets the answer be text instead: PREFIX, then free text
(gpt-oss's final channel, where its calls and its text answers both open with a header and no
marker opens calls inside free text).

A spec with `"reasoning": {"open": "<think>", "close": "</think>", "opened": false, "prefix": ""}`
(JSON, regex and eager tool calls) lets a reasoning model think first: free text between the markers
(optional, or required and without `open` where the prompt opened it), then `prefix` and the
answer.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from engine.constrain.base import ConstraintError

# compact, json.dumps-like output: no free whitespace (a small model at temperature 1 would
# otherwise wander off into endless newlines)
JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
MAX_TOOLS = 128
_FORMAT_KEYS = ("list_open", "call_open", "call_close", "separator", "list_close")
MAX_CALLS = 32  # calls in one tool_calls constraint, and the bound when 'max_calls' is not given
CALL_CAPTURE = "call"  # call slot k's JSON is captured under the name f"call_{k}"
ANY_TEXT = "/(.|\\n)*/"  # a free-text lexeme (it never matches a special token)


def _schema(value: Any, where: str) -> dict[str, Any]:
    if isinstance(value, bool):  # JSON Schema allows true/false as schemas
        return {} if value else {"not": {}}
    if not isinstance(value, dict):
        raise ConstraintError(f"{where} must be a JSON Schema object")
    return value


def _lark_str(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _lark_text(text: str, special: Mapping[str, int]) -> str:
    """`text` as grammar items: the special tokens in it (`special`: the tokenizer's, text → id)
    as those tokens, the rest as text. A quoted "[TOOL_CALLS]" would make the model spell the
    marker out in ordinary tokens, which it was never trained to do, and never allow the one
    token it writes."""
    found = sorted((t for t in special if t and t in text), key=len, reverse=True)
    if not found:
        return _lark_str(text)
    pieces = re.split("(" + "|".join(map(re.escape, found)) + ")", text)
    return " ".join(f"<[{special[p]}]>" if p in special else _lark_str(p) for p in pieces if p)


def _json_grammar(schema: dict[str, Any], *, lenient: bool) -> str:
    import llguidance

    options: Any = dict(JSON_OPTIONS, lenient=lenient)  # llguidance's JsonCompileOptions
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
    except ValueError as exc:
        raise ConstraintError(f"invalid JSON schema: {exc}") from None


def _tool_parameters(tool: dict[str, Any], index: int) -> tuple[str, dict[str, Any]]:
    """A tool's name and its parameters' schema, embedded as a schema resource of its own (a
    `$id` unless they carry one), so that the references in them ("#", "#/$defs/Addr",
    "#/definitions/...", "#/properties/...") resolve against the parameters, as they do when the
    parameters are the whole schema (the shape pydantic's `model_json_schema()` gives nested
    models), not against a wrapper around them."""
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise ConstraintError("every tool needs a non-empty string 'name'")
    params = tool.get("parameters")
    params = {"type": "object"} if params is None else _schema(params, f"tool {name!r} parameters")
    if "$id" not in params:
        params = {"$id": f"urn:mlxd:tool-parameters:{index}", **params}
    return name, params


def tool_call_schema(tool: dict[str, Any], name_key: str, args_key: str, index: int = 0) -> dict[str, Any]:
    """One call of `tool` as a JSON object: {name_key: <the name>, args_key: <its parameters>}."""
    name, params = _tool_parameters(tool, index)
    return {
        "type": "object",
        "properties": {name_key: {"const": name}, args_key: params},
        "required": [name_key, args_key],
        "additionalProperties": False,
    }


def _tool_calls_lark(spec: dict[str, Any], special: Mapping[str, int]) -> str:
    tools = spec.get("tools")
    if not isinstance(tools, list) or not tools:
        raise ConstraintError("a tool_calls constraint needs a non-empty 'tools' list")
    if len(tools) > MAX_TOOLS:
        raise ConstraintError(f"at most {MAX_TOOLS} tools can be constrained at once")
    fmt = spec.get("format") or {}
    if not isinstance(fmt, dict):
        raise ConstraintError("'format' must be an object")
    parts = {k: fmt.get(k, "") for k in _FORMAT_KEYS}
    if not all(isinstance(v, str) for v in parts.values()):
        raise ConstraintError(f"format fields {', '.join(_FORMAT_KEYS)} must be strings")
    name_key = fmt.get("name_key", "name")
    args_key = fmt.get("args_key", "arguments")
    lenient = bool(spec.get("lenient", True))
    options = dict(JSON_OPTIONS, lenient=lenient)
    if fmt.get("compact_json"):  # the family writes JSON without spaces (gpt-oss)
        options.update(item_separator=",", key_separator=":")
    args_marker = fmt.get("args_marker") or ""
    if not isinstance(args_marker, str):
        raise ConstraintError("format field args_marker must be a string")
    rules, extra = [], []
    for i, tool in enumerate(tools):
        if fmt.get("xml"):  # Qwen3-Coder, GLM: one tag per argument
            rule, aux = _xml_call_rules(tool, i, fmt["xml"], options)
            rules.append(rule)
            extra += aux
            continue
        if args_marker:  # Mistral v11+: the name, the marker, the arguments object
            name, params = _tool_parameters(tool, i)
            schema = {**params, "x-guidance": options}
            rules.append(f"tool_{i}: {_lark_str(name)} {_lark_text(args_marker, special)} %json "
                         f"{json.dumps(schema, ensure_ascii=False)}")
            continue
        schema = {**tool_call_schema(tool, name_key, args_key, i), "x-guidance": options}
        rules.append(f"tool_{i}: %json {json.dumps(schema, ensure_ascii=False)}")
    body = " | ".join(f"tool_{i}" for i in range(len(tools)))
    slots = _call_slots(spec)
    first_open = parts["list_open"] + parts["call_open"]
    if spec.get("lazy"):
        # free text, or free text, the trigger, the rest of the first call's opening and calls
        trigger = spec.get("trigger")
        if not isinstance(trigger, str) or not trigger or not first_open.startswith(trigger):
            raise ConstraintError("a lazy tool_calls constraint needs a 'trigger' that opens its first call")
        rest = _lark_text(first_open[len(trigger):], special)
        if trigger in special:  # the token itself ends the text (no text contains it)
            head, free = f"TEXT | TEXT <[{special[trigger]}]> {rest}", [f"TEXT: {ANY_TEXT}"]
        else:
            head = f"TEXT | trig {rest}"
            free = [f"trig[lazy]: TEXT {_lark_str(trigger)}", f"TEXT: {ANY_TEXT}"]
    else:
        head, free = _lark_text(first_open, special), []
    or_text = spec.get("or_text")
    if or_text is not None:
        if not isinstance(or_text, str) or not or_text or spec.get("lazy"):
            raise ConstraintError("'or_text' must be a non-empty string (and the constraint not lazy)")
        free = [f"TEXT: {ANY_TEXT}"]
    opened, closed = _lark_text(parts["call_open"], special), _lark_text(parts["call_close"], special)
    sep = _lark_text(parts["separator"], special)
    more = ""
    for k in range(slots - 1, 0, -1):  # call_0 (sep call_1 (sep call_2)?)?: at most `slots` calls
        more = f" ({sep} {opened} {CALL_CAPTURE}_{k} {closed}{more})?"
    calls = f"{head} {CALL_CAPTURE}_0 {closed}{more} {_lark_text(parts['list_close'], special)}"
    lines = [
        f"start: {calls}" if or_text is None else f"start: {_lark_text(or_text, special)} TEXT | {calls}",
        f"body: {body}",
        *rules,  # tool i's rule is on line FIRST_TOOL_LINE + i (tool_error relies on it)
        *free,
        *extra,
        *([f"XML_TEXT: {ANY_TEXT}"] if any("XML_TEXT" in r for r in extra) else []),
        # one named capture per call slot, its JSON: the engine compares each finished call with
        # the earlier ones (the grammar engine keeps one capture of a name repeated back to back)
        *(f'{CALL_CAPTURE}_{k}[capture="{CALL_CAPTURE}_{k}"]: body' for k in range(slots)),
    ]
    return "\n".join(lines) + "\n"


def _xml_call_rules(tool: dict[str, Any], index: int, tags: dict[str, Any],
                    options: dict[str, Any]) -> tuple[str, list[str]]:
    """Tool `index` as a call with one tag per argument, written as `tags` say (server.tools
    XmlTags: function_open, name, name_close, then per argument key_open, key, key_close, the
    value and value_close, then function_close): its properties in the schema's order (the
    required ones always, the others maybe). A string property's value is bare text up to its
    closing tag (an enum: one of its values); any other is JSON under the property's schema
    (with the parameters' `$defs` / `definitions` beside it, for its references). Returns the
    tool's rule and the rules it uses."""
    try:
        opening, name_close, key_open, key_close, value_close, closing = (
            str(tags[k]) for k in ("function_open", "name_close", "key_open", "key_close",
                                   "value_close", "function_close"))
    except (KeyError, TypeError):
        raise ConstraintError("format field xml needs the tags of a call") from None
    newline = "\n" if tags.get("value_newlines") else ""
    name, params = _tool_parameters(tool, index)
    props = params.get("properties") or {}
    if not isinstance(props, dict):
        raise ConstraintError(f"tool {name!r} parameters: 'properties' must be an object")
    required = set(params.get("required") or [])
    defs: dict[str, Any] = {k: params[k] for k in ("$defs", "definitions") if k in params}
    parts: list[str] = []
    extra: list[str] = []
    close_tag = _lark_str(newline + value_close)
    for j, (key, prop) in enumerate(props.items()):
        rule = f"tool_{index}_p{j}"
        open_tag = _lark_str(key_open + key + key_close + newline)
        if isinstance(prop, dict) and prop.get("type") == "string":
            if isinstance(prop.get("enum"), list) and all(isinstance(e, str) for e in prop["enum"]):
                choices = " | ".join(_lark_str(e) for e in prop["enum"]) or '""'
                extra.append(f"{rule}: {open_tag} ({choices}) {close_tag}")
            else:  # bare text (a pattern or length limit is not held to)
                extra.append(f"{rule}: {open_tag} {rule}_text")
                extra.append(f"{rule}_text[lazy]: XML_TEXT {close_tag}")
        else:
            schema = {**_schema(prop, f"tool {name!r} parameter {key!r}"), **defs, "x-guidance": options}
            extra.append(f"{rule}: {open_tag} %json {json.dumps(schema, ensure_ascii=False)} {close_tag}")
        parts.append(rule if key in required else f"{rule}?")
    head = _lark_str(opening + name + name_close)
    return f"tool_{index}: {head} {' '.join(parts)} {_lark_str(closing)}", extra


def _call_slots(spec: dict[str, Any]) -> int:
    if not spec.get("parallel", True):
        return 1
    max_calls = spec.get("max_calls")
    if max_calls is None:
        return MAX_CALLS
    if not isinstance(max_calls, int) or isinstance(max_calls, bool) or not 1 <= max_calls <= MAX_CALLS:
        raise ConstraintError(f"'max_calls' must be an integer from 1 to {MAX_CALLS}")
    return max_calls


FIRST_TOOL_LINE = 3
_LARK_AT = re.compile(r"^at (\d+)\(\d+\): (?:failed to compile JSON schema: )?")


def tool_error(spec: Any, message: str) -> str:
    """A grammar-engine error about a grammar mlxd wrote around the client's schemas, said about
    the tool it concerns ("tool 'f' parameters: Invalid type: objectx"), or about the schema,
    instead of a position in a grammar the client never wrote."""
    if not isinstance(spec, dict) or (spec.get("type") != "tool_calls" and "reasoning" not in spec):
        return message
    at = _LARK_AT.match(message)
    if at is None:
        return message
    if spec.get("type") != "tool_calls":  # a JSON answer after reasoning: its schema's error
        return message[at.end():]
    index = int(at.group(1)) - FIRST_TOOL_LINE
    tools = spec.get("tools") or []
    rest = message[at.end():]
    if 0 <= index < len(tools) and isinstance(tools[index], dict):
        return f"tool {tools[index].get('name')!r} parameters: {rest}"
    return rest


def _json_answer(spec: dict[str, Any]) -> tuple[dict[str, Any], bool] | None:
    """A JSON spec's schema and whether it is compiled leniently (json_object: any object,
    strictly); None for the other kinds."""
    kind = spec.get("type")
    if kind == "json_schema":
        return _schema(spec.get("schema"), "'schema'"), not spec.get("strict", True)
    if kind == "json_object":
        return {"type": "object"}, False
    return None


def _answer_lark(spec: dict[str, Any], special: Mapping[str, int]) -> str:
    """The Lark grammar of a spec that can follow reasoning (its start rule on the first line)."""
    json_answer = _json_answer(spec)
    if json_answer is not None:
        schema, lenient = json_answer
        options = dict(JSON_OPTIONS, lenient=lenient)
        return f"start: %json {json.dumps({**schema, 'x-guidance': options}, ensure_ascii=False)}\n"
    if spec.get("type") == "tool_calls" and not spec.get("lazy"):
        return _tool_calls_lark(spec, special)
    if spec.get("type") == "regex":  # llguidance's own rendering: one line, "start: /.../"
        import llguidance

        grammar = json.loads(llguidance.LLMatcher.grammar_from_regex(_pattern(spec)))
        return grammar["grammars"][0]["lark_grammar"] + "\n"
    raise ConstraintError("'reasoning' goes with json_schema, json_object, regex and (not lazy) tool_calls "
                          "constraints")


def _pattern(spec: dict[str, Any]) -> str:
    pattern = spec.get("pattern")
    if not isinstance(pattern, str):
        raise ConstraintError("a regex constraint needs a string 'pattern'")
    return pattern


def _after_reasoning(lark: str, reasoning: Any, special: Mapping[str, int]) -> str:
    """`lark` (its start rule on the first line) after the model's reasoning: `reasoning` is
    {"open", "close", "opened", "prefix"}: the reasoning is `open`, free text, `close` (when
    the prompt `opened` it, the text and `close` only, and then they must come), then `prefix`
    (harmony's final-channel header) and the answer. The reasoning's text ends at the first
    `close`; a close that begins with a special token ends it by that token."""
    if not isinstance(reasoning, dict):
        raise ConstraintError("'reasoning' must be an object")
    opening, close, prefix = (reasoning.get(k, "") for k in ("open", "close", "prefix"))
    if not all(isinstance(v, str) for v in (opening, close, prefix)) or not close or not (
            opening or reasoning.get("opened")):
        raise ConstraintError("'reasoning' needs string 'open' (unless 'opened') and 'close' markers")
    head, _, rest = lark.partition("\n")
    if not head.startswith("start:"):
        raise ConstraintError("the answer's grammar must begin with its start rule")
    rules = [f"REASON_TEXT: {ANY_TEXT}"]
    if any(close.startswith(t) for t in special):
        body = f"REASON_TEXT {_lark_text(close, special)}"
    else:
        body = "reason_text"
        rules.append(f"reason_text[lazy]: REASON_TEXT {_lark_str(close)}")
    reason = body if reasoning.get("opened") else f"({_lark_text(opening, special)} {body})?"
    return "\n".join([
        "answer:" + head[len("start:"):],  # the answer's rules keep their lines (tool_error)
        rest.rstrip("\n"),
        f"start: {reason} GAP? {_lark_text(prefix, special)} answer",
        "GAP: /[ \\t\\r\\n]+/",
        *rules,
    ]) + "\n"


def grammar_of(spec: Any, special: Mapping[str, int] | None = None) -> str:
    """The llguidance grammar for a spec; ConstraintError for anything malformed. `special`: the
    tokenizer's special tokens (text → id), which a tool-call format's markup is written in."""
    import llguidance

    if not isinstance(spec, dict):
        raise ConstraintError("a constraint must be an object with a 'type'")
    kind = spec.get("type")
    special = special or {}
    if spec.get("reasoning") is not None:
        return llguidance.LLMatcher.grammar_from_lark(
            _after_reasoning(_answer_lark(spec, special), spec["reasoning"], special))
    json_answer = _json_answer(spec)
    if json_answer is not None:
        schema, lenient = json_answer
        return _json_grammar(schema, lenient=lenient)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(_pattern(spec))
    if kind == "lark":
        grammar = spec.get("grammar")
        if not isinstance(grammar, str):
            raise ConstraintError("a lark constraint needs a string 'grammar'")
        return llguidance.LLMatcher.grammar_from_lark(grammar)
    if kind == "tool_calls":
        return llguidance.LLMatcher.grammar_from_lark(_tool_calls_lark(spec, special))
    raise ConstraintError(
        f"unknown constraint type {kind!r}; expected json_schema, json_object, regex, lark or tool_calls"
    )
