"""Agent-facing endpoints over real HTTP with the official SDKs, against the fake engine (the
model's words are scripted, so these test the protocol shapes; tests/test_agents_real.py runs the
real engine for what only constrained decoding can guarantee).

Covers: chat completions with tools (auto, required, named, none; streamed tool-call deltas
reassemble into the non-streamed call), response_format → engine constraint, Anthropic Messages
(plain, streamed, tool round trip, count_tokens, errors), Responses (plain, streamed,
previous_response_id, GET, background + cancel), /tokenize, /detokenize, /metrics, API keys.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Sequence

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.app import create_app
from server.config import ServerConfig
from tests.fake_engine import FakeEngine, ServerThread

MODEL = "tinycoder-16m"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
COUNT = {"type": "function", "function": {"name": "count", "parameters": {"type": "object"}}}
CALL_TEXT = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n'
             '</tool_call>\n<tool_call>\n{"name": "count", "arguments": {"n": 3}}\n</tool_call>')
THINK_TEXT = "<think>The user wants a greeting.</think>\n\nHello there!"


def scripted(fake: FakeEngine, text: str):
    ids = fake.tokenizer.encode(text, add_special_tokens=False) + [fake.eos_id]
    return lambda request: ids


@pytest.fixture(autouse=True)
def _fresh(fake):
    fake.reset()


@pytest.fixture
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def _reassemble_chat_stream(stream):
    content, calls, finish = "", {}, None
    first_delta_of = {}
    for chunk in stream:
        for c in chunk.choices:
            d = c.delta
            content += d.content or ""
            for tc in d.tool_calls or []:
                if tc.index not in calls:
                    first_delta_of[tc.index] = tc
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                else:
                    assert tc.id is None and tc.function.name is None  # id and name come first, once
                calls[tc.index]["arguments"] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    for tc in first_delta_of.values():
        assert tc.id and tc.type == "function" and tc.function.name and tc.function.arguments == ""
    return content, [calls[i] for i in sorted(calls)], finish


@contextlib.contextmanager
def _family(template: str, special: Sequence[str] = (), stop: Sequence[str] = ()):
    """A server over a fake engine whose chat template is `template`: (engine, OpenAI client).
    `special`: markers the tokenizer gets as special tokens of their own; `stop`: those of them
    that end the output, as a model's generation_config.json says."""
    fake2 = FakeEngine()
    fake2.model.chat_template = template
    if special:
        tok = copy.deepcopy(fake2.tokenizer)  # the shared one stays as it is
        tok.add_special_tokens({"additional_special_tokens": list(special)})
        fake2.tokenizer = fake2.model.tokenizer = tok
        fake2.model.eos_token_ids = (fake2.eos_id, *tok.convert_tokens_to_ids(list(stop)))
    with ServerThread(create_app(fake2, ServerConfig())) as s:
        yield fake2, openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)


def _whole_and_streamed(fake2, client, text: str, msgs, tools):
    """The scripted answer `text` asked for whole, then streamed token by token: the whole
    response's choice, its calls as (name, arguments), and the streamed content, after checking
    that the stream's calls and finish reason are the whole response's."""
    fake2.reset(script=scripted(fake2, text))
    choice = client.chat.completions.create(model=MODEL, messages=msgs, tools=tools).choices[0]
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    fake2.reset(script=scripted(fake2, text), tokens_per_event=1)
    stream = client.chat.completions.create(model=MODEL, messages=msgs, tools=tools, stream=True)
    content, streamed, finish = _reassemble_chat_stream(stream)
    assert ([(c["name"], c["arguments"]) for c in streamed], finish) == (calls, "tool_calls")
    return choice, calls, content


def _after_call(msgs, arguments: str, call_id: str = "call_1", **assistant):
    """`msgs`, then an assistant call of get_weather with `arguments` and its result "sunny"."""
    call = {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    return msgs + [{"role": "assistant", "content": None, **assistant, "tool_calls": [call]},
                   {"role": "tool", "tool_call_id": call_id, "content": "sunny"}]


def _rendered(fake2, client, msgs, tools, answer: str = "Sunny."):
    """The request for `msgs` (the engine answers `answer`) and the prompt the template made."""
    fake2.reset(script=scripted(fake2, answer))
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=tools)
    return r, fake2.tokenizer.decode(fake2.submits[-1].prompt_ids)


def _forced(fake2, client, msgs, tools, answer: str):
    """The engine constraint of a tool_choice="required" request (the engine answers `answer`)."""
    fake2.reset(script=scripted(fake2, answer))
    client.chat.completions.create(model=MODEL, messages=msgs, tools=tools, tool_choice="required")
    return fake2.submits[-1].params.constraint


# -- chat completions with tools ------------------------------------------------------------------


def test_chat_tools_auto_streamed_equals_whole(fake, oai):
    fake.reset(script=scripted(fake, CALL_TEXT))
    msgs = [{"role": "user", "content": "weather in Paris?"}]
    whole = oai.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER, COUNT])
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert calls == [("get_weather", '{"city": "Paris", "days": [1, 2]}'), ("count", '{"n": 3}')]
    assert all(c.id.startswith("call_") for c in choice.message.tool_calls)
    # the tools reached the prompt (tinycoder's ChatML template ignores `tools`: system-prompt fallback)
    prompt = fake.tokenizer.decode(fake.submits[-1].prompt_ids)
    assert "<tools>" in prompt and '"get_weather"' in prompt and prompt.startswith("<|im_start|>system")
    assert fake.submits[-1].params.constraint is None  # auto: the model may answer in text

    fake.reset(script=scripted(fake, CALL_TEXT), tokens_per_event=1)
    stream = oai.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER, COUNT], stream=True)
    content, streamed, finish = _reassemble_chat_stream(stream)
    assert finish == "tool_calls"
    assert content.strip() == "Checking."
    assert [(c["name"], c["arguments"]) for c in streamed] == calls


def test_chat_tool_choice_required_named_and_none_reach_the_engine(fake, oai):
    fake.reset(script=scripted(fake, '<tool_call>\n{"name": "count", "arguments": {}}\n</tool_call>'))
    msgs = [{"role": "user", "content": "hi"}]
    oai.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER, COUNT], tool_choice="required")
    spec = fake.submits[-1].params.constraint
    assert spec["type"] == "tool_calls" and [t["name"] for t in spec["tools"]] == ["get_weather", "count"]
    assert spec["format"]["call_open"] == "<tool_call>\n" and spec["parallel"] is True
    assert spec["tools"][0]["parameters"] == WEATHER["function"]["parameters"]

    named = {"type": "function", "function": {"name": "count"}}
    r = oai.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER, COUNT], tool_choice=named,
                                    parallel_tool_calls=True)
    spec = fake.submits[-1].params.constraint
    assert [t["name"] for t in spec["tools"]] == ["count"] and spec["parallel"] is False
    assert r.choices[0].message.tool_calls[0].function.name == "count"

    oai.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER], tool_choice="none")
    assert fake.submits[-1].params.constraint is None
    assert "<tools>" not in fake.tokenizer.decode(fake.submits[-1].prompt_ids)


def test_strict_tools_get_a_lazy_grammar_on_every_api(fake, server, oai, claude):
    """A tool with `strict: true` where the model may answer in text (tool_choice auto) asks for a
    lazy tool-call grammar (free text; calls, once opened, follow the schemas) on chat
    completions, Anthropic Messages and Responses; without strict nothing is constrained, and
    the flag is not shown to the chat template."""
    fake.reset(script=scripted(fake, "Plain text."))
    msgs = [{"role": "user", "content": "hi"}]
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    oai.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER, COUNT])
    assert fake.submits[-1].params.constraint is None
    oai.chat.completions.create(model=MODEL, messages=msgs, tools=[strict, COUNT])
    spec = fake.submits[-1].params.constraint
    assert spec["type"] == "tool_calls" and spec["lazy"] is True and spec["trigger"] == "<tool_call>"
    assert [t["name"] for t in spec["tools"]] == ["get_weather", "count"] and spec["parallel"] is True
    assert "strict" not in fake.tokenizer.decode(fake.submits[-1].prompt_ids)
    oai.chat.completions.create(model=MODEL, messages=msgs, tools=[strict, COUNT], parallel_tool_calls=False)
    assert fake.submits[-1].params.constraint["parallel"] is False
    # a response format keeps its own constraint
    oai.chat.completions.create(model=MODEL, messages=msgs, tools=[strict], response_format={"type": "json_object"})
    assert fake.submits[-1].params.constraint == {"type": "json_object"}
    tools = [{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"], "strict": True}]
    claude.messages.create(model=MODEL, max_tokens=20, tools=tools, messages=[{"role": "user", "content": "x"}])
    assert fake.submits[-1].params.constraint["lazy"] is True
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 20,
            "tools": [{"type": "function", "name": "get_weather", "strict": True,
                       "parameters": WEATHER["function"]["parameters"]}]}
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert fake.submits[-1].params.constraint["lazy"] is True
    body["tools"][0]["strict"] = False
    assert httpx.post(server.url + "/v1/responses", json=body, timeout=30).status_code == 200
    assert fake.submits[-1].params.constraint is None


def test_parallel_tool_calls_false_keeps_the_first_call(fake, oai):
    fake.reset(script=scripted(fake, CALL_TEXT))
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                    tools=[WEATHER, COUNT], parallel_tool_calls=False)
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]


def test_tool_history_is_rendered(fake, oai):
    msgs = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
    ]
    oai.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER])
    prompt = fake.tokenizer.decode(fake.submits[-1].prompt_ids)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in prompt
    assert "<tool_response>\nsunny, 21C\n</tool_response>" in prompt


@pytest.mark.parametrize("bad, fragment", [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tools"),
    ({"response_format": {"type": "xml"}}, "xml"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 5}}}, "schema"),
])
def test_bad_tool_and_format_fields_are_400(fake, server, bad, fragment):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], **bad}
    r = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"]
    assert not fake.submits


def test_response_format_becomes_the_engine_constraint(fake, oai):
    fake.reset(script=scripted(fake, '{"a": 1}'))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    r = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}],
        response_format={"type": "json_schema", "json_schema": {"name": "A", "schema": schema, "strict": True}})
    assert json.loads(r.choices[0].message.content) == {"a": 1}
    assert fake.submits[-1].params.constraint == {"type": "json_schema", "schema": schema, "strict": True}
    oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                response_format={"type": "json_object"})
    assert fake.submits[-1].params.constraint == {"type": "json_object"}


def test_reasoning_split_when_the_template_thinks(fake):
    tmpl = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")
    fake2 = FakeEngine()
    fake2.model.chat_template = tmpl
    fake2.reset(script=scripted(fake2, "The user wants a greeting.</think>\n\nHello there!"))
    with ServerThread(create_app(fake2, ServerConfig())) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        msg = r.choices[0].message
        assert msg.content == "Hello there!"
        assert msg.model_extra["reasoning_content"] == "The user wants a greeting."
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                stream=True)
        content = reasoning = ""
        for chunk in stream:
            for c in chunk.choices:
                content += c.delta.content or ""
                reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
        assert (reasoning, content) == ("The user wants a greeting.", "Hello there!")
        # a JSON answer comes after the reasoning the prompt opened
        fake2.reset(script=scripted(fake2, 'Numbers.</think>\n\n{"n": 4}'))
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                           response_format={"type": "json_object"})
        assert (r.choices[0].message.content, r.choices[0].message.model_extra["reasoning_content"]) == (
            '{"n": 4}', "Numbers.")
        assert fake2.submits[-1].params.constraint == {
            "type": "json_object", "reasoning": {"open": "<think>", "close": "</think>", "opened": True}}


# the wire format of Mistral's v11+ templates (Mistral Small 3.1+, Devstral, Magistral),
# including their refusal of call ids that are not 9 letters and digits
MISTRAL_V11_TEMPLATE = (
    "{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif -%}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}[INST]{{ m.content }}[/INST]"
    "{%- elif m.role == 'assistant' and m.tool_calls %}{% for c in m.tool_calls %}"
    "{%- if c.id | length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric strings "
    "with length 9!') }}{% endif -%}"
    "[TOOL_CALLS]{{ c.function.name }}[CALL_ID]{{ c.id }}[ARGS]{{ c.function.arguments | tojson }}"
    "{%- endfor %}</s>"
    "{%- elif m.role == 'assistant' %}{{ m.content }}</s>"
    "{%- elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.tool_call_id }}[TOOL_CONTENT]{{ m.content }}"
    "[/TOOL_RESULTS]{% endif %}{% endfor %}"
)


def test_mistral_v11_calls_parse_and_their_history_renders():
    """A v11 template's family: `[TOOL_CALLS]name[ARGS]{...}` calls (the model's own
    `[CALL_ID]` skipped) come back as tool calls with ids its template accepts, streamed as
    whole; a history whose ids came from elsewhere (`call_1`, Anthropic's `toolu_...`) renders
    with ids it accepts, a call and its result keeping the same one; `required` constrains to
    the same wire format."""
    text = ('Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": [1, 2]}'
            '[TOOL_CALLS]count[CALL_ID]a1B2c3D4e[ARGS]{"n": 3}')
    with _family(MISTRAL_V11_TEMPLATE) as (fake2, client):
        msgs = [{"role": "user", "content": "weather in Paris?"}]
        choice, calls, content = _whole_and_streamed(fake2, client, text, msgs, [WEATHER, COUNT])
        assert calls == [("get_weather", '{"city": "Paris", "days": [1, 2]}'), ("count", '{"n": 3}')]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
        assert all(len(c.id) == 9 and c.id.isalnum() for c in choice.message.tool_calls)
        assert content == "Checking."

        # the history, as the client sends it back (our ids) and with ids from elsewhere
        ours = choice.message.tool_calls[0].id
        for cid in (ours, "call_1", "toolu_01A09q90qw90lq917835lq9"):
            r, prompt = _rendered(fake2, client, _after_call(msgs, '{"city": "Paris"}', cid), [WEATHER])
            assert r.choices[0].message.content == "Sunny."
            head, _, rest = prompt.partition("[TOOL_CALLS]get_weather[CALL_ID]")
            sent = rest[:9]
            assert sent.isalnum() and rest[9:].startswith('[ARGS]{"city": "Paris"}'), prompt
            assert f"[TOOL_RESULTS]{sent}[TOOL_CONTENT]sunny" in prompt
            assert cid != ours or sent == ours  # ours pass unchanged

        fmt = _forced(fake2, client, msgs, [WEATHER], '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}')["format"]
        assert (fmt["call_open"], fmt["args_marker"]) == ("[TOOL_CALLS]", "[ARGS]")


# the wire format of Qwen3-Coder's template: one tag per argument, strings bare
QWEN3_CODER_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n<tools>{% for t in tools %}<function><name>"
    "{{ t.function.name }}</name></function>{% endfor %}</tools>\nCall a function as <tool_call>\n"
    "<function=name>\n<parameter=key>\nvalue\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
    "{% endif -%}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{% for c in m.tool_calls %}\n<tool_call>\n<function={{ c.function.name }}>\n"
    "{% for k, v in c.function.arguments | items %}<parameter={{ k }}>\n"
    "{{ v | tojson if v is mapping or (v is sequence and v is not string) else v }}\n</parameter>\n"
    "{% endfor %}</function>\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_qwen3_coder_calls_parse_typed_and_their_history_renders():
    """Qwen3-Coder's family: `<function=NAME>` calls with one `<parameter=KEY>` tag per argument
    come back as JSON arguments typed by the tool's schema (a string that looks like a number
    stays a string, a list is a list), streamed as whole; earlier calls render in the same
    format; `required` constrains to it."""
    days = {**WEATHER["function"]["parameters"],
            "properties": {"city": {"type": "string"}, "days": {"type": "array"}}}
    tools = [{"type": "function", "function": {**WEATHER["function"], "parameters": days}}, COUNT]
    text = ("I will check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n2024\n</parameter>\n"
            "<parameter=days>\n[1, 2]\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
            "<function=count>\n<parameter=n>\n3\n</parameter>\n</function>\n</tool_call>")
    with _family(QWEN3_CODER_TEMPLATE) as (fake2, client):
        msgs = [{"role": "user", "content": "weather?"}]
        choice, calls, content = _whole_and_streamed(fake2, client, text, msgs, tools)
        assert calls == [("get_weather", '{"city": "2024", "days": [1, 2]}'), ("count", '{"n": 3}')]
        assert choice.finish_reason == "tool_calls" and choice.message.content.strip() == "I will check."
        prompt = fake2.tokenizer.decode(fake2.submits[-1].prompt_ids)
        assert "<tools><function><name>get_weather</name>" in prompt  # the template's own tools
        assert content.strip() == "I will check."

        _, prompt = _rendered(fake2, client, _after_call(msgs, '{"city": "Oslo", "days": [3]}'), tools)
        assert ("<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n[3]\n"
                "</parameter>\n</function>") in prompt

        spec = _forced(fake2, client, msgs, tools, "<tool_call>\n<function=count>\n</function>\n</tool_call>")
        assert spec["format"]["xml"]["function_open"] == "<function=" and spec["format"]["call_open"] == "<tool_call>\n"


# the wire format of GLM-4.5 / 4.6's template: the name after the marker, a key and a value tag
# per argument
GLM_TEMPLATE = (
    "{%- if tools %}<|system|>{% for t in tools %}{{ t.function.name }}\n{% endfor %}{% endif -%}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|assistant|>"
    "{% for tc in m.tool_calls %}\n<tool_call>{{ tc.function.name }}\n"
    "{% for k, v in tc.function.arguments | items %}<arg_key>{{ k }}</arg_key>\n"
    "<arg_value>{{ v | tojson if v is not string else v }}</arg_value>\n{% endfor %}</tool_call>"
    "{% endfor %}"
    "{%- elif m.role == 'tool' %}<|observation|><tool_response>{{ m.content }}</tool_response>"
    "{%- else %}<|{{ m.role }}|>{{ m.content }}{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_glm_calls_parse_typed_and_their_history_renders():
    """GLM's family: `<tool_call>NAME` with `<arg_key>`/`<arg_value>` pairs, newline-separated
    (4.5/4.6) or written compact (4.7), come back as typed JSON arguments; earlier calls render
    in the template's format; `required` constrains to it."""
    text = ("Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
            "<arg_key>days</arg_key>\n<arg_value>[1, 2]</arg_value>\n</tool_call>"
            "<tool_call>count<arg_key>n</arg_key><arg_value>3</arg_value></tool_call>")
    with _family(GLM_TEMPLATE) as (fake2, client):
        msgs = [{"role": "user", "content": "weather?"}]
        choice, calls, _ = _whole_and_streamed(fake2, client, text, msgs, [WEATHER, COUNT])
        assert calls == [("get_weather", '{"city": "Paris", "days": [1, 2]}'), ("count", '{"n": 3}')]
        assert choice.finish_reason == "tool_calls" and choice.message.content.strip() == "Checking."

        _, prompt = _rendered(fake2, client, _after_call(msgs, '{"city": "Oslo"}'), [WEATHER])
        assert "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n</tool_call>" in prompt

        spec = _forced(fake2, client, msgs, [WEATHER], "<tool_call>count\n</tool_call>")
        assert spec["format"]["xml"]["key_open"] == "<arg_key>" and spec["format"]["call_open"] == "<tool_call>"


# the wire format of gpt-oss's harmony template: channels, calls addressed to functions.NAME,
# tool results from functions.NAME, the reasoning of a call's turn as `thinking`
HARMONY_TEMPLATE = (
    "<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
    "{%- if tools %}<|start|>developer<|message|>namespace functions { "
    "{% for t in tools %}type {{ t.function.name }} = (_: any) => any; {% endfor %}}<|end|>{% endif -%}"
    "{%- set ns = namespace(last='') %}{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}"
    "{%- if m.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>{% endif -%}"
    "{%- set c = m.tool_calls[0].function %}{% set ns.last = c.name -%}"
    "<|start|>assistant to=functions.{{ c.name }}<|channel|>commentary json<|message|>"
    "{{ c.arguments | tojson }}<|call|>"
    "{%- elif m.role == 'tool' %}<|start|>functions.{{ ns.last }} to=assistant<|channel|>commentary"
    "<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{%- else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{% endif %}"
)


def test_harmony_channels_become_reasoning_answers_and_calls():
    """gpt-oss: analysis is reasoning_content, final the answer (plain chat too), a message to
    functions.NAME a tool call, streamed as whole; the history renders calls in the template's
    own way with their reasoning; `required` constrains to one call in its wire format."""
    call = ('<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary '
            'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>')
    answer = ("<|channel|>analysis<|message|>Say hi.<|end|><|start|>assistant<|channel|>final"
              "<|message|>Hello there!<|return|>")
    markers = ["<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>", "<|return|>"]
    with _family(HARMONY_TEMPLATE, special=markers, stop=["<|call|>", "<|return|>"]) as (fake2, client):
        assert len(fake2.tokenizer.encode("<|channel|>", add_special_tokens=False)) == 1
        msgs = [{"role": "user", "content": "weather in Paris?"}]
        choice, calls, content = _whole_and_streamed(fake2, client, call, msgs, [WEATHER, COUNT])
        assert calls == [("get_weather", '{"city": "Paris"}')] and content == ""
        assert choice.message.content is None
        assert choice.message.model_extra["reasoning_content"] == "Need the weather."

        fake2.reset(script=scripted(fake2, answer))
        msg = client.chat.completions.create(model=MODEL, messages=msgs).choices[0].message
        assert (msg.content, msg.model_extra["reasoning_content"]) == ("Hello there!", "Say hi.")

        history = _after_call(msgs, '{"city": "Paris"}', reasoning_content="Need the weather.")
        _, prompt = _rendered(fake2, client, history, [WEATHER], answer)
        assert ('<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant to=functions.'
                'get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>') in prompt
        assert prompt.endswith("<|start|>functions.get_weather to=assistant<|channel|>commentary"
                               "<|message|>sunny<|end|><|start|>assistant")

        spec = _forced(fake2, client, msgs, [WEATHER, COUNT], call)
        assert (spec["format"]["call_open"], spec["format"]["args_marker"], spec["parallel"]) == (
            "<|channel|>commentary to=functions.", " <|constrain|>json<|message|>", False)
        analysis = {"open": "<|channel|>analysis<|message|>", "close": "<|end|><|start|>assistant"}
        assert spec["reasoning"] == {**analysis, "prefix": ""}

        # a JSON answer: after the analysis, in the final channel
        fake2.reset(script=scripted(fake2, answer.replace("Hello there!", '{"n": 4}')))
        msg = client.chat.completions.create(model=MODEL, messages=msgs, response_format={"type": "json_object"}
                                             ).choices[0].message
        assert (msg.content, msg.model_extra["reasoning_content"]) == ('{"n": 4}', "Say hi.")
        assert fake2.submits[-1].params.constraint["reasoning"] == {
            **analysis, "prefix": "<|channel|>final<|message|>"}
        fake2.reset(script=scripted(fake2, answer.replace("Hello there!", "42")))
        client.chat.completions.create(model=MODEL, messages=msgs,
                                       response_format={"type": "regex", "pattern": "[0-9]+"})
        spec = fake2.submits[-1].params.constraint
        assert (spec["type"], spec["reasoning"]["prefix"]) == ("regex", "<|channel|>final<|message|>")

        # strict tools, tool_choice auto: after the analysis, a final answer or one held call
        fake2.reset(script=scripted(fake2, call))
        strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
        got = client.chat.completions.create(model=MODEL, messages=msgs, tools=[strict]).choices[0].message
        assert [(c.function.name, c.function.arguments) for c in got.tool_calls] == [
            ("get_weather", '{"city": "Paris"}')]
        spec = fake2.submits[-1].params.constraint
        assert (spec["type"], spec["or_text"], spec["parallel"], spec["reasoning"]) == (
            "tool_calls", "<|channel|>final<|message|>", False, {**analysis, "prefix": ""})
        assert "lazy" not in spec


def test_reasoning_effort_reaches_the_chat_template():
    """OpenAI's reasoning effort (chat's `reasoning_effort`, Responses' `reasoning.effort`) is
    the template's `reasoning_effort` variable (gpt-oss reads it), "none" also turns Qwen3's
    `enable_thinking` off, `chat_template_kwargs` win, and a value OpenAI does not define is a
    400 naming the parameter."""
    tmpl = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "[effort={{ reasoning_effort | default('unset') }}"
            " thinking={{ enable_thinking | default('unset') }}]")
    fake2 = FakeEngine()
    fake2.model.chat_template = tmpl
    hi = [{"role": "user", "content": "hi"}]
    with ServerThread(create_app(fake2, ServerConfig())) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)

        def rendered() -> str:
            text = fake2.tokenizer.decode(fake2.submits[-1].prompt_ids)
            return text[text.index("[effort="):]

        client.chat.completions.create(model=MODEL, messages=hi, max_tokens=2)
        assert rendered() == "[effort=unset thinking=unset]"
        client.chat.completions.create(model=MODEL, messages=hi, max_tokens=2, reasoning_effort="high")
        assert rendered() == "[effort=high thinking=unset]"
        client.chat.completions.create(model=MODEL, messages=hi, max_tokens=2, reasoning_effort="none")
        assert rendered() == "[effort=none thinking=False]"
        client.chat.completions.create(model=MODEL, messages=hi, max_tokens=2, reasoning_effort="none",
                                       extra_body={"chat_template_kwargs": {"enable_thinking": True}})
        assert rendered() == "[effort=none thinking=True]"
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        client.chat.completions.create(model=MODEL, messages=hi, max_tokens=2, reasoning_effort="low",
                                       tools=tools)  # the agent path
        assert rendered() == "[effort=low thinking=unset]"
        client.responses.create(model=MODEL, input="hi", max_output_tokens=2, reasoning={"effort": "minimal"})
        assert rendered() == "[effort=minimal thinking=unset]"
        for path, body, param in (
            ("/v1/chat/completions", {"messages": hi, "reasoning_effort": "max"}, "reasoning_effort"),
            ("/v1/responses", {"input": "hi", "reasoning": {"effort": 3}}, "reasoning.effort"),
        ):
            r = httpx.post(s.url + path, json={"model": MODEL, **body}, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# -- Anthropic Messages ---------------------------------------------------------------------------


def test_messages_plain_and_streamed(fake, claude):
    fake.reset(script=scripted(fake, "Hello from mlxd."))
    msg = claude.messages.create(model=MODEL, max_tokens=50, system="Be brief.",
                                 messages=[{"role": "user", "content": "hi"}])
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == "Hello from mlxd."
    n_out = len(fake.tokenizer.encode("Hello from mlxd.", add_special_tokens=False))
    assert msg.stop_reason == "end_turn" and msg.usage.output_tokens == n_out
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == len(fake.submits[-1].prompt_ids)
    prompt = fake.tokenizer.decode(fake.submits[-1].prompt_ids)
    assert prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>")

    with claude.messages.stream(model=MODEL, max_tokens=50, messages=[{"role": "user", "content": "hi"}]) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert final.content[0].text == "Hello from mlxd." and final.stop_reason == "end_turn"
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "content_block_stop" in kinds and "message_delta" in kinds


def test_messages_max_tokens_and_stop_sequences(fake, claude):
    fake.reset(script=scripted(fake, "one two three four five six"))
    msg = claude.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "count"}])
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 2
    msg = claude.messages.create(model=MODEL, max_tokens=50, stop_sequences=[" four"],
                                 messages=[{"role": "user", "content": "count"}])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == " four"
    assert msg.content[0].text == "one two three"
    # a tool call cut off by max_tokens stays, last, with the input that parsed (as Anthropic's)
    fake.reset(script=scripted(fake, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'))
    tools = [{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}]
    msg = claude.messages.create(model=MODEL, max_tokens=25, tools=tools, messages=[{"role": "user", "content": "x"}])
    assert msg.stop_reason == "max_tokens" and msg.content[-1].type == "tool_use"
    assert msg.content[-1].name == "get_weather" and msg.content[-1].input == {}


def test_messages_tools_round_trip(fake, claude):
    tools = [{"name": "get_weather", "description": "Weather", "input_schema": WEATHER["function"]["parameters"]}]
    fake.reset(script=scripted(fake, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'))
    msg = claude.messages.create(model=MODEL, max_tokens=100, tools=tools,
                                 messages=[{"role": "user", "content": "weather in Paris?"}])
    assert msg.stop_reason == "tool_use"
    use = [b for b in msg.content if b.type == "tool_use"][0]
    assert use.name == "get_weather" and use.input == {"city": "Paris"} and use.id.startswith("toolu_")
    # streamed: the same tool_use block, arguments as input_json_delta fragments
    with claude.messages.stream(model=MODEL, max_tokens=100, tools=tools,
                                messages=[{"role": "user", "content": "weather in Paris?"}]) as s:
        deltas = [e.delta.partial_json for e in s if e.type == "content_block_delta"
                  and e.delta.type == "input_json_delta"]
        final = s.get_final_message()
    assert "".join(deltas) == '{"city": "Paris"}'
    assert [b.input for b in final.content if b.type == "tool_use"] == [{"city": "Paris"}]
    # the tool result goes back in and reaches the prompt
    fake.reset(script=scripted(fake, "It is sunny in Paris."))
    msg2 = claude.messages.create(model=MODEL, max_tokens=100, tools=tools, messages=[
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": msg.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]},
    ])
    assert msg2.content[0].text == "It is sunny in Paris." and msg2.stop_reason == "end_turn"
    prompt = fake.tokenizer.decode(fake.submits[-1].prompt_ids)
    assert '"get_weather", "arguments": {"city": "Paris"}' in prompt and "<tool_response>\nsunny\n" in prompt
    # tool_choice any / tool → the forcing constraint
    claude.messages.create(model=MODEL, max_tokens=20, tools=tools, tool_choice={"type": "any"},
                           messages=[{"role": "user", "content": "x"}])
    assert fake.submits[-1].params.constraint["type"] == "tool_calls"


def test_messages_continue_a_final_assistant_message(fake, claude):
    """A conversation ending with assistant text is a prefill: the prompt ends with that text (no
    closing of the assistant turn, no new one) and the answer holds only what follows."""
    fake.reset(script=scripted(fake, " sort(arr):"))
    convo = [{"role": "user", "content": "write code"}, {"role": "assistant", "content": "def quick"}]
    msg = claude.messages.create(model=MODEL, max_tokens=20, messages=convo)
    assert msg.content[0].text == " sort(arr):"
    prompt = fake.tokenizer.decode(fake.submits[-1].prompt_ids)
    assert prompt.endswith("<|im_start|>assistant\ndef quick"), prompt[-60:]
    blocks = [convo[0], {"role": "assistant", "content": [{"type": "text", "text": "def quick"}]}]
    claude.messages.create(model=MODEL, max_tokens=20, messages=blocks)
    assert fake.tokenizer.decode(fake.submits[-1].prompt_ids) == prompt
    n = claude.messages.count_tokens(model=MODEL, messages=convo)
    assert n.input_tokens == len(fake.submits[-1].prompt_ids)
    # ending with a user turn (or a tool call) still opens a new assistant turn
    claude.messages.create(model=MODEL, max_tokens=20, messages=convo[:1])
    assert fake.tokenizer.decode(fake.submits[-1].prompt_ids).endswith("<|im_start|>assistant\n")


def test_messages_read_text_documents_and_search_results(fake, claude):
    """Documents with a text source and search results are text: they reach the prompt; a PDF
    document is a 400 that says why."""
    fake.reset(script=scripted(fake, "ok"))
    blocks = [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "The sky is green."},
         "title": "Notes", "context": "from a test"},
        {"type": "document", "source": {"type": "content", "content": [{"type": "text", "text": "Part two."}]}},
        {"type": "search_result", "source": "https://example.org/a", "title": "A result",
         "content": [{"type": "text", "text": "Water is wet."}]},
        {"type": "text", "text": "Summarize."},
    ]
    claude.messages.create(model=MODEL, max_tokens=10, messages=[{"role": "user", "content": blocks}])
    prompt = fake.tokenizer.decode(fake.submits[-1].prompt_ids)
    for text in ("Notes\nfrom a test\nThe sky is green.", "Part two.", "A result\nhttps://example.org/a\nWater is wet.",
                 "Summarize."):
        assert text in prompt, text
    pdf = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}}
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model=MODEL, max_tokens=10, messages=[{"role": "user", "content": [pdf]}])
    assert "text source only" in str(err.value) and "'base64'" in str(err.value)


def test_messages_refuse_anthropic_defined_tools(fake, claude):
    """A server tool (web search) or an Anthropic-defined client tool has no schema here: a 400
    naming it, never a made-up function; custom tools (typed or not) pass."""
    custom = {"name": "get_weather", "input_schema": {"type": "object"}}
    for tool in ({"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
                 {"type": "bash_20250124", "name": "bash"}):
        with pytest.raises(anthropic.BadRequestError) as err:
            claude.messages.create(model=MODEL, max_tokens=10, tools=[custom, tool],
                                   messages=[{"role": "user", "content": "x"}])
        assert "tools[1]" in str(err.value) and tool["type"] in str(err.value)
    assert not fake.submits
    fake.reset(script=scripted(fake, "ok"))
    claude.messages.create(model=MODEL, max_tokens=10, tools=[custom, {**custom, "name": "f2", "type": "custom"}],
                           messages=[{"role": "user", "content": "x"}])
    assert "f2" in fake.tokenizer.decode(fake.submits[-1].prompt_ids)


def test_messages_thinking_budget_closes_the_reasoning():
    """`thinking.budget_tokens` on a model that thinks: once the reasoning has taken the budget
    without closing, the closing tag is written as if the model had, and the answer continues
    from prompt + tokens so far + tag in a new row with the rest of max_tokens; whole and
    streamed alike. A model that closes its reasoning in time is left alone."""
    tmpl = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")
    fake2 = FakeEngine()
    fake2.model.chat_template = tmpl
    tok = fake2.tokenizer
    close = tok.encode("\n</think>\n\n", add_special_tokens=False)
    rambling = tok.encode(" and then" * 40 + "</think>\n\nToo late.", add_special_tokens=False)
    answer = tok.encode("Hello there!", add_special_tokens=False)

    def script(request):
        cut = request.prompt_ids[-len(close):] == close
        return (answer if cut else rambling) + [fake2.eos_id]

    fake2.reset(script=script)
    thinking = {"type": "enabled", "budget_tokens": 12}
    convo = [{"role": "user", "content": "hi"}]
    with ServerThread(create_app(fake2, ServerConfig())) as s:
        client = anthropic.Anthropic(base_url=s.url, api_key="x", max_retries=0)
        msg = client.messages.create(model=MODEL, max_tokens=100, thinking=thinking, messages=convo)
        assert [b.type for b in msg.content] == ["thinking", "text"]
        assert msg.content[0].thinking.strip() == tok.decode(rambling[:12]).strip()
        assert msg.content[1].text == "Hello there!" and msg.stop_reason == "end_turn"
        first, second = fake2.submits[-2:]
        assert second.prompt_ids == first.prompt_ids + rambling[:12] + close
        assert second.params.max_tokens == 100 - 12 - len(close) and fake2.aborted(first.req_id)
        assert msg.usage.output_tokens == 12 + len(close) + len(answer)
        with client.messages.stream(model=MODEL, max_tokens=100, thinking=thinking, messages=convo) as st:
            for _ in st:
                pass
            streamed = st.get_final_message()
        assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in streamed.content] == [
            (b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in msg.content]
        # the budget reaches into max_tokens: nothing left after the tag
        short = client.messages.create(model=MODEL, max_tokens=12 + len(close), thinking=thinking, messages=convo)
        assert short.stop_reason == "max_tokens" and [b.type for b in short.content] == ["thinking"]
        # the continued prompt does not fit the context: the answer ends at the tag (max_tokens)
        fake2.context_length = len(fake2.submits[-1].prompt_ids) + 12 + len(close)
        full = client.messages.create(model=MODEL, max_tokens=100, thinking=thinking, messages=convo)
        assert full.stop_reason == "max_tokens" and [b.type for b in full.content] == ["thinking"]
        fake2.context_length = 2048
        # closed in time: one row, the model's own answer
        n = len(fake2.submits)
        fake2.reset(script=lambda r: tok.encode("Short.</think>\n\nFine.", add_special_tokens=False) + [fake2.eos_id])
        ok = client.messages.create(model=MODEL, max_tokens=100, thinking=thinking, messages=convo)
        assert ok.content[-1].text == "Fine." and len(fake2.submits) == 1 and n >= 3
        with pytest.raises(anthropic.BadRequestError):
            client.messages.create(model=MODEL, max_tokens=100, thinking={"type": "enabled", "budget_tokens": 0},
                                   messages=convo)
    # a template that leaves the tag to the model: the budget counts from the answer's start
    fake2.model.chat_template = tmpl.replace("assistant\n<think>\n", "assistant\n") + "{# <think> #}"
    opened = tok.encode("<think>", add_special_tokens=False)
    fake2.reset(script=lambda r: (answer if r.prompt_ids[-len(close):] == close else opened + rambling)
                + [fake2.eos_id])
    with ServerThread(create_app(fake2, ServerConfig())) as s:
        client = anthropic.Anthropic(base_url=s.url, api_key="x", max_retries=0)
        msg = client.messages.create(model=MODEL, max_tokens=100, thinking=thinking, messages=convo)
        assert not tok.decode(fake2.submits[0].prompt_ids).endswith("<think>\n")
        assert [b.type for b in msg.content] == ["thinking", "text"] and msg.content[1].text == "Hello there!"
        assert fake2.submits[1].prompt_ids == fake2.submits[0].prompt_ids + (opened + rambling)[:12] + close
        fake2.reset(script=lambda r: answer + [fake2.eos_id])  # no reasoning at all: left alone
        plain = client.messages.create(model=MODEL, max_tokens=100, thinking=thinking, messages=convo)
        assert plain.content[-1].text == "Hello there!" and len(fake2.submits) == 1


def test_messages_thinking_budget_closes_harmony_analysis():
    """gpt-oss: the budget watches the analysis channel; past it, the analysis is ended and the
    final channel opened as the model would have, and a constrained answer (a forced call)
    continues without the reasoning part of its grammar."""
    fake2 = FakeEngine()
    fake2.model.chat_template = HARMONY_TEMPLATE
    tok = fake2.tokenizer
    close = tok.encode("<|end|><|start|>assistant<|channel|>final<|message|>", add_special_tokens=False)
    rambling = tok.encode("<|channel|>analysis<|message|>" + " and then" * 40, add_special_tokens=False)
    answer = tok.encode("Hello there!<|return|>", add_special_tokens=False)
    fake2.reset(script=lambda r: (answer if r.prompt_ids[-len(close):] == close else rambling) + [fake2.eos_id])
    thinking = {"type": "enabled", "budget_tokens": 12}
    convo = [{"role": "user", "content": "hi"}]
    with ServerThread(create_app(fake2, ServerConfig())) as s:
        client = anthropic.Anthropic(base_url=s.url, api_key="x", max_retries=0)
        msg = client.messages.create(model=MODEL, max_tokens=100, thinking=thinking, messages=convo)
        assert [b.type for b in msg.content] == ["thinking", "text"] and msg.content[1].text == "Hello there!"
        first, second = fake2.submits[-2:]
        assert second.prompt_ids == first.prompt_ids + rambling[:12] + close
        tool = {"name": "get_weather", "input_schema": {"type": "object"}}
        client.messages.create(model=MODEL, max_tokens=100, thinking=thinking, messages=convo, tools=[tool],
                               tool_choice={"type": "any"})
        first, second = fake2.submits[-2:]
        assert "reasoning" in first.params.constraint and "reasoning" not in second.params.constraint
        assert second.params.constraint["format"] == first.params.constraint["format"]


def test_messages_count_tokens_and_errors(fake, claude, server):
    n = claude.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "hello there"}])
    assert n.input_tokens > 3
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model=MODEL, max_tokens=10, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    assert "vision" in str(err.value)
    r = httpx.post(server.url + "/v1/messages", json={"model": MODEL, "messages": []})
    assert r.status_code == 400
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"]
    assert not fake.submits


# -- Responses ------------------------------------------------------------------------------------


def test_responses_plain_streamed_and_previous_id(fake, oai):
    fake.reset(script=scripted(fake, "Paris is the capital."))
    r1 = oai.responses.create(model=MODEL, input="What is the capital of France?", instructions="Be terse.")
    assert r1.status == "completed" and r1.output_text == "Paris is the capital."
    assert r1.usage.output_tokens > 0 and r1.id.startswith("resp_")
    assert oai.responses.retrieve(r1.id).output_text == "Paris is the capital."

    fake.reset(script=scripted(fake, "About 2 million."))
    r2 = oai.responses.create(model=MODEL, input="And its population?", previous_response_id=r1.id)
    assert r2.output_text == "About 2 million." and r2.previous_response_id == r1.id
    prompt = fake.tokenizer.decode(fake.submits[-1].prompt_ids)
    assert "capital of France?" in prompt and "Paris is the capital." in prompt and "population" in prompt
    assert "Be terse." not in prompt  # instructions do not carry over

    fake.reset(script=scripted(fake, "Streaming works."))
    events = list(oai.responses.create(model=MODEL, input="x", stream=True))
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] == "response.completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "Streaming works." and events[-1].response.output_text == "Streaming works."
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_function_calls_round_trip(fake, oai):
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
    fake.reset(script=scripted(fake, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'))
    r = oai.responses.create(model=MODEL, input="weather in Rome?", tools=[tool])
    calls = [o for o in r.output if o.type == "function_call"]
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Rome"}')]
    events = list(oai.responses.create(model=MODEL, input="weather in Rome?", tools=[tool], stream=True))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == '{"city": "Rome"}'
    fake.reset(script=scripted(fake, "Rome is sunny."))
    r2 = oai.responses.create(model=MODEL, previous_response_id=r.id, tools=[tool], input=[
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}])
    assert r2.output_text == "Rome is sunny."
    prompt = fake.tokenizer.decode(fake.submits[-1].prompt_ids)
    assert '{"city": "Rome"}' in prompt and "<tool_response>\nsunny\n" in prompt


def test_responses_background_cancel_and_missing_ids(fake, oai, server):
    fake.reset(step_delay=0.05)
    r = oai.responses.create(model=MODEL, input="go on forever", background=True, max_output_tokens=500)
    assert r.status == "in_progress"
    assert fake.wait_until(lambda: fake.tokens_sent.get(r.id, 0) > 0, 5)
    cancelled = oai.responses.cancel(r.id)
    assert cancelled.status == "cancelled"
    assert fake.wait_until(lambda: fake.aborted(r.id), 2)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve("resp_nope")
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model=MODEL, input="x", previous_response_id="resp_nope")


# -- operations -----------------------------------------------------------------------------------


def test_tokenize_detokenize(fake, server):
    r = httpx.post(server.url + "/tokenize", json={"prompt": "def f(x):", "return_token_strs": True})
    body = r.json()
    assert body["tokens"] == fake.tokenizer.encode("def f(x):") and body["count"] == len(body["tokens"])
    assert "".join(body["token_strs"]).replace("Ġ", " ") == "def f(x):"
    back = httpx.post(server.url + "/detokenize", json={"tokens": body["tokens"]}).json()
    assert back["prompt"] == "def f(x):"
    chat = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert fake.tokenizer.decode(chat["tokens"]).startswith("<|im_start|>user\nhi")
    assert httpx.post(server.url + "/detokenize", json={"tokens": [10**9]}).status_code == 400
    assert httpx.post(server.url + "/tokenize", json={}).status_code == 400


def _samples(server):
    text = httpx.get(server.url + "/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _total(samples, name):
    return sum(v for (n, _), v in samples.items() if n == name)


def test_metrics_parse_and_move(fake, oai, server):
    before = _samples(server)
    fake.reset(script=scripted(fake, "one two three"), send_stop_token=False)  # as the real engine
    oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    oai.completions.create(model=MODEL, prompt="def f(", max_tokens=2)
    after = _samples(server)
    assert _total(after, "mlxd_requests_total") - _total(before, "mlxd_requests_total") == 2
    assert _total(after, "mlxd_generation_tokens_total") - _total(before, "mlxd_generation_tokens_total") == 5
    assert _total(after, "mlxd_prompt_tokens_total") > _total(before, "mlxd_prompt_tokens_total")
    assert _total(after, "mlxd_time_to_first_token_seconds_count") - _total(before, "mlxd_time_to_first_token_seconds_count") == 2
    assert _total(after, "mlxd_e2e_request_latency_seconds_count") >= 2
    assert _total(after, "mlxd_inter_token_latency_seconds_count") > _total(before, "mlxd_inter_token_latency_seconds_count")
    key = ("mlxd_http_requests_total", (("method", "POST"), ("route", "/v1/chat/completions"), ("status", "200")))
    assert after[key] - before.get(key, 0) == 1
    for name in ("mlxd_num_requests_running", "mlxd_num_requests_waiting", "mlxd_kv_cache_bytes"):
        assert any(n == name for n, _ in after), name


# -- API keys -------------------------------------------------------------------------------------

PROTECTED = [
    ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models"),
    ("GET", "/v1/models/tinycoder-16m"), ("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens"),
    ("POST", "/v1/responses"), ("GET", "/v1/responses/resp_x"), ("POST", "/v1/responses/resp_x/cancel"),
    ("DELETE", "/v1/responses/resp_x"), ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/metrics"),
]


def test_api_key_required_on_every_protected_route(fake):
    with ServerThread(create_app(fake, ServerConfig(api_key="sk-right"))) as s:
        http = httpx.Client(base_url=s.url)
        for method, path in PROTECTED:
            for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"x-api-key": "sk-wrong"},
                            {"Authorization": "Basic sk-right"}):
                r = http.request(method, path, headers=headers, json={})
                assert r.status_code == 401, (method, path, headers, r.status_code)
                if path.startswith("/v1/messages"):
                    assert r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(s.url + "/health").status_code == 200
        assert httpx.get(s.url + "/").status_code == 200  # the chat page is static and public
        assert not fake.submits
        # the right key, both ways, with the SDKs
        fake.reset(script=scripted(fake, "ok"))
        ok = openai.OpenAI(base_url=s.url + "/v1", api_key="sk-right", max_retries=0)
        assert ok.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}]).choices
        assert httpx.get(s.url + "/metrics", headers={"Authorization": "Bearer sk-right"}).status_code == 200
        c = anthropic.Anthropic(base_url=s.url, api_key="sk-right", max_retries=0)  # sends x-api-key
        assert c.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "x"}]).content
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url + "/v1", api_key="sk-wrong", max_retries=0).models.list()


def test_request_id_on_responses(fake, server):
    r = httpx.post(server.url + "/v1/messages/count_tokens", json={"messages": [{"role": "user", "content": "x"}]},
                   headers={"X-Request-ID": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"
    assert httpx.get(server.url + "/").headers["x-request-id"]


def test_chat_page_is_served(server):
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and 'id="stop"' in page.text and "/static/chat.js" in page.text
    js = httpx.get(server.url + "/static/chat.js")
    assert js.status_code == 200 and "AbortController" in js.text
