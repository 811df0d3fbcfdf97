"""Tool-call formats: whole-text parsing, and streamed parsing that reassembles to the same calls
however the text is split."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.tools import (
    FORMATS,
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    CallArgs,
    CallEnd,
    CallStart,
    TextEvent,
    ToolCallParser,
    format_for_template,
    function_specs,
    parse_tool_calls,
)
from tests.tool_text import calls_text

ARGS_A = '{"city": "Paris", "units": {"temp": "C", "list": [1, 2, {"x": "}"}]}, "q": "a\\"b"}'
ARGS_B = '{"n": 3}'

SAMPLES = {
    "hermes": (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": ' + ARGS_A + '}\n</tool_call>\n'
        '<tool_call>\n{"name": "count", "arguments": ' + ARGS_B + '}\n</tool_call>',
        "Let me check.\n",
    ),
    "llama3_json": (
        '{"name": "get_weather", "parameters": ' + ARGS_A + '}; {"name": "count", "parameters": ' + ARGS_B + "}",
        "",
    ),
    "mistral": (
        'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": ' + ARGS_A + '}, {"name": "count", "arguments": '
        + ARGS_B + "}]",
        "Sure.",
    ),
    # v11+: no JSON wrapper; the model may write an id of its own (ours replaces it)
    "mistral_v11": (
        "Sure.[TOOL_CALLS]get_weather[ARGS]" + ARGS_A + "[TOOL_CALLS]count[CALL_ID]a1B2c3D4e[ARGS]" + ARGS_B,
        "Sure.",
    ),
}


for _name, _fmt in FORMATS.items():  # the formats with a tag per argument
    if _fmt.xml is not None:
        SAMPLES[_name] = ("Let me check.\n" + calls_text(_fmt, [("get_weather", json.loads(ARGS_A)),
                                                               ("count", json.loads(ARGS_B))]),
                          "Let me check.\n")


def _stream(fmt, pieces):
    parser = ToolCallParser(fmt, ["get_weather", "count"])
    events = []
    for p in pieces:
        events += parser.feed(p)
    events += parser.finish()
    return parser, events


def _reassemble(events):
    text, calls, order = "", {}, []
    for e in events:
        if isinstance(e, TextEvent):
            text += e.text
        elif isinstance(e, CallStart):
            assert e.index not in calls and e.index == len(order)
            calls[e.index] = {"id": e.id, "name": e.name, "arguments": ""}
            order.append(e.index)
        elif isinstance(e, CallArgs):
            calls[e.index]["arguments"] += e.fragment
        elif isinstance(e, CallEnd):
            assert e.index in calls
    return text, [calls[i] for i in order]


def test_whole_text_parses_per_format():
    for name, (text, content) in SAMPLES.items():
        out = parse_tool_calls(text, FORMATS[name], ["get_weather", "count"])
        assert out.content == content, name
        assert [c.name for c in out.calls] == ["get_weather", "count"], name
        assert [c.arguments for c in out.calls] == [ARGS_A, ARGS_B], name
        assert json.loads(out.calls[0].arguments)["units"]["list"][2] == {"x": "}"}
        if FORMATS[name].call_id_length:  # what Mistral's templates accept back
            assert all(len(c.id) == 9 and c.id.isalnum() for c in out.calls), name
        else:
            assert all(c.id.startswith("call_") for c in out.calls)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(sorted(SAMPLES)), st.lists(st.integers(0, 400), max_size=12))
def test_streamed_equals_whole_for_any_split(name, cuts):
    text, content = SAMPLES[name]
    cuts = sorted({c % (len(text) + 1) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    parser, events = _stream(FORMATS[name], pieces)
    got_text, calls = _reassemble(events)
    assert got_text == content
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", ARGS_A), ("count", ARGS_B)]
    # name first: every call's start precedes its argument fragments
    seen = set()
    for e in events:
        if isinstance(e, CallStart):
            seen.add(e.index)
        if isinstance(e, CallArgs):
            assert e.index in seen


def test_arguments_stream_in_fragments_before_the_call_ends():
    text = SAMPLES["hermes"][0]
    parser = ToolCallParser(HERMES)
    events = []
    for ch in text:
        events += parser.feed(ch)
    frags = [e for e in events if isinstance(e, CallArgs) and e.index == 0]
    assert len(frags) > 10  # streamed, not in one piece at the end
    assert "".join(f.fragment for f in frags) == ARGS_A


def test_plain_text_passes_through_and_partial_markers_are_held():
    parser = ToolCallParser(HERMES)
    assert parser.feed("x < y and <tool") == [TextEvent("x < y and ")]
    assert parser.feed("box>") == [TextEvent("<toolbox>")]
    assert parser.finish() == []
    out = parse_tool_calls("no calls here {\"name\": 1}", HERMES)
    assert out.content == "no calls here {\"name\": 1}" and out.calls == []


def test_unknown_tool_name_and_truncated_call():
    out = parse_tool_calls('<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>', HERMES, ["f"])
    assert out.calls == [] and '"nope"' in out.content
    cut = parse_tool_calls('<tool_call>\n{"name": "f", "arguments": {"a": [1, ', HERMES, ["f"])
    assert [c.name for c in cut.calls] == ["f"] and cut.calls[0].arguments == '{"a": [1, '


def test_string_encoded_arguments_and_llama_python_tag():
    out = parse_tool_calls('<|python_tag|>{"name": "f", "arguments": "{\\"a\\": 1}"}', LLAMA3_JSON)
    assert out.calls[0].arguments == '{"a": 1}' and out.content == ""
    # Llama 3 JSON only opens calls at the start: later braces are text
    out = parse_tool_calls('Sure: {"name": "f", "parameters": {}}', LLAMA3_JSON)
    assert out.calls == []


def test_template_families_and_function_specs():
    assert format_for_template("{% if tools %}<tool_call>{% endif %}") is HERMES
    assert format_for_template("[TOOL_CALLS] {{ tools }}") is MISTRAL
    assert format_for_template("<|start_header_id|>{% if tools %}") is LLAMA3_JSON
    assert format_for_template(None) is HERMES
    specs = function_specs([{"type": "function", "function": {"name": "f"}}])
    assert specs == [{"name": "f", "description": "",
                      "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
                      "strict": False}]
    for bad in ([{"type": "function", "function": {}}], [{"type": "web_search"}],
                [{"type": "function", "function": {"name": "f"}}] * 2):
        try:
            function_specs(bad)
        except ValueError:
            continue
        raise AssertionError(bad)


ARGS_C = ARGS_A.replace("Paris", "Paris, TX")  # same name, same start, other arguments


def _calls(fmt, calls):
    key = fmt.args_keys[0]
    if fmt.xml is not None:
        return calls_text(fmt, [(n, json.loads(a)) for n, a in calls])
    if fmt.args_marker:
        return "".join(fmt.call_open + n + fmt.args_marker + a for n, a in calls)
    objs = [fmt.call_open + '{"name": "' + n + '", "' + key + '": ' + a + "}" + fmt.call_close for n, a in calls]
    return fmt.list_open + fmt.separator.join(objs) + fmt.list_close


REPEATS = [("get_weather", ARGS_A), ("get_weather", ARGS_A), ("get_weather", ARGS_C), ("count", ARGS_B),
           ("get_weather", ARGS_A)]
KEPT = [("get_weather", ARGS_A), ("get_weather", ARGS_C), ("count", ARGS_B)]


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(sorted(FORMATS)), st.lists(st.integers(0, 2000), max_size=12))
def test_a_repeated_call_is_dropped_and_never_streamed(name, cuts):
    fmt = FORMATS[name]
    text = _calls(fmt, REPEATS)
    whole = parse_tool_calls(text, fmt, ["get_weather", "count"])
    assert [(c.name, c.arguments) for c in whole.calls] == KEPT and whole.content == ""
    cuts = sorted({c % (len(text) + 1) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    _, events = _stream(fmt, pieces)
    got_text, calls = _reassemble(events)  # indexes 0, 1, 2 with no gap
    assert got_text == "" and [(c["name"], c["arguments"]) for c in calls] == KEPT
    assert sum(isinstance(e, CallEnd) for e in events) == 3


def test_a_cut_off_repeat_is_dropped_and_a_cut_off_new_call_kept():
    one = _calls(HERMES, [("f", '{"a": 1}')])
    cut_repeat = parse_tool_calls(one + '\n<tool_call>\n{"name": "f", "arguments": {"a": ', HERMES, ["f"])
    assert [(c.name, c.arguments) for c in cut_repeat.calls] == [("f", '{"a": 1}')]
    cut_new = parse_tool_calls(one + '\n<tool_call>\n{"name": "f", "arguments": {"a": 2', HERMES, ["f"])
    assert [(c.name, c.arguments) for c in cut_new.calls] == [("f", '{"a": 1}'), ("f", '{"a": 2')]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_markup_of_a_call_cut_off_before_its_name_is_not_content(name):
    """max_tokens ending the output inside the next call's markup (after a complete call, before
    the new call's name) leaves the complete calls and no text; the same cut before any call is
    still text (nothing was a call)."""
    fmt = FORMATS[name]
    one = _calls(fmt, [("f", '{"a": 1}')])
    if fmt.list_close:
        one = one[: -len(fmt.list_close)]
    nxt = fmt.separator + fmt.call_open + '{"name": "f'
    marker = fmt.separator + (fmt.call_open or fmt.start_markers[0])
    tails = {marker[:3], '{"na'}
    if fmt.args_marker:  # cut anywhere in the next call's name, id or markers
        nxt, tails = fmt.call_open + "f" + fmt.id_marker + "ab" + fmt.args_marker, set()
    if fmt.xml is not None:  # cut anywhere in the next call's opening, name and first tag
        nxt = fmt.separator + fmt.call_open + fmt.xml.function_open + "f" + fmt.xml.name_close + fmt.xml.key_open
        tails = set()
    for tail in {nxt[:k] for k in range(1, len(nxt))} | tails:
        whole = parse_tool_calls(one + tail, fmt, ["f"])
        assert [(c.name, c.arguments) for c in whole.calls] == [("f", '{"a": 1}')], tail
        assert whole.content == "", (tail, whole.content)
        parser = ToolCallParser(fmt, ["f"])
        events = [e for ch in one + tail for e in parser.feed(ch)] + parser.finish()
        assert not any(isinstance(e, TextEvent) for e in events), tail
    if fmt is HERMES:  # no call before: the cut-off markup stays the content it was
        assert parse_tool_calls('<tool_call>\n{"name": "f', fmt, ["f"]).content == '<tool_call>\n{"name": "f'
        assert parse_tool_calls("x <tool", fmt, ["f"]).content == "x <tool"


def test_xml_arguments_typed_by_schema_and_a_broken_call_ends_where_it_breaks():
    """Qwen3-Coder's tags: a value is typed by its property (a string stays the text even where
    it reads as a number; Python's True is a boolean), JSON where no type is known; a call whose
    next tag is broken (its start in an earlier delta) ends with the arguments that were whole,
    and what follows is text."""
    schemas = {"f": {"type": "object", "properties": {"zip": {"type": "string"}, "on": {"type": "boolean"}}}}
    text = ("<tool_call>\n<function=f>\n<parameter=zip>\n01234\n</parameter>\n<parameter=on>\nTrue\n"
            "</parameter>\n<parameter=n>\n[1, 2]\n</parameter>\n</function>\n</tool_call>")
    out = parse_tool_calls(text, FORMATS["qwen3_coder"], ["f"], schemas)
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [("f", {"zip": "01234", "on": True, "n": [1, 2]})]
    parser = ToolCallParser(FORMATS["qwen3_coder"], ["f"])
    pieces = ["<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n<param", "eter=k", "x y\nmore"]
    events = [e for p in pieces for e in parser.feed(p)] + parser.finish()
    assert [(c.name, c.arguments) for c in parser.calls] == [("f", '{"a": 1}')]
    assert "".join(e.text for e in events if isinstance(e, TextEvent)) == "<parameter=kx y\nmore"


def test_xml_string_arguments_stream_as_they_are_written():
    """A string argument (a file's content, say) streams piece by piece as JSON string text, not
    only once its closing tag arrives; its pieces add up to the whole call's arguments, and a
    call cut off inside it still ends as valid JSON."""
    schemas = {"write": {"type": "object", "properties": {"path": {"type": "string"},
                                                          "content": {"type": "string"}}}}
    body = 'def f():\n    return "</p>" < 3\n'
    text = ("<tool_call>\n<function=write>\n<parameter=path>\na.py\n</parameter>\n<parameter=content>\n"
            + body + "\n</parameter>\n</function>\n</tool_call>")
    parser = ToolCallParser(FORMATS["qwen3_coder"], ["write"], schemas)
    seen = []
    for k, ch in enumerate(text):
        for e in parser.feed(ch):
            if isinstance(e, CallArgs):
                seen.append((k, e.fragment))
    closing = text.index("</parameter>", text.index("<parameter=content>"))
    assert sum(k < closing for k, _ in seen) > 10  # streamed before the value was whole
    args = "".join(f for _, f in seen) + "".join(e.fragment for e in parser.finish() if isinstance(e, CallArgs))
    assert json.loads(args) == {"path": "a.py", "content": body} == json.loads(parser.calls[0].arguments)
    cut = parse_tool_calls(text[: text.index("return")], FORMATS["qwen3_coder"], ["write"], schemas)
    assert json.loads(cut.calls[0].arguments) == {"path": "a.py", "content": "def f():\n    "}


BARE = '{"name": "get_weather", "arguments": ' + ARGS_A + "}"
BARE_CASES = [  # (output, content, calls): Qwen2.5(-Coder) writes its Hermes calls bare or fenced
    (BARE, "", ["get_weather"]),
    ("\n```json\n" + BARE + "\n```", "\n", ["get_weather"]),
    ("```\n" + BARE + "\n```\nDone.", "Done.", ["get_weather"]),
    ('{"answer": 42}', '{"answer": 42}', []),  # JSON that is no call stays text
    ('```json\n{"name": "nope", "arguments": {}}\n```', '```json\n{"name": "nope", "arguments": {}}\n```', []),
    ("```python\nprint({1: 2})\n```", "```python\nprint({1: 2})\n```", []),
    ("Sure: " + BARE, "Sure: " + BARE, []),  # only at the start
]


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(range(len(BARE_CASES))), st.lists(st.integers(0, 400), max_size=10))
def test_hermes_calls_written_bare_or_fenced_at_the_start(case, cuts):
    text, content, names = BARE_CASES[case]
    cuts = sorted({c % (len(text) + 1) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    _, events = _stream(HERMES, pieces)
    got_text, calls = _reassemble(events)
    assert (got_text, [c["name"] for c in calls]) == (content, names)
    assert all(c["arguments"] == ARGS_A for c in calls)
