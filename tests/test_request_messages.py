"""Chat messages need what OpenAI requires of them: `content` (an assistant message may carry
tool calls instead), and a tool message's `tool_call_id`; anything less is a 400 naming the
field, before the engine sees the request."""

from __future__ import annotations

import httpx
import pytest

MODEL = "tinycoder-16m"
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
HI = {"role": "user", "content": "hi"}


@pytest.fixture(autouse=True)
def _fresh(fake):
    fake.reset(script=lambda request: [fake.eos_id])


def _chat(url: str, messages: list[dict], **extra: object) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "max_tokens": 4, **extra}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=10)


@pytest.mark.parametrize(
    "messages, param",
    [
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": None}], "messages[0].content"),
        ([{"role": "system"}, HI], "messages[0].content"),
        ([{"role": "developer", "content": None}, HI], "messages[0].content"),
        ([HI, {"role": "assistant"}, HI], "messages[1].content"),
        ([HI, {"role": "assistant", "content": None, "tool_calls": [CALL]},
          {"role": "tool", "tool_call_id": "call_1"}], "messages[2].content"),
        ([HI, {"role": "assistant", "content": None, "tool_calls": [CALL]},
          {"role": "tool", "content": "sunny"}], "messages[2].tool_call_id"),
    ],
)
@pytest.mark.parametrize("tools", [None, TOOLS])  # the plain path and the agent path
def test_missing_required_fields_are_400(fake, server, messages, param, tools):
    extra = {"tools": tools} if tools else {}
    r = _chat(server.url, messages, **extra)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == "missing_required_parameter"
    assert err["message"] == f"Missing required parameter: '{param}'."
    assert not fake.submits


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": ""}],
        [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        [HI, {"role": "assistant", "content": None, "tool_calls": [CALL]},
         {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
        [HI, {"role": "assistant", "tool_calls": [CALL]},
         {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "sunny"}]}],
        [HI, {"role": "assistant", "function_call": {"name": "get_weather", "arguments": "{}"}}, HI],
    ],
)
def test_valid_messages_are_answered(fake, server, messages):
    r = _chat(server.url, messages, tools=TOOLS)
    assert r.status_code == 200, r.text
    assert len(fake.submits) == 1


def test_tokenize_checks_messages_too(fake, server):
    r = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content"
    r = httpx.post(server.url + "/tokenize", json={"messages": [HI]})
    assert r.status_code == 200 and r.json()["count"] > 0
