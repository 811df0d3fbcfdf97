"""Constraints over HTTP, on the real engine and the bundled tinycoder-16m behind the real app.

- a schema or pattern the grammar engine cannot run (a required property that recurses forever,
  a regex that expands to a million states) is a 400 with a short reason, on chat completions
  (streamed or not) and /v1/responses, and the server keeps serving;
- tool parameters with root-level $defs/$ref (pydantic's nested models) work with tool_choice
  required, a named function, and Anthropic's tool_choice "any";
- greedy, tool_choice "required" with parallel calls on (the default) gives one call, streamed
  and whole, where the model would otherwise repeat it into every call slot.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import openai
import pytest
from pydantic import BaseModel

pytest.importorskip("llguidance")

MODEL = "tinycoder-16m"
MSGS = [{"role": "user", "content": "What's the weather in Paris for 3 days?"}]
# no finite JSON value matches: "next" is required and is the same object again
ENDLESS = {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}
HUGE_REGEX = "(x{1000}){1000}"
DUMP_MARKERS = ("<state>", "Parser", "grammars", "lexer_cost", "%json", "x-guidance", "Tokens:")


class Addr(BaseModel):
    street: str
    city: str


class Person(BaseModel):
    name: str
    home: Addr
    work: Addr | None = None


class PostBox(BaseModel):
    box: int


class Parcel(BaseModel):
    weight: float
    to: PostBox


def _parcel_schema() -> dict:
    """Parcel's schema with its nested model named "Addr": the same $defs name as Person's."""
    return json.loads(json.dumps(Parcel.model_json_schema()).replace("PostBox", "Addr"))


PERSON_TOOL = {"type": "function", "function": {
    "name": "save_person", "description": "Save a person", "parameters": Person.model_json_schema()}}
PARCEL_TOOL = {"type": "function", "function": {
    "name": "send_parcel", "description": "Send a parcel", "parameters": _parcel_schema()}}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast", "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 16}, "days": {"type": "integer"}},
        "required": ["city", "days"], "additionalProperties": False}}}
SEARCH_TOOL = {"type": "function", "function": {
    "name": "search_code", "description": "Search the code base", "parameters": {
        "type": "object", "properties": {"query": {"type": "string", "maxLength": 20}},
        "required": ["query"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def url(real_server) -> str:
    return real_server.url


def _chat_rf(schema_or_pattern, stream: bool) -> dict:
    rf: dict[str, Any]
    if isinstance(schema_or_pattern, str):
        rf = {"type": "regex", "pattern": schema_or_pattern}
    else:
        rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema_or_pattern, "strict": True}}
    return {"model": MODEL, "messages": MSGS, "max_tokens": 50, "stream": stream, "response_format": rf}


def _assert_short_400(r: httpx.Response, words: str) -> None:
    assert r.status_code == 400, r.text[:500]
    assert r.headers["content-type"].startswith("application/json")  # before any stream began
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_constraint"
    message = err["message"]
    assert words in message, message
    assert len(message) <= 400 and not any(m in message for m in DUMP_MARKERS), message


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("bad, words", [(ENDLESS, "refers back to its own object"),
                                        (HUGE_REGEX, "regular expression")])
def test_what_the_grammar_engine_cannot_run_is_a_short_400_on_chat(url, bad, words, stream):
    r = httpx.post(url + "/v1/chat/completions", json=_chat_rf(bad, stream), timeout=120)
    _assert_short_400(r, words)
    ok = httpx.post(url + "/v1/chat/completions", timeout=120,
                    json={"model": MODEL, "messages": MSGS, "max_tokens": 3})
    assert ok.status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_endless_schema_is_a_short_400_on_responses(url, stream):
    body = {"model": MODEL, "input": "x", "max_output_tokens": 50, "stream": stream,
            "text": {"format": {"type": "json_schema", "name": "x", "schema": ENDLESS}}}
    _assert_short_400(httpx.post(url + "/v1/responses", json=body, timeout=120), "refers back")


def _oai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "save_person"}}])
def test_pydantic_defs_tool_is_constrained(url, choice):
    r = _oai(url).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Save Ada, who lives at 1 Main St, Oslo."}],
        tools=[PERSON_TOOL, WEATHER_TOOL], tool_choice=choice, temperature=1.0, seed=3, max_tokens=300)
    assert r.choices[0].finish_reason == "tool_calls"
    calls = r.choices[0].message.tool_calls
    assert calls and (choice == "required" or {c.function.name for c in calls} == {"save_person"})
    for c in calls:
        if c.function.name == "save_person":
            Person.model_validate_json(c.function.arguments)


def test_two_tools_with_the_same_defs_name(url):
    for seed in range(3):
        r = _oai(url).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Send a parcel to box 12."}],
            tools=[PERSON_TOOL, PARCEL_TOOL], tool_choice="required", temperature=1.0, seed=seed,
            max_tokens=300)
        models = {"save_person": Person, "send_parcel": Parcel}
        for c in r.choices[0].message.tool_calls:
            # each tool's "Addr" is its own: a Parcel's is a post box, a Person's a street address
            models[c.function.name].model_validate_json(c.function.arguments)


def test_anthropic_any_with_pydantic_defs(url):
    client = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=300)
    fn = PERSON_TOOL["function"]
    msg = client.messages.create(
        model=MODEL, max_tokens=300, messages=[{"role": "user", "content": "Save Ada from Oslo."}],
        tools=[{"name": fn["name"], "description": fn["description"], "input_schema": fn["parameters"]}],
        tool_choice={"type": "any"}, extra_body={"temperature": 0.0})  # greedy: Anthropic's
    # API has no seed, and an unseeded sample can run past max_tokens inside a long string
    assert msg.stop_reason == "tool_use"
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert uses and {u.name for u in uses} == {"save_person"}
    for u in uses:
        Person.model_validate(u.input)


def test_required_greedy_is_one_call_streamed_and_whole(url):
    """The bundled model copies its first call into every slot the grammar allows: the
    constrained output ends at the first repeat, which is dropped."""
    kw = dict(model=MODEL, messages=MSGS, tools=[WEATHER_TOOL, SEARCH_TOOL], tool_choice="required",
              temperature=0.0, max_tokens=400)
    client = _oai(url)
    whole = client.chat.completions.create(**kw)
    assert whole.choices[0].finish_reason == "tool_calls"
    calls = whole.choices[0].message.tool_calls
    assert len(calls) == 1, [(c.function.name, c.function.arguments) for c in calls]
    assert whole.usage.completion_tokens < 120  # it stopped after the repeat, not after 4 calls
    indexes, args, finish = set(), "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            for tc in choice.delta.tool_calls or []:
                indexes.add(tc.index)
                args += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    assert indexes == {0} and finish == "tool_calls"
    assert args == calls[0].function.arguments
