"""OpenAI Responses as Codex CLI uses it, over real HTTP against the fake engine: namespace tools
(unpacked into their functions, called back with name + namespace), hosted tools the server
cannot run (left out, logged once per type), and the stream's item shapes: a message's
output_item.added carries no content, and an item cut by the output limit is "incomplete" in the
stream and in the final response alike.
"""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from server import responses_api
from server.app import create_app
from server.config import ServerConfig
from tests.fake_engine import FakeEngine, ServerThread

MODEL = "tinycoder-16m"
OBJ = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
SHELL = {"type": "function", "name": "shell", "description": "Run a command", "strict": False,
         "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}}}}}
NAMESPACE = {"type": "namespace", "name": "mcp__weather__", "description": "Tools in the mcp__weather__ namespace.",
             "tools": [{"type": "function", "name": "get_forecast", "description": "Forecast", "strict": False,
                        "parameters": OBJ},
                       {"type": "function", "name": "get_alerts", "parameters": OBJ}]}
HOSTED = [{"type": "web_search", "external_web_access": False},
          {"type": "image_generation", "output_format": "png"}]
CALL = '<tool_call>\n{"name": "mcp__weather__get_forecast", "arguments": {"city": "Bern"}}\n</tool_call>'


def scripted(fake: FakeEngine, text: str):
    ids = fake.tokenizer.encode(text, add_special_tokens=False) + [fake.eos_id]
    return lambda request: ids


@pytest.fixture(scope="module")
def fake():
    return FakeEngine(context_length=4096)


@pytest.fixture(scope="module")
def server(fake):
    with ServerThread(create_app(fake, ServerConfig())) as s:
        yield s


@pytest.fixture(autouse=True)
def _fresh(fake):
    fake.reset()


def post(server, **body):
    return httpx.post(server.url + "/v1/responses", json={"model": MODEL, **body}, timeout=30)


def events(server, **body) -> list[dict]:
    with httpx.stream("POST", server.url + "/v1/responses", json={"model": MODEL, "stream": True, **body},
                      timeout=30) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]


def test_namespace_tools_are_unpacked_and_called_back_by_name_and_namespace(fake, server):
    tools = [SHELL, NAMESPACE, *HOSTED]
    fake.reset(script=scripted(fake, CALL))
    r = post(server, input="weather in Bern?", tools=tools)
    assert r.status_code == 200, r.text
    call = r.json()["output"][-1]
    assert call["type"] == "function_call" and call["status"] == "completed"
    assert (call["name"], call["namespace"], call["arguments"]) == ("get_forecast", "mcp__weather__",
                                                                    '{"city": "Bern"}')
    prompt = fake.tokenizer.decode(fake.submits[-1].prompt_ids)
    assert '"mcp__weather__get_forecast"' in prompt and '"mcp__weather__get_alerts"' in prompt
    assert '"shell"' in prompt and "web_search" not in prompt and "image_generation" not in prompt
    assert r.json()["tools"] == tools  # echoed as sent

    fake.reset(script=scripted(fake, CALL))
    evs = events(server, input="weather in Bern?", tools=tools)
    added = [e["item"] for e in evs if e["type"] == "response.output_item.added"]
    done = [e["item"] for e in evs if e["type"] == "response.output_item.done"]
    assert [(i["name"], i["namespace"]) for i in added + done] == [("get_forecast", "mcp__weather__")] * 2
    assert evs[-1]["type"] == "response.completed" and evs[-1]["response"]["output"] == done


def test_a_namespaced_call_goes_back_into_the_prompt_and_can_be_forced(fake, server):
    fake.reset(script=scripted(fake, "It is sunny."))
    r = post(server, tools=[NAMESPACE], input=[
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_forecast", "namespace": "mcp__weather__",
         "arguments": '{"city": "Bern"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}])
    assert r.status_code == 200, r.text
    prompt = fake.tokenizer.decode(fake.submits[-1].prompt_ids)
    assert '{"name": "mcp__weather__get_forecast", "arguments": {"city": "Bern"}}' in prompt
    fake.reset(script=scripted(fake, CALL))
    choice = {"type": "function", "namespace": "mcp__weather__", "name": "get_forecast"}
    r = post(server, tools=[NAMESPACE], input="x", tool_choice=choice)
    assert r.status_code == 200, r.text
    spec = fake.submits[-1].params.constraint
    assert [t["name"] for t in spec["tools"]] == ["mcp__weather__get_forecast"]


PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch.",
         "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch" /(.|\\n)*/'}}
PATCH_TEXT = "*** Begin Patch\n*** Add File: a.txt\n+hi \"there\"\n*** End Patch"


def test_custom_tools_are_called_with_free_text_streamed_and_whole(fake, server):
    """A custom tool (Codex's apply_patch) is offered as a function of one string argument and
    comes back as a custom_tool_call with the raw input; its input items go back into the prompt
    the same way, and tool_choice can name it."""
    call = ('<tool_call>\n' + json.dumps({"name": "apply_patch", "arguments": {"input": PATCH_TEXT}})
            + '\n</tool_call>')
    fake.reset(script=scripted(fake, call))
    r = post(server, input="add a.txt", tools=[PATCH, SHELL])
    assert r.status_code == 200, r.text
    item = r.json()["output"][-1]
    assert (item["type"], item["name"], item["input"], item["status"]) == (
        "custom_tool_call", "apply_patch", PATCH_TEXT, "completed")
    assert item["id"].startswith("ctc_") and item["call_id"]
    prompt = fake.tokenizer.decode(fake.submits[-1].prompt_ids)
    assert '"apply_patch"' in prompt and '"input"' in prompt and "*** Begin Patch" in prompt  # its grammar

    fake.reset(script=scripted(fake, call), tokens_per_event=1)
    evs = events(server, input="add a.txt", tools=[PATCH, SHELL])
    kinds = [e["type"] for e in evs]
    assert "response.function_call_arguments.delta" not in kinds
    deltas = "".join(e["delta"] for e in evs if e["type"] == "response.custom_tool_call_input.delta")
    done = next(e for e in evs if e["type"] == "response.custom_tool_call_input.done")
    assert deltas == done["input"] == PATCH_TEXT
    assert evs[-1]["response"]["output"][-1] == {**item, "id": evs[-1]["response"]["output"][-1]["id"],
                                                 "call_id": evs[-1]["response"]["output"][-1]["call_id"]}

    fake.reset(script=scripted(fake, "Done."))
    r = post(server, tools=[PATCH], input=[
        {"type": "message", "role": "user", "content": "add a.txt"},
        {"type": "custom_tool_call", "call_id": "call_7", "name": "apply_patch", "input": PATCH_TEXT},
        {"type": "custom_tool_call_output", "call_id": "call_7", "output": "Success."}])
    assert r.status_code == 200, r.text
    prompt = fake.tokenizer.decode(fake.submits[-1].prompt_ids)
    assert json.dumps({"name": "apply_patch", "arguments": {"input": PATCH_TEXT}}) in prompt
    assert "Success." in prompt
    fake.reset(script=scripted(fake, call))
    r = post(server, tools=[PATCH, SHELL], input="x", tool_choice={"type": "custom", "name": "apply_patch"})
    assert r.status_code == 200, r.text
    assert [t["name"] for t in fake.submits[-1].params.constraint["tools"]] == ["apply_patch"]


def test_reasoning_items_reach_the_template_with_the_call_after_them(fake, server):
    """Codex sends the reasoning items mlxd gave out back with the calls: their text reaches the
    template as the next assistant message's reasoning_content."""
    fake.reset(script=scripted(fake, "ok"))
    fake.model.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.reasoning_content %}<think>"
        "{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}{% for c in m.tool_calls or [] %}"
        "<tool_call>{{ c.function.name }}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}{# tools #}"
        "<|im_start|>assistant\n")
    try:
        r = post(server, tools=[SHELL], input=[
            {"type": "message", "role": "user", "content": "list files"},
            {"type": "reasoning", "id": "rs_1", "summary": [],
             "content": [{"type": "reasoning_text", "text": "Use ls."}]},
            {"type": "function_call", "call_id": "call_1", "name": "shell", "arguments": '{"command": ["ls"]}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "a.txt"}])
    finally:
        fake.model.chat_template = None
    assert r.status_code == 200, r.text
    prompt = fake.tokenizer.decode(fake.submits[-1].prompt_ids)
    assert "<|im_start|>assistant\n<think>Use ls.</think><tool_call>shell</tool_call>" in prompt


def test_hosted_tools_are_logged_once_per_type(fake, server, caplog):
    responses_api._NOT_RUN_LOGGED.clear()
    with caplog.at_level(logging.WARNING, logger="mlxd.server"):
        for _ in range(3):
            assert post(server, input="x", tools=[*HOSTED, {"type": "web_search"}]).status_code == 200
    lines = [r.getMessage() for r in caplog.records if "not run by this server" in r.getMessage()]
    assert len(lines) == 2 and any("'web_search'" in m for m in lines) and any("'image_generation'" in m for m in lines)


@pytest.mark.parametrize("tools, fragment", [
    (["x"], "tools[0]"),
    ([{"type": "namespace", "tools": []}], "tools[0].name"),
    ([{"type": "namespace", "name": "ns", "tools": "x"}], "tools[0].tools"),
    ([SHELL, {"type": "namespace", "name": "ns", "tools": [{"type": "function", "description": "no name"}]}],
     "tools[1].tools[0].name"),
    ([{"type": "namespace", "name": "ns__", "tools": [{"type": "function", "name": "f", "parameters": 5}]}],
     "tools[0].tools[0].parameters"),
    ([{"type": "function", "name": "ns__f"}, {"type": "namespace", "name": "ns__", "tools": [
        {"type": "function", "name": "f"}]}], "unique"),
])
def test_bad_tools_are_400(fake, server, tools, fragment):
    r = post(server, input="x", tools=tools)
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"]
    assert not fake.submits


def test_message_items_added_empty_and_cut_ones_incomplete(fake, server):
    text = "one two three four five six seven"
    for limit, status in ((3, "incomplete"), (100, "completed")):
        fake.reset(script=scripted(fake, text))
        evs = events(server, input="count", max_output_tokens=limit)
        added = [e for e in evs if e["type"] == "response.output_item.added"]
        assert [e["item"]["content"] for e in added] == [[]] and added[0]["item"]["type"] == "message"
        kinds = [e["type"] for e in evs]
        assert kinds.index("response.output_item.added") + 1 == kinds.index("response.content_part.added")
        done = [e["item"] for e in evs if e["type"] == "response.output_item.done"]
        final = evs[-1]["response"]
        assert [i["status"] for i in done] == [i["status"] for i in final["output"]] == [status]
        assert final["status"] == ("incomplete" if limit == 3 else "completed")
        fake.reset(script=scripted(fake, text))
        whole = post(server, input="count", max_output_tokens=limit).json()
        assert [i["status"] for i in whole["output"]] == [status]
        assert whole["output"][0]["content"] == final["output"][0]["content"]


def test_a_call_cut_by_the_limit_is_incomplete_streamed_and_whole(fake, server):
    n = len(fake.tokenizer.encode(CALL, add_special_tokens=False))
    statuses = set()
    for limit in range(18, n + 2):
        fake.reset(script=scripted(fake, CALL))
        whole = post(server, input="x", tools=[NAMESPACE], max_output_tokens=limit).json()
        fake.reset(script=scripted(fake, CALL))
        evs = events(server, input="x", tools=[NAMESPACE], max_output_tokens=limit)
        done = [e["item"] for e in evs if e["type"] == "response.output_item.done"]
        final = evs[-1]["response"]["output"]
        strip = [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in whole["output"]]
        assert [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in final] == strip, limit
        assert [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in done] == strip, limit
        statuses |= {(whole["status"], i["type"], i["status"]) for i in whole["output"]}
    assert ("incomplete", "function_call", "incomplete") in statuses
    assert ("completed", "function_call", "completed") in statuses


def test_developer_messages_mid_conversation_stay_and_carry_over(fake, server):
    fake.reset(script=scripted(fake, "Noted."))
    r1 = post(server, instructions="You are a coding agent.", input=[
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hello"}]},
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Sandbox: read-only."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list files"}]}])
    assert r1.status_code == 200, r1.text
    prompt = fake.tokenizer.decode(fake.submits[-1].prompt_ids)
    order = [prompt.index(t) for t in ("You are a coding agent.", "hello", "Sandbox: read-only.", "list files")]
    assert order == sorted(order)
    fake.reset(script=scripted(fake, "Done."))
    r2 = post(server, previous_response_id=r1.json()["id"], input="and now?")
    assert r2.status_code == 200, r2.text
    prompt = fake.tokenizer.decode(fake.submits[-1].prompt_ids)
    assert "You are a coding agent." not in prompt  # instructions do not carry over
    assert prompt.index("Sandbox: read-only.") < prompt.index("list files") < prompt.index("and now?")


def test_items_keep_the_model_order_and_their_own_ids(fake, server):
    text = "Checking.\n" + CALL + "\nDone."
    fake.reset(script=scripted(fake, text))
    whole = post(server, input="x", tools=[NAMESPACE]).json()["output"]
    fake.reset(script=scripted(fake, text))
    done = [e["item"] for e in events(server, input="x", tools=[NAMESPACE])
            if e["type"] == "response.output_item.done"]
    for items in (whole, done):
        assert [i["type"] for i in items] == ["message", "function_call", "message"]
        assert [i["content"][0]["text"] for i in items if i["type"] == "message"] == ["Checking.", "Done."]
        assert len({i["id"] for i in items}) == 3


def test_truncation_auto_drops_the_oldest_turns_that_keep_the_prompt_over_the_context(fake, server):
    """`truncation: auto`: a conversation longer than the context loses its oldest turns (a call
    with its output among them), then the last turn's oldest calls with their outputs, as few
    as make it fit with room for max_output_tokens; the instructions and the last user message
    stay. `disabled` (the default) is the context-length 400."""
    def said(text: str) -> list[dict]:
        return [{"type": "message", "role": "user", "content": text}]

    items = [*said("ALPHA " + "one two three four " * 500),
             {"type": "function_call", "call_id": "call_1", "name": "shell", "arguments": '{"cmd": "ls"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "BRAVO " + "x y " * 400},
             {"type": "message", "role": "assistant", "content": "Listed."},
             *said("CHARLIE " + "five six seven " * 300),
             {"type": "message", "role": "assistant", "content": "Noted."},
             *said("DELTA: what now?")]
    body = dict(input=items, tools=[SHELL], instructions="ECHO rules", max_output_tokens=200)
    r = post(server, **body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    fake.reset(script=scripted(fake, "ok"))
    r = post(server, **body, truncation="auto")
    assert r.status_code == 200, r.text
    assert r.json()["truncation"] == "auto"
    prompt = fake.tokenizer.decode(fake.submits[-1].prompt_ids)
    assert "ECHO rules" in prompt and "CHARLIE" in prompt and "DELTA" in prompt
    assert "ALPHA" not in prompt and "BRAVO" not in prompt and "call_1" not in prompt
    assert len(fake.submits[-1].prompt_ids) + 200 <= fake.context_length
    # one user turn, an agent's long tool loop: the oldest calls go with their outputs, the task stays
    loop = said("TASK: fix the build")
    for word in ("FOXTROT", "GOLF", "HOTEL"):
        loop += [{"type": "function_call", "call_id": f"call_{word}", "name": "shell", "arguments": "{}"},
                 {"type": "function_call_output", "call_id": f"call_{word}", "output": word + " ab " * 700}]
    fake.reset(script=scripted(fake, "ok"))
    r = post(server, input=loop, tools=[SHELL], max_output_tokens=200, truncation="auto")
    assert r.status_code == 200, r.text
    prompt = fake.tokenizer.decode(fake.submits[-1].prompt_ids)
    assert "TASK" in prompt and "HOTEL" in prompt and "FOXTROT" not in prompt and "call_FOXTROT" not in prompt
    too_big = dict(body, input=said("ECHO " + "eight nine " * 3000), truncation="auto")
    r = post(server, **too_big)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
