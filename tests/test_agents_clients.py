"""Requests shaped like Claude Code's (/v1/messages) and Codex CLI's (/v1/responses) first turns,
over real HTTP against the app and the fake engine: a long system prompt, ~20 tools, system
messages mid-conversation, namespace and hosted tools, no output limit. Each must be accepted and
answered with a well-formed stream: Anthropic's events in their order, with consistent block
indices; Responses events numbered in order, every item added before its deltas and done after
them, and a final response whose output is the items the stream finished.
"""

from __future__ import annotations

import json

import httpx
import pytest

from server.app import create_app
from server.config import ServerConfig
from tests.fake_engine import FakeEngine, ServerThread

MODEL = "tinycoder-16m"
LONG_SYSTEM = ("You are an interactive CLI tool that helps users with software engineering tasks. "
               "Use the instructions below and the tools available to you to assist the user. ") * 40


def _schema(i: int) -> dict:
    return {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object", "additionalProperties": False,
            "properties": {"path": {"type": "string", "description": f"path {i}"},
                           "limit": {"type": "integer", "minimum": 1}},
            "required": ["path"]}


CLAUDE_TOOLS = [{"name": "Bash", "description": "Run a shell command",
                 "input_schema": {"type": "object", "properties": {"command": {"type": "string"}},
                                  "required": ["command"]}},
                *({"name": f"Tool{i}", "description": f"Tool number {i}. " * 5, "input_schema": _schema(i)}
                  for i in range(19))]
CODEX_TOOLS = [{"type": "function", "name": "shell", "description": "Runs a shell command", "strict": False,
                "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}},
                                                                "workdir": {"type": "string"}},
                               "required": ["command"], "additionalProperties": False}},
               *({"type": "function", "name": f"tool_{i}", "description": f"tool {i}", "strict": False,
                  "parameters": _schema(i)} for i in range(16)),
               {"type": "namespace", "name": "mcp__docs__", "description": "Tools in the mcp__docs__ namespace.",
                "tools": [{"type": "function", "name": "search", "description": "Search the docs", "strict": False,
                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}},
                          {"type": "function", "name": "fetch", "description": "Fetch a page", "strict": False,
                           "parameters": {"type": "object", "properties": {"url": {"type": "string"}}}}]},
               {"type": "web_search", "external_web_access": False},
               {"type": "image_generation", "output_format": "png"}]


def scripted(fake: FakeEngine, text: str):
    ids = fake.tokenizer.encode(text, add_special_tokens=False) + [fake.eos_id]
    return lambda request: ids


@pytest.fixture(scope="module")
def fake():
    return FakeEngine(context_length=32768)


@pytest.fixture(scope="module")
def server(fake):
    with ServerThread(create_app(fake, ServerConfig())) as s:
        yield s


def _sse(response: httpx.Response) -> list[tuple[str, dict]]:
    """(event name, data) pairs of a stream."""
    out, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            data = json.loads(line[6:])
            assert name == data["type"]  # the event line names the data's type
            out.append((name, data))
    return out


def _check_anthropic_stream(events: list[tuple[str, dict]]) -> list[dict]:
    """Anthropic's order: message_start, ping, (start, delta*, stop)* with indices 0, 1, ...,
    message_delta, message_stop. Returns the blocks as started."""
    kinds = [k for k, _ in events if k != "ping"]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert events[1][0] == "ping"
    blocks, open_index = [], None
    for kind, data in events[1:-2]:
        if kind == "content_block_start":
            assert open_index is None and data["index"] == len(blocks)
            open_index = data["index"]
            blocks.append(data["content_block"])
        elif kind == "content_block_delta":
            assert data["index"] == open_index
        elif kind == "content_block_stop":
            assert data["index"] == open_index
            open_index = None
        else:
            assert kind == "ping", kind
    assert open_index is None
    return blocks


def test_a_claude_code_shaped_request_is_answered(fake, server):
    fake.reset(script=scripted(fake, 'I will look.\n<tool_call>\n{"name": "Bash", "arguments": {"command": "ls"}}\n'
                                     '</tool_call>'))
    reminder = "<system-reminder>As you answer, follow the project conventions.</system-reminder>"
    body = {
        "model": MODEL, "max_tokens": 32000, "temperature": 1, "stream": True,
        "metadata": {"user_id": "user_abc_account__session_123"},
        "system": [{"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude.",
                    "cache_control": {"type": "ephemeral"}},
                   {"type": "text", "text": LONG_SYSTEM, "cache_control": {"type": "ephemeral"}}],
        "tools": CLAUDE_TOOLS,
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": reminder},
                                         {"type": "text", "text": "What is in this directory?",
                                          "cache_control": {"type": "ephemeral"}}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Let me check."},
                                              {"type": "tool_use", "id": "toolu_01", "name": "Bash",
                                               "input": {"command": "pwd"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": "/work"}]},
            {"role": "system", "content": "The user switched to plan mode."},
            {"role": "user", "content": "Now list the files."},
        ],
    }
    headers = {"anthropic-version": "2023-06-01", "x-app": "cli", "user-agent": "claude-cli/2.0 (external, cli)",
               "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,"
                                 "fine-grained-tool-streaming-2025-05-14"}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        events = _sse(r)
    blocks = _check_anthropic_stream(events)
    assert [b["type"] for b in blocks] == ["text", "tool_use"] and blocks[1]["name"] == "Bash"
    args = "".join(d["delta"]["partial_json"] for k, d in events
                   if k == "content_block_delta" and d["delta"]["type"] == "input_json_delta")
    assert json.loads(args) == {"command": "ls"}
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] == "tool_use"
    n_prompt = len(fake.submits[-1].prompt_ids)
    for usage in (events[0][1]["message"]["usage"], delta["usage"]):
        assert usage["input_tokens"] + usage["cache_read_input_tokens"] == n_prompt
    # no output limit of its own: the request's 32000 is cut to the room the context leaves
    assert fake.submits[-1].params.max_tokens == fake.context_length - n_prompt
    prompt = fake.tokenizer.decode(fake.submits[-1].prompt_ids)
    assert prompt.index("/work") < prompt.index("The user switched to plan mode.") < prompt.index("Now list")
    assert all(f'"{t["name"]}"' in prompt for t in CLAUDE_TOOLS)


def test_a_codex_shaped_request_is_answered(fake, server):
    fake.reset(script=scripted(fake, 'Searching the docs.\n<tool_call>\n{"name": "mcp__docs__search", '
                                     '"arguments": {"q": "install"}}\n</tool_call>'))
    def msg(role, text, kind="input_text"):
        return {"type": "message", "role": role, "content": [{"type": kind, "text": text}]}
    body = {
        "model": MODEL, "instructions": LONG_SYSTEM, "stream": True, "store": False,
        "tools": CODEX_TOOLS, "tool_choice": "auto", "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"}, "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "0199-session", "text": {"verbosity": "medium"},
        "input": [
            msg("developer", "<permissions instructions>Sandbox: workspace-write.</permissions instructions>"),
            msg("user", "<environment_context><cwd>/work</cwd></environment_context>"),
            msg("user", "How do I install this?"),
            {"type": "function_call", "name": "shell", "arguments": '{"command": ["ls"]}', "call_id": "call_1"},
            {"type": "function_call_output", "call_id": "call_1", "output": "README.md"},
            msg("developer", "<collaboration_mode>Plan first.</collaboration_mode>"),
            msg("user", "Check the docs."),
        ],
    }
    headers = {"originator": "codex_cli_rs", "user-agent": "codex_cli_rs/0.50.0", "session_id": "0199-session"}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        events = _sse(r)
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    kinds = [k for k, _ in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    items, open_item = [], None
    for kind, data in events[2:-1]:
        if kind == "response.output_item.added":
            assert open_item is None and data["output_index"] == len(items)
            open_item = data["item"]
            if open_item["type"] == "message":
                assert open_item["content"] == []
        elif kind == "response.output_item.done":
            assert open_item is not None and data["output_index"] == len(items)
            items.append(data["item"])
            open_item = None
        else:
            assert open_item is not None and data["output_index"] == len(items), kind
            assert data.get("item_id", open_item["id"]) == open_item["id"]
    final = events[-1][1]["response"]
    assert final["status"] == "completed" and final["output"] == items
    assert [i["type"] for i in items] == ["message", "function_call"]
    call = items[1]
    assert (call["name"], call["namespace"], json.loads(call["arguments"])) == ("search", "mcp__docs__",
                                                                                {"q": "install"})
    assert final["usage"]["input_tokens"] == len(fake.submits[-1].prompt_ids)
    prompt = fake.tokenizer.decode(fake.submits[-1].prompt_ids)
    assert prompt.index("README.md") < prompt.index("Plan first.") < prompt.index("Check the docs.")
    assert '"mcp__docs__fetch"' in prompt and "web_search" not in prompt
