"""The real engine on the bundled tinycoder-16m behind the real app, with the official SDKs.

A 16M-parameter code model has never seen a tool call or a JSON schema; only constrained
decoding makes these pass every time: forced tool calls (required and named) and strict
json_schema answers parse and validate over 20 seeds each at temperature 1; streamed tool-call
deltas reassemble into the non-streamed call for the same seed; a schema the grammar engine
cannot compile is a 400 with the reason.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import openai
import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from server.app import create_app  # noqa: E402
from server.config import ServerConfig  # noqa: E402
from tests.fake_engine import ServerThread  # noqa: E402

WEATHER_ARGS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "units": {"enum": ["C", "F"]},
    },
    "required": ["city", "days", "units"],
    "additionalProperties": False,
}
SEARCH_ARGS = {
    "type": "object",
    "properties": {"query": {"type": "string", "maxLength": 20}, "limit": {"type": "integer", "minimum": 1, "maximum": 50}},
    "required": ["query"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast", "parameters": WEATHER_ARGS}},
    {"type": "function", "function": {"name": "search_code", "description": "Search the code base", "parameters": SEARCH_ARGS}},
]
SCHEMAS = {"get_weather": WEATHER_ARGS, "search_code": SEARCH_ARGS}
ANSWER = {
    "type": "object",
    "properties": {
        "language": {"enum": ["python", "rust", "go"]},
        "function_name": {"type": "string", "pattern": "^[a-z_][a-z0-9_]{0,15}$"},
        "line_count": {"type": "integer", "minimum": 1, "maximum": 500},
        "pure": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["language", "function_name", "line_count", "pure", "tags"],
    "additionalProperties": False,
}
MSGS = [{"role": "user", "content": "What's the weather in Paris for 3 days?"}]
SEEDS = range(20)


@pytest.fixture(scope="module")
def server():
    from mlxd.runtime import build_client

    client = build_client(model=None)
    client.start()
    try:
        with ServerThread(create_app(client, ServerConfig())) as s:
            yield s
    finally:
        client.stop()


def _validate_calls(message, allowed):
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_forced_tool_calls_validate_over_20_seeds(server):
    """Seeds 0-9: tool_choice "required"; seeds 10-19: a named function. All 20 in one batch."""
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)
    named = {"type": "function", "function": {"name": "search_code"}}

    async def run():
        return await asyncio.gather(*[
            client.chat.completions.create(
                model="tinycoder-16m", messages=MSGS, tools=TOOLS, temperature=1.0, seed=s, max_tokens=300,
                tool_choice="required" if s < 10 else named, parallel_tool_calls=s == 0)
            for s in SEEDS])

    results = asyncio.run(run())
    required, forced = results[:10], results[10:]
    for r in required:
        assert r.choices[0].finish_reason == "tool_calls"
        _validate_calls(r.choices[0].message, {"get_weather", "search_code"})
    # seed 0 allowed parallel calls (at most 4 under the forcing grammar), the rest one call each
    assert 1 <= len(required[0].choices[0].message.tool_calls) <= 4
    assert all(len(r.choices[0].message.tool_calls) == 1 for r in required[1:])
    for r in forced:
        assert r.choices[0].finish_reason == "tool_calls"
        _validate_calls(r.choices[0].message, {"search_code"})
        assert len(r.choices[0].message.tool_calls) == 1
    distinct = {r.choices[0].message.tool_calls[0].function.arguments for r in results}
    assert len(distinct) > 10  # sampled at temperature 1, not one canned answer


def test_a_function_without_parameters_is_called_with_none(server):
    """OpenAI: omitting `parameters` defines a function with an empty parameter list, so a
    forced call of it carries `{}` (a model left free writes keys of its own there)."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)
    now = {"type": "function", "function": {"name": "now", "description": "The current time"}}
    for seed in range(4):
        r = client.chat.completions.create(model="tinycoder-16m", messages=MSGS, tools=[now], temperature=1.0,
                                           seed=seed, max_tokens=60, tool_choice="required")
        calls = r.choices[0].message.tool_calls
        assert calls and all(c.function.name == "now" and json.loads(c.function.arguments) == {} for c in calls)


def test_strict_json_schema_validates_over_20_seeds(server):
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
    msgs = [{"role": "user", "content": "Describe the function you would write to parse a CSV file."}]

    async def run():
        return await asyncio.gather(*[
            client.chat.completions.create(model="tinycoder-16m", messages=msgs, response_format=fmt,
                                           temperature=1.0, seed=s, max_tokens=200) for s in SEEDS])

    results = asyncio.run(run())
    for r in results:
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), ANSWER)
    assert len({r.choices[0].message.content for r in results}) > 10


def test_streamed_tool_call_reassembles_to_the_non_streamed_one(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    kw = dict(model="tinycoder-16m", messages=MSGS, tools=TOOLS, tool_choice="required", temperature=1.0,
              seed=7, max_tokens=300, parallel_tool_calls=False)
    with ThreadPoolExecutor(1) as pool:  # both at once: a seeded row does not depend on its batch
        whole_future = pool.submit(lambda: client.chat.completions.create(**kw).choices[0].message.tool_calls)
        calls, finish = _stream_calls(client, kw)
        whole = whole_future.result()
    assert finish == "tool_calls"
    assert [tuple(calls[i]) for i in sorted(calls)] == [(c.function.name, c.function.arguments) for c in whole]


def _stream_calls(client, kw):
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                if tc.index not in calls:
                    calls[tc.index] = [tc.function.name, ""]
                calls[tc.index][1] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    return calls, finish


def test_anthropic_forced_tool_use_validates(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=120)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    msg = client.messages.create(model="tinycoder-16m", max_tokens=300, tools=tools,
                                 extra_body={"temperature": 1.0},
                                 tool_choice={"type": "tool", "name": "get_weather"}, messages=MSGS)
    assert msg.stop_reason == "tool_use"
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert [u.name for u in uses] == ["get_weather"]
    jsonschema.validate(uses[0].input, WEATHER_ARGS)


@pytest.mark.parametrize("schema, reason", [
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}}, "unclosed group"),
    ({"type": "objekt"}, "objekt"),
    ({"$ref": "#/$defs/missing"}, "missing"),
    ({"type": "string", "format": "made-up-format"}, "made-up-format"),
])
def test_uncompilable_schema_is_a_400_with_the_reason(server, schema, reason):
    body = {"messages": MSGS, "max_tokens": 5, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert reason in r.json()["error"]["message"]
    # the same through Responses' text.format, and the server keeps serving
    r = httpx.post(server.url + "/v1/responses", timeout=60, json={
        "input": "x", "max_output_tokens": 5,
        "text": {"format": {"type": "json_schema", "name": "x", "schema": schema, "strict": True}}})
    assert r.status_code == 400 and reason in r.json()["error"]["message"]
    ok = httpx.post(server.url + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 3}, timeout=60)
    assert ok.status_code == 200
