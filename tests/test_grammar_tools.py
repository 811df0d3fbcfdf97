"""The tool-call grammar as a set of strings, on the bundled model's tokenizer.

- one call then the end is accepted, and so are two different calls (two tools, or one tool
  twice with other arguments), up to max_calls and no more, in every call format;
- a call that repeats an earlier one exactly ends the constraint there (the model would
  otherwise copy its call into every slot);
- parameters with root-level $defs/$ref (pydantic's nested models) compile and are enforced,
  also when two tools each define a $defs entry of the same name;
- a bad tool schema is reported about the tool, without the generated grammar;
- the lazy grammar (strict tools where text is allowed too): any text, or text then valid calls
  once the format's trigger is written, repeats ending it as in the eager grammar.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from pydantic import BaseModel

pytest.importorskip("llguidance")

from engine.constrain import ConstraintError, compile_constraint, fill_masks, new_bitmask  # noqa: E402
from server.tools import FORMATS, HARMONY, HERMES, MISTRAL, ToolFormat  # noqa: E402
from tests.tool_text import calls_text  # noqa: E402

WEATHER = {
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"],
        "additionalProperties": False,
    },
}
SEARCH = {
    "name": "search",
    "parameters": {
        "type": "object",
        "properties": {"query": {"type": "string"}},
        "required": ["query"],
        "additionalProperties": False,
    },
}


class Addr(BaseModel):
    street: str
    city: str


class Person(BaseModel):
    name: str
    home: Addr
    work: Addr | None = None


class Node(BaseModel):
    value: int
    children: list[Node] = []


class Addr2(BaseModel):  # another "Addr" shape: a post box
    box: int


class Parcel(BaseModel):
    weight: float
    to: Addr2


def _parcel_schema() -> dict[str, Any]:
    """Parcel's schema with its nested model named "Addr" too: the same $defs name as Person's."""
    text = json.dumps(Parcel.model_json_schema()).replace("Addr2", "Addr")
    return json.loads(text)


@pytest.fixture(scope="module")
def lm(tinycoder_path):
    from engine.loader import load_model

    return load_model(str(tinycoder_path), dtype="float32")


def _compile(lm, fmt: ToolFormat, tools: list[dict[str, Any]], parallel: bool = True, max_calls: int = 4,
             lazy: bool = False):
    spec = fmt.constraint(tools, parallel=parallel, max_calls=max_calls, lazy=lazy)
    return compile_constraint(spec, lm.tokenizer, lm.vocab_size, lm.eos_token_ids)


def _allowed(lm, c) -> set[int]:
    bm = new_bitmask(1, lm.vocab_size)
    fill_masks([(c, 0)], bm)
    bits = np.unpackbits(bm[0].view(np.uint8), bitorder="little")[: lm.vocab_size]
    return set(np.flatnonzero(bits).tolist())


def _feed(lm, c, text: str) -> bool:
    """Consume `text` token by token, each token checked against the mask first."""
    for t in lm.tokenizer.encode(text, add_special_tokens=False):
        if t not in _allowed(lm, c) or not c.consume(t):
            return False
    return True


def accepts(lm, fmt: ToolFormat, tools: list[dict[str, Any]], text: str, parallel: bool = True,
            max_calls: int = 4, lazy: bool = False) -> bool:
    """`text` is a complete output of the format's grammar: every token allowed, then the end."""
    return _accepts_spec(lm, fmt.constraint(tools, parallel=parallel, max_calls=max_calls, lazy=lazy), text)


def _unclosed(fmt: ToolFormat, calls: list[tuple[str, dict[str, Any]]]) -> str:
    """The calls without the list's closing marker (Mistral's "]"): more calls may follow."""
    text = calls_text(fmt, calls)
    return text[: len(text) - len(fmt.list_close)]


PARIS = ("get_weather", {"city": "Paris", "days": 3})
LONDON = ("get_weather", {"city": "London", "days": 2})
QUERY = ("search", {"query": "csv parser"})


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_one_call_then_the_end_is_accepted(lm, name):
    fmt = FORMATS[name]
    c = _compile(lm, fmt, [WEATHER, SEARCH])
    assert _feed(lm, c, calls_text(fmt, [PARIS]))
    assert c.matcher.is_accepting()
    assert set(lm.eos_token_ids) <= _allowed(lm, c)  # the end is allowed right after the call
    assert c.is_done() == bool(fmt.list_close)  # without a closed list a second call may follow


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_two_different_calls_are_accepted_up_to_max_calls(lm, name):
    fmt = FORMATS[name]
    tools = [WEATHER, SEARCH]
    assert accepts(lm, fmt, tools, calls_text(fmt, [PARIS, QUERY]))  # two tools
    assert accepts(lm, fmt, tools, calls_text(fmt, [PARIS, LONDON]))  # one tool, other arguments
    four = [PARIS, LONDON, QUERY, ("search", {"query": "json"})]
    assert accepts(lm, fmt, tools, calls_text(fmt, four))
    five = [*four, ("get_weather", {"city": "Rome", "days": 1})]
    assert not accepts(lm, fmt, tools, calls_text(fmt, five))  # max_calls=4
    assert not accepts(lm, fmt, tools, calls_text(fmt, [PARIS, QUERY]), parallel=False)
    assert not accepts(lm, fmt, tools, calls_text(fmt, [("get_weather", {"city": "Paris"})]))  # no days


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_a_repeated_call_ends_the_constraint(lm, name):
    fmt = FORMATS[name]
    c = _compile(lm, fmt, [WEATHER, SEARCH])
    two = _unclosed(fmt, [PARIS, QUERY])
    assert _feed(lm, c, two)
    assert not c.is_done()  # two different calls: a third may follow
    c = _compile(lm, fmt, [WEATHER, SEARCH])
    repeat = _unclosed(fmt, [PARIS, QUERY, PARIS])
    ids = lm.tokenizer.encode(repeat, add_special_tokens=False)
    ends = [i for i, t in enumerate(ids) if c.consume(t) and c.is_done()]
    # it ends once, right when the repeat is whole (not while its rest is still to come)
    assert ends == [len(ids) - 1], (ends, len(ids))


def test_pydantic_nested_models_as_tool_parameters(lm):
    person = {"name": "save_person", "parameters": Person.model_json_schema()}
    assert "$defs" in person["parameters"]
    ok = {"name": "Ada", "home": {"street": "1 Main St", "city": "Oslo"}, "work": None}
    assert accepts(lm, HERMES, [person], calls_text(HERMES, [("save_person", ok)]))
    Person.model_validate(ok)
    bad = {"name": "Ada", "home": {"city": "Oslo"}}  # Addr needs a street
    assert not accepts(lm, HERMES, [person], calls_text(HERMES, [("save_person", bad)]))
    # "#/$defs/Node" inside a recursive model resolves against the parameters, not the wrapper
    node = {"name": "save_tree", "parameters": Node.model_json_schema()}
    tree = {"value": 1, "children": [{"value": 2, "children": []}]}
    assert accepts(lm, MISTRAL, [node], calls_text(MISTRAL, [("save_tree", tree)]))
    wrapper_shaped = {"value": 1, "children": [{"name": "save_tree", "arguments": {"value": 2}}]}
    assert not accepts(lm, MISTRAL, [node], calls_text(MISTRAL, [("save_tree", wrapper_shaped)]))


def test_root_pointer_refs_resolve_against_the_parameters(lm):
    params = {
        "type": "object",
        "properties": {"label": {"type": "string"}, "next": {"$ref": "#"}, "same": {"$ref": "#/properties/label"}},
        "required": ["label"],
        "additionalProperties": False,
    }
    tool = {"name": "chain", "parameters": params}
    good = {"label": "a", "next": {"label": "b"}, "same": "c"}
    assert accepts(lm, HERMES, [tool], calls_text(HERMES, [("chain", good)]))
    assert not accepts(lm, HERMES, [tool], calls_text(HERMES, [("chain", {"label": "a", "same": 3})]))


def test_two_tools_with_a_defs_entry_of_the_same_name(lm):
    person = {"name": "save_person", "parameters": Person.model_json_schema()}
    parcel = {"name": "send_parcel", "parameters": _parcel_schema()}
    assert set(person["parameters"]["$defs"]) == set(parcel["parameters"]["$defs"]) == {"Addr"}
    tools = [person, parcel]
    p_ok = {"name": "Ada", "home": {"street": "1 Main St", "city": "Oslo"}}
    s_ok = {"weight": 1.5, "to": {"box": 12}}
    assert accepts(lm, HERMES, tools, calls_text(HERMES, [("save_person", p_ok), ("send_parcel", s_ok)]))
    # each tool's "Addr" is its own: a post box is no street address, and the other way round
    assert not accepts(lm, HERMES, tools, calls_text(HERMES, [("save_person", {"name": "A", "home": {"box": 1}})]))
    street = {"weight": 1.5, "to": {"street": "x", "city": "y"}}
    assert not accepts(lm, HERMES, tools, calls_text(HERMES, [("send_parcel", street)]))


def test_a_bad_tool_schema_is_reported_about_the_tool(lm):
    tools = [WEATHER, {"name": "broken", "parameters": {"type": "objectx"}}]
    with pytest.raises(ConstraintError) as err:
        _compile(lm, HERMES, tools)
    message = str(err.value)
    assert message.startswith("tool 'broken' parameters:") and "objectx" in message
    assert "%json" not in message and "get_weather" not in message and len(message) < 200
    with pytest.raises(ConstraintError, match="max_calls"):
        _compile(lm, HERMES, [WEATHER], max_calls=0)


LAZY_FORMATS = sorted(n for n, f in FORMATS.items() if f.lazy_trigger)


def test_the_lazy_formats():
    # llama3_json's calls are bare JSON: no trigger
    assert LAZY_FORMATS == ["glm", "glm_compact", "hermes", "mistral", "mistral_v11", "qwen3_coder"]
    assert HERMES.lazy_trigger == "<tool_call>" and MISTRAL.lazy_trigger == "[TOOL_CALLS]"


@pytest.mark.parametrize("name", LAZY_FORMATS)
def test_lazy_calls_follow_the_schemas_and_text_stays_free(lm, name):
    fmt = FORMATS[name]
    tools = [WEATHER, SEARCH]
    prose = "Here is a function:\ndef f(x):\n    return {'a': [x, \"<tool\"]}  # not a call\n"
    assert accepts(lm, fmt, tools, prose, lazy=True)
    assert accepts(lm, fmt, tools, "", lazy=True)  # the answer may end at once
    assert accepts(lm, fmt, tools, "Let me look that up. " + calls_text(fmt, [PARIS, QUERY]), lazy=True)
    assert accepts(lm, fmt, tools, calls_text(fmt, [PARIS]), lazy=True)
    bad_args = calls_text(fmt, [("get_weather", {"city": "Paris"})])  # no days
    assert not accepts(lm, fmt, tools, "Sure. " + bad_args, lazy=True)
    assert not accepts(lm, fmt, tools, "Sure. " + calls_text(fmt, [("get_time", {})]), lazy=True)
    # after the calls only the end may follow (or more calls)
    assert not accepts(lm, fmt, tools, calls_text(fmt, [PARIS]) + " and some text", lazy=True)
    # at most max_calls calls
    assert not accepts(lm, fmt, tools, calls_text(fmt, [PARIS, QUERY, LONDON]), lazy=True, max_calls=2)


@pytest.mark.parametrize("name", LAZY_FORMATS)
def test_a_repeated_call_ends_the_lazy_constraint(lm, name):
    fmt = FORMATS[name]
    c = _compile(lm, fmt, [WEATHER, SEARCH], lazy=True)
    repeat = "I will check. " + _unclosed(fmt, [PARIS, QUERY, PARIS])
    ids = lm.tokenizer.encode(repeat, add_special_tokens=False)
    ends = [i for i, t in enumerate(ids) if c.consume(t) and c.is_done()]
    assert ends == [len(ids) - 1], (ends, len(ids))


def test_a_lazy_spec_needs_its_trigger_and_names_a_bad_tool(lm):
    spec = HERMES.constraint([WEATHER], parallel=True, lazy=True)
    with pytest.raises(ConstraintError, match="trigger"):
        compile_constraint({**spec, "trigger": "<call>"}, lm.tokenizer, lm.vocab_size, lm.eos_token_ids)
    with pytest.raises(ConstraintError) as err:
        _compile(lm, HERMES, [WEATHER, {"name": "broken", "parameters": {"type": "objectx"}}], lazy=True)
    assert str(err.value).startswith("tool 'broken' parameters:")


def test_markup_that_is_a_special_token_is_written_as_that_token(lm):
    """A format whose markers are special tokens of the tokenizer (as Mistral's [TOOL_CALLS] and
    [ARGS] are in its own): the grammar allows those tokens, not the marker spelled out in text,
    forced and after free text (lazy)."""
    fmt = ToolFormat(name="special", start_markers=("<|im_start|>",), call_open="<|im_start|>",
                     args_marker="<|im_end|>")
    opened, args = 1, 2  # the bundled tokenizer's <|im_start|>, <|im_end|>
    assert lm.tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [opened, args]
    call = [opened, *lm.tokenizer.encode("search", add_special_tokens=False), args,
            *lm.tokenizer.encode('{"query": "csv"}', add_special_tokens=False)]
    for lazy, lead in ((False, []), (True, lm.tokenizer.encode("Let me look.", add_special_tokens=False))):
        c = _compile(lm, fmt, [WEATHER, SEARCH], lazy=lazy)
        for t in lead:
            assert t in _allowed(lm, c) and c.consume(t)
        if not lazy:
            assert _allowed(lm, c) == {opened}  # not "<", "|", ... as text
        for t in call:
            assert t in _allowed(lm, c) and c.consume(t)
        assert c.matcher.is_accepting()
        # after the marker the call follows the tools
        c = _compile(lm, fmt, [WEATHER, SEARCH], lazy=lazy)
        assert all(c.consume(t) for t in [*lead, opened])
        assert not _feed(lm, c, "get_time")


def test_a_forced_harmony_call_is_one_call_to_a_function(lm):
    """gpt-oss: the commentary header addressed to functions.NAME, then the arguments as JSON;
    one call (the format's <|call|> ends the output), and only the tools' schemas."""
    call = calls_text(HARMONY, [PARIS])
    assert call.startswith("<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{")
    assert call.endswith('{"city":"Paris","days":3}')  # compact, as gpt-oss writes JSON
    assert accepts(lm, HARMONY, [WEATHER, SEARCH], call, parallel=False)
    spaced = call.replace('{"city":"Paris","days":3}', '{"city": "Paris", "days": 3}')
    assert not accepts(lm, HARMONY, [WEATHER, SEARCH], spaced, parallel=False)
    assert not accepts(lm, HARMONY, [WEATHER, SEARCH], calls_text(HARMONY, [PARIS, QUERY]), parallel=False)
    assert not accepts(lm, HARMONY, [WEATHER, SEARCH], calls_text(HARMONY, [("get_weather", {"city": "Oslo"})]),
                       parallel=False)


def _accepts_spec(lm, spec: dict[str, Any], text: str, lead: Sequence[int] = ()) -> bool:
    """The tokens `lead`, then `text`, are a complete output of the spec's grammar: every token
    allowed, and then it may end."""
    c = compile_constraint(spec, lm.tokenizer, lm.vocab_size, lm.eos_token_ids)
    if not all(t in _allowed(lm, c) and c.consume(t) for t in lead) or not _feed(lm, c, text):
        return False
    return c.matcher.is_accepting() and bool(_allowed(lm, c) & set(lm.eos_token_ids))


THINK = {"open": "<think>", "close": "</think>"}
HARMONY_REASONING = {"open": "<|channel|>analysis<|message|>", "close": "<|end|><|start|>assistant",
                     "prefix": "<|channel|>final<|message|>"}


def test_reasoning_may_come_before_the_constrained_answer(lm):
    """A reasoning model's constrained answer (JSON, a forced call) comes after its reasoning:
    free text inside the markers, then the answer the grammar holds; the reasoning is optional
    unless the prompt opened it, and nothing but the answer may follow it."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    spec = {"type": "json_schema", "schema": schema, "strict": True, "reasoning": THINK}
    thought = "<think>The user wants {a}; maybe a = 1? </thinking> is not the end.</think>\n\n"
    assert _accepts_spec(lm, spec, thought + '{"a": 1}')
    assert _accepts_spec(lm, spec, '{"a": 1}')  # no reasoning
    assert not _accepts_spec(lm, spec, thought + '{"a": "x"}')
    assert not _accepts_spec(lm, spec, 'Sure: {"a": 1}')  # text that is not reasoning
    opened = {**spec, "reasoning": {**THINK, "opened": True}}
    assert _accepts_spec(lm, opened, 'so a = 1</think>{"a": 1}')
    assert not _accepts_spec(lm, opened, '{"a": 1}')  # the opened reasoning must close first
    # harmony: the analysis channel, then the answer in the final channel
    harmony = {**spec, "reasoning": HARMONY_REASONING}
    assert _accepts_spec(lm, harmony, '<|channel|>analysis<|message|>a = 1<|end|><|start|>assistant'
                                      '<|channel|>final<|message|>{"a": 1}')
    assert _accepts_spec(lm, harmony, '<|channel|>final<|message|>{"a": 1}')
    assert not _accepts_spec(lm, harmony, '{"a": 1}')
    # a regex answer, the same way (a '/' and a newline in the pattern kept as they are)
    regex = {"type": "regex", "pattern": "(yes|no)/[0-9]+\n", "reasoning": THINK}
    assert _accepts_spec(lm, regex, thought + "yes/12\n") and _accepts_spec(lm, regex, "no/3\n")
    assert not _accepts_spec(lm, regex, thought + "maybe/1\n")
    assert _accepts_spec(lm, {**regex, "reasoning": HARMONY_REASONING},
                         "<|channel|>analysis<|message|>hm<|end|><|start|>assistant<|channel|>final<|message|>no/3\n")
    with pytest.raises(ConstraintError, match="string 'pattern'"):
        compile_constraint({**regex, "pattern": 3}, lm.tokenizer, lm.vocab_size, lm.eos_token_ids)
    # a forced call after reasoning, its tool error still named
    calls = {**HERMES.constraint([WEATHER], parallel=False), "reasoning": THINK}
    assert _accepts_spec(lm, calls, "<think>Paris, 3 days.</think>\n" + calls_text(HERMES, [PARIS]))
    assert not _accepts_spec(lm, calls, "<think>Paris.</think>\n" + calls_text(HERMES, [QUERY]))
    with pytest.raises(ConstraintError) as err:
        compile_constraint({**HERMES.constraint([{"name": "broken", "parameters": {"type": "objectx"}}],
                                                parallel=False), "reasoning": THINK},
                           lm.tokenizer, lm.vocab_size, lm.eos_token_ids)
    assert str(err.value).startswith("tool 'broken' parameters:")
    with pytest.raises(ConstraintError) as err:
        compile_constraint({**spec, "schema": {"type": "objectx"}}, lm.tokenizer, lm.vocab_size, lm.eos_token_ids)
    assert str(err.value) == "Invalid type: objectx"  # as without reasoning: no grammar position


def test_harmony_strict_tools_in_auto_mode_answer_in_text_or_call(lm):
    """gpt-oss with strict tools and tool_choice auto: after its optional analysis, either a
    final-channel answer in free text or one call held to the tools' schemas."""
    spec = HARMONY.constraint([WEATHER, SEARCH], parallel=False, lazy=True)
    assert spec["or_text"] == "<|channel|>final<|message|>" and "lazy" not in spec
    spec = {**spec, "reasoning": {**HARMONY_REASONING, "prefix": ""}}
    analysis = "<|channel|>analysis<|message|>Weather, or just say hi?<|end|><|start|>assistant"
    final = "<|channel|>final<|message|>Hi! It is {sunny} <|channel|> today.\n"
    call = calls_text(HARMONY, [PARIS])
    for text in (analysis + final, final, analysis + call, call):
        assert _accepts_spec(lm, spec, text), text
    assert not _accepts_spec(lm, spec, analysis + calls_text(HARMONY, [("get_weather", {"city": "Oslo"})]))
    assert not _accepts_spec(lm, spec, analysis + "Hi!")  # an answer opens its channel
    assert not _accepts_spec(lm, spec, call + call)  # one call
    # the header's marker a special token (as <|channel|> is in gpt-oss's tokenizer): a text
    # answer cannot write it, so it cannot open a call unchecked
    fmt = dataclasses.replace(HARMONY, call_open=HARMONY.call_open.replace("<|channel|>", "<|im_start|>"),
                              text_answer=HARMONY.text_answer.replace("<|channel|>", "<|im_start|>"))
    c = compile_constraint(fmt.constraint([WEATHER], parallel=False, lazy=True),
                           lm.tokenizer, lm.vocab_size, lm.eos_token_ids)
    assert _allowed(lm, c) == {1} and c.consume(1)  # the bundled tokenizer's <|im_start|>
    assert _feed(lm, c, "final<|message|>Hi there.")
    assert 1 not in _allowed(lm, c) and set(lm.eos_token_ids) & _allowed(lm, c)
    with pytest.raises(ConstraintError, match="or_text"):
        compile_constraint({**HERMES.constraint([WEATHER], parallel=False, lazy=True), "or_text": "x"},
                           lm.tokenizer, lm.vocab_size, lm.eos_token_ids)


def test_a_custom_tools_regex_grammar_holds_its_whole_input(lm):
    """A Responses custom tool with a regex grammar: its one argument must match the whole
    regex (not a substring, as a JSON-schema pattern alone would), in auto mode too (strict)."""
    from server.responses_api import ResponsesRequest, tool_set

    custom = {"type": "custom", "name": "calc", "description": "Arithmetic.",
              "format": {"type": "grammar", "syntax": "regex", "definition": "(add|sub) [0-9]+"}}
    tools = tool_set(ResponsesRequest(input="x", tools=[custom])).functions
    assert tools[0]["strict"] and "(add|sub) [0-9]+" in tools[0]["description"]
    for lazy in (False, True):
        spec = HERMES.constraint(tools, parallel=False, lazy=lazy)
        assert _accepts_spec(lm, spec, calls_text(HERMES, [("calc", {"input": "add 12"})]))
        for bad in ("add 12 and 3", "so add 12", "mul 3", "add 12\n"):
            assert not _accepts_spec(lm, spec, calls_text(HERMES, [("calc", {"input": bad})])), bad
    lark = {**custom, "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "x"'}}
    assert not tool_set(ResponsesRequest(input="x", tools=[lark])).functions[0]["strict"]


def test_a_reasoning_close_that_is_a_special_token_ends_it_by_that_token(lm):
    spec = {"type": "json_object", "reasoning": {"open": "<think>", "close": "<|im_end|>"}}
    text = lm.tokenizer.encode("<think>hm, an object", add_special_tokens=False)
    assert _accepts_spec(lm, spec, '{"k": 2}', lead=[*text, 2])
    with pytest.raises(ConstraintError, match="reasoning"):
        compile_constraint({"type": "lark", "grammar": 'start: "a"', "reasoning": THINK},
                           lm.tokenizer, lm.vocab_size, lm.eos_token_ids)
