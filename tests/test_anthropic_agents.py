"""Anthropic Messages as agent clients use it, over real HTTP with the Anthropic SDK against the
fake engine: a tool_use block cut by max_tokens (whole and streamed answers end with the same
blocks), system messages inside `messages` (Claude Code sends them) and Anthropic's wording for
roles it refuses, and usage that splits prompt tokens into input and prefix-cache reads, streamed
(message_start and message_delta) and whole.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from server.app import create_app
from server.config import ServerConfig
from server.turn import fold_system_messages
from tests.fake_engine import FakeEngine, ServerThread

MODEL = "tinycoder-16m"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n</tool_call>'
TOOLS = [{"name": "get_weather", "description": "Weather for a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"},
                                                            "days": {"type": "array"}}}}]
# a template that takes one system prompt, first (as Qwen3's and Mistral's do)
STRICT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.role == 'system' and not loop.first %}{{ raise_exception('System message must be at the beginning.') }}"
    "{% endif %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


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
    fake.model.chat_template = None


@pytest.fixture
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def _blocks(message) -> list[dict]:
    """Content blocks without the per-request tool ids."""
    out = []
    for b in message.content:
        d = b.model_dump(exclude_none=True)
        if d["type"] == "tool_use":
            assert d.pop("id").startswith("toolu_")
        out.append(d)
    return out


def test_tool_use_cut_by_max_tokens_gives_the_same_blocks_streamed_and_whole(fake, claude):
    n_call = len(fake.tokenizer.encode(CALL, add_special_tokens=False))
    msgs = [{"role": "user", "content": "weather?"}]
    seen_inputs = []
    for limit in range(1, n_call + 2):
        fake.reset(script=scripted(fake, "Let me check.\n" + CALL))
        whole = claude.messages.create(model=MODEL, max_tokens=limit, tools=TOOLS, messages=msgs)
        with claude.messages.stream(model=MODEL, max_tokens=limit, tools=TOOLS, messages=msgs) as s:
            streamed = s.get_final_message()
        assert _blocks(whole) == _blocks(streamed), limit
        assert whole.stop_reason == streamed.stop_reason
        uses = [b for b in _blocks(whole) if b["type"] == "tool_use"]
        if whole.stop_reason == "max_tokens" and uses:
            assert _blocks(whole)[-1]["type"] == "tool_use"  # the cut block is the last one
            seen_inputs.append(json.dumps(uses[0]["input"]))
    # the cut call is kept with what parsed: nothing, then the complete members as they arrive
    assert seen_inputs[0] == "{}" and '{"city": "Paris"}' in seen_inputs
    assert seen_inputs[-1] == '{"city": "Paris", "days": [1, 2]}'
    full = claude.messages.create(model=MODEL, max_tokens=500, tools=TOOLS, messages=msgs)
    assert full.stop_reason == "tool_use" and _blocks(full)[-1]["input"] == {"city": "Paris", "days": [1, 2]}
    # blocks come in the order the model wrote them, whole and streamed
    fake.reset(script=scripted(fake, "Let me check.\n" + CALL + "\nDone.\n"))
    whole = claude.messages.create(model=MODEL, max_tokens=500, tools=TOOLS, messages=msgs)
    with claude.messages.stream(model=MODEL, max_tokens=500, tools=TOOLS, messages=msgs) as s:
        streamed = s.get_final_message()
    assert [b["type"] for b in _blocks(whole)] == ["text", "tool_use", "text"]
    assert _blocks(whole) == _blocks(streamed) and _blocks(whole)[2]["text"] == "Done.\n"


def test_system_messages_inside_messages_stay_where_they_stand(fake, claude):
    fake.reset(script=scripted(fake, "ok"))
    msgs = [
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "first answer"},
        {"role": "system", "content": "From now on answer in French."},
        {"role": "user", "content": "second question"},
    ]
    msg = claude.messages.create(model=MODEL, max_tokens=20, system="You are terse.", messages=msgs)
    assert msg.content[0].text == "ok"
    prompt = fake.tokenizer.decode(fake.submits[-1].prompt_ids)
    assert prompt.startswith("<|im_start|>system\nYou are terse.<|im_end|>")
    order = [prompt.index(t) for t in ("first answer", "<|im_start|>system\nFrom now on answer in French.",
                                       "second question")]
    assert order == sorted(order)
    # text blocks and count_tokens take them too
    blocks = [*msgs[:2], {"role": "system", "content": [{"type": "text", "text": "Be kind."}]}, msgs[3]]
    n = claude.messages.count_tokens(model=MODEL, messages=blocks)
    assert n.input_tokens > 10


def test_a_template_that_refuses_them_gets_them_folded_into_the_next_user_turn(fake, claude):
    fake.reset(script=scripted(fake, "ok"))
    fake.model.chat_template = STRICT_TEMPLATE
    msgs = [
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "first answer"},
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "second question"},
        {"role": "assistant", "content": "second answer"},
        {"role": "system", "content": "Be brief."},
    ]
    claude.messages.create(model=MODEL, max_tokens=5, system="You are terse.", messages=msgs)
    prompt = fake.tokenizer.decode(fake.submits[-1].prompt_ids)
    assert prompt.count("<|im_start|>system") == 1
    assert "<|im_start|>user\nAnswer in French.\n\nsecond question<|im_end|>" in prompt
    # the last one, with no user turn after it, becomes one of its own, still last
    assert prompt.endswith("second answer<|im_end|>\n<|im_start|>user\nBe brief.<|im_end|>\n"
                           "<|im_start|>assistant\n")


# a template that renders the first system message and silently skips later ones
DROPPING_TEMPLATE = (
    "{% for m in messages %}{% if m.role != 'system' or loop.first %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_that_drops_them_gets_them_folded(fake, claude):
    fake.reset(script=scripted(fake, "ok"))
    fake.model.chat_template = DROPPING_TEMPLATE
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "system", "content": "  Answer in French.\n"}, {"role": "user", "content": "bye"}]
    claude.messages.create(model=MODEL, max_tokens=5, messages=msgs)
    prompt = fake.tokenizer.decode(fake.submits[-1].prompt_ids)
    assert "<|im_start|>user\nAnswer in French.\n\nbye<|im_end|>" in prompt


def test_fold_system_messages():
    sys_, user, asst = ({"role": r, "content": r[0]} for r in ("system", "user", "assistant"))
    assert fold_system_messages([sys_, {"role": "system", "content": "s2"}, user]) == [
        {"role": "system", "content": "s\n\ns2"}, user]
    assert fold_system_messages([user, asst, {"role": "system", "content": "x"}, {"role": "tool", "content": "t"},
                                 user]) == [user, asst, {"role": "tool", "content": "t"},
                                            {"role": "user", "content": "x\n\nu"}]
    assert fold_system_messages([user, {"role": "system", "content": "x"}]) == [{"role": "user", "content": "u\n\nx"}]
    assert fold_system_messages([user, asst, {"role": "system", "content": "x"}]) == [
        user, asst, {"role": "user", "content": "x"}]
    assert fold_system_messages([sys_, user]) == [sys_, user]


def test_unknown_roles_are_refused_in_anthropic_words(fake, server):
    body = {"model": MODEL, "max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]}
    r = httpx.post(server.url + "/v1/messages", json=body)
    assert r.status_code == 400
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert 'Unexpected role "tool"' in err["error"]["message"]  # what Claude Code's fallback matches
    assert not fake.submits


def _events(server, body):
    with httpx.stream("POST", server.url + "/v1/messages", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    return [json.loads(line[6:]) for line in lines]


def test_usage_splits_input_and_cache_reads_streamed_and_whole(fake, claude, server):
    body = {"model": MODEL, "max_tokens": 50, "system": "Be brief. " * 20,
            "messages": [{"role": "user", "content": "hello"}]}
    fake.reset(script=scripted(fake, "Hello there."), cached_tokens=30)
    whole = claude.messages.create(**body)
    n_prompt = len(fake.submits[-1].prompt_ids)
    n_out = len(fake.tokenizer.encode("Hello there.", add_special_tokens=False))
    want = {"input_tokens": n_prompt - 30, "cache_read_input_tokens": 30, "cache_creation_input_tokens": 0}
    assert {k: getattr(whole.usage, k) for k in want} == want and whole.usage.output_tokens == n_out

    fake.reset(script=scripted(fake, "Hello there."), cached_tokens=30)
    events = _events(server, body)
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    start = events[0]["message"]["usage"]
    assert {k: start[k] for k in want} == want
    final = events[-2]["usage"]
    assert {k: final[k] for k in want} == want and final["output_tokens"] == n_out
    # the SDK's accumulated message agrees
    fake.reset(script=scripted(fake, "Hello there."), cached_tokens=30)
    with claude.messages.stream(**body) as s:
        got = s.get_final_message().usage
    assert {k: getattr(got, k) for k in want} == want


# Qwen3's way with the current tool loop's reasoning: shown before the assistant's content
REASONING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}"
    "{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}{# tools #}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_thinking_blocks_reach_the_template_as_reasoning_content(fake, claude):
    """Claude Code sends its thinking blocks back in a tool loop: they reach the template as the
    message's reasoning_content (redacted ones have no text and are left out)."""
    fake.reset(script=scripted(fake, "ok"))
    fake.model.chat_template = REASONING_TEMPLATE
    msgs = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Need the tool.", "signature": "x"},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]},
    ]
    claude.messages.create(model=MODEL, max_tokens=5, messages=msgs, tools=TOOLS)
    prompt = fake.tokenizer.decode(fake.submits[-1].prompt_ids)
    assert "<|im_start|>assistant\n<think>\nNeed the tool.\n</think>\n\n<tool_call>get_weather</tool_call>" in prompt
    assert "opaque" not in prompt
