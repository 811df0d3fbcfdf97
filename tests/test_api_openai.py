"""The OpenAI Python SDK over real HTTP against create_app(FakeEngine): the happy paths."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from server.app import create_app
from server.config import ServerConfig
from tests.fake_engine import DEFAULT_TEXT, ServerThread

MODEL = "tinycoder-16m"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(autouse=True)
def _fresh(fake):
    fake.reset()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def expected_text(fake, n_tokens, seed=0):
    ids = fake.tokenizer.encode(DEFAULT_TEXT, add_special_tokens=False)
    k = seed % len(ids)
    ids = (ids[k:] + ids[:k]) * 4
    return fake.tokenizer.decode(ids[:n_tokens])


def sse_lines(url, body):
    with httpx.stream("POST", url, json=body, timeout=10) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        return [line for line in r.iter_lines() if line]


# -- models, health, ids -----------------------------------------------------------------------


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_health(server, fake):
    body = httpx.get(server.url + "/health").json()
    assert body["status"] == "ok" and body["model"] == MODEL
    assert body["engine"]["num_running"] == 0
    assert body["model_extra"]["device"] == "fake"


def test_request_id_roundtrip(client):
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=HI, max_tokens=3, extra_headers={"X-Request-ID": "abc-123"}
    )
    assert raw.headers["x-request-id"] == "abc-123"
    assert raw.parse().id.startswith("chatcmpl-")
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="x", max_tokens=2)
    assert len(raw.headers["x-request-id"]) >= 16
    assert raw.parse().id.startswith("cmpl-")


# -- chat ----------------------------------------------------------------------------------


def test_chat_basic(client, fake):
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=12)
    c = r.choices[0]
    assert c.message.role == "assistant"
    assert c.message.content == expected_text(fake, 12)
    assert c.finish_reason == "length"
    prompt_ids = fake.submits[0].prompt_ids
    assert (
        fake.tokenizer.decode(prompt_ids)
        == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert r.usage.completion_tokens == 12 and r.usage.total_tokens == 12 + len(prompt_ids)
    assert r.usage.prompt_tokens_details.cached_tokens == 4
    assert r.model == MODEL and r.object == "chat.completion"


@pytest.mark.parametrize("send_stop_token", [True, False])
def test_chat_eos_finishes_with_stop(client, fake, send_stop_token):
    ids = fake.tokenizer.encode("done.", add_special_tokens=False)
    fake.reset(script=[*ids, fake.eos_id, 7, 7, 7], send_stop_token=send_stop_token)
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=50, logprobs=True)
    assert r.choices[0].message.content == "done."
    assert r.choices[0].finish_reason == "stop"
    assert len(r.choices[0].logprobs.content) == len(ids)
    assert r.usage.completion_tokens == len(ids)


def test_chat_roles_parts_and_template_kwargs(client, fake):
    msgs = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "again"},
    ]
    client.chat.completions.create(
        model=MODEL,
        messages=msgs,
        max_tokens=2,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    text = fake.tokenizer.decode(fake.submits[0].prompt_ids)
    assert text.startswith("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nab<|im_end|>")
    assert text.endswith("<|im_start|>assistant\n")


def test_chat_continue_final_message(client, fake):
    msgs = [*HI, {"role": "assistant", "content": "def f("}]
    client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=2, extra_body={"continue_final_message": True}
    )
    assert fake.tokenizer.decode(fake.submits[0].prompt_ids).endswith(
        "<|im_start|>assistant\ndef f("
    )


def test_chat_stream(client, server, fake):
    whole = (
        client.chat.completions.create(model=MODEL, messages=HI, max_tokens=40)
        .choices[0]
        .message.content
    )
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=HI, max_tokens=40, stream=True)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)
    assert all(c.id == chunks[0].id and c.object == "chat.completion.chunk" for c in chunks)
    lines = sse_lines(
        server.url + "/v1/chat/completions",
        {"model": MODEL, "messages": HI, "max_tokens": 5, "stream": True},
    )
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)


def test_chat_stream_multi_token_events(client, fake):
    fake.reset(tokens_per_event=3)
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=HI, max_tokens=40, stream=True)
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected_text(fake, 40)


def test_stream_include_usage(client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=HI,
            max_tokens=7,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 4
    assert all(c.usage is None for c in chunks[:-1])
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="x",
            max_tokens=7,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 7 + 1
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=HI,
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    running = [c.usage.completion_tokens for c in chunks]
    assert running == sorted(running) and running[-1] == 5 and running[0] == 0


def test_chat_n_with_seed(client, fake):
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=6, n=3, seed=5)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert sorted(s.params.seed for s in fake.submits) == [5, 6, 7]
    assert [c.message.content for c in r.choices] == [expected_text(fake, 6, s) for s in (5, 6, 7)]
    assert r.usage.completion_tokens == 18
    assert r.usage.prompt_tokens == len(fake.submits[0].prompt_ids)  # the prompt counts once
    fake.reset()
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=HI, max_tokens=6, n=2, seed=1, stream=True
        )
    )
    texts = {0: "", 1: ""}
    finishes = {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finishes[ch.index] = ch.finish_reason
    assert texts == {0: expected_text(fake, 6, 1), 1: expected_text(fake, 6, 2)}
    assert finishes == {0: "length", 1: "length"}


def test_chat_logprobs(client, fake):
    r = client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=30, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 30
    assert (
        bytes(b for e in content for b in e.bytes).decode("utf-8", "replace")
        == r.choices[0].message.content
    )
    for e in content:
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob == e.logprob
    assert any(e.token.startswith("bytes:") for e in content)  # partial UTF-8 tokens (emoji)
    assert fake.submits[0].params.logprobs and fake.submits[0].params.top_logprobs == 3
    streamed = []
    for c in client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=30, logprobs=True, top_logprobs=3, stream=True
    ):
        if c.choices and c.choices[0].logprobs:
            streamed.extend(c.choices[0].logprobs.content)
    assert [(e.token, e.logprob, e.bytes) for e in streamed] == [
        (e.token, e.logprob, e.bytes) for e in content
    ]
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=3)
    assert r.choices[0].logprobs is None


def test_chat_stop_string_across_tokens(client, fake):
    # "world" spans tokens of the script; nothing of it may reach the client, and the row is aborted
    fake.reset(step_delay=0.002)
    full = expected_text(fake, 60)
    assert "world" in full
    for stream in (False, True):
        fake.reset(step_delay=0.002)
        if stream:
            text = "".join(
                c.choices[0].delta.content or ""
                for c in client.chat.completions.create(
                    model=MODEL, messages=HI, max_tokens=60, stop=["xyz", "orld!"], stream=True
                )
                if c.choices
            )
        else:
            r = client.chat.completions.create(
                model=MODEL, messages=HI, max_tokens=60, stop=["xyz", "orld!"]
            )
            assert r.choices[0].finish_reason == "stop"
            text = r.choices[0].message.content
        assert text == full[: full.index("orld!")]
        req_id = fake.submits[0].req_id
        assert fake.wait_until(lambda r=req_id: fake.aborted(r), 2)
        assert req_id not in fake.finished


def test_include_stop_str_in_output(client, fake):
    full = expected_text(fake, 40)
    r = client.chat.completions.create(
        model=MODEL,
        messages=HI,
        max_tokens=40,
        stop="add",
        extra_body={"include_stop_str_in_output": True},
    )
    assert r.choices[0].message.content == full[: full.index("add") + 3]


def test_sampling_params_reach_engine(client, fake):
    client.chat.completions.create(
        model=MODEL,
        messages=HI,
        max_completion_tokens=9,
        temperature=0.3,
        top_p=0.8,
        seed=11,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logit_bias={"17": -100, "42": 5},
        extra_body={
            "top_k": 20,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "stop_token_ids": [3, 4],
            "ignore_eos": True,
        },
    )
    p = fake.submits[0].params
    assert (p.max_tokens, p.temperature, p.top_p, p.seed) == (9, 0.3, 0.8, 11)
    assert (p.presence_penalty, p.frequency_penalty) == (0.5, -0.5)
    assert p.logit_bias == {17: -100.0, 42: 5.0}
    assert (p.top_k, p.min_p, p.repetition_penalty) == (20, 0.05, 1.1)
    assert p.stop_token_ids == (3, 4) and p.ignore_eos
    assert not p.logprobs
    client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=2, top_p=0, extra_body={"top_k": -1}
    )
    p = fake.submits[1].params
    assert (p.temperature, p.top_p, p.top_k) == (0.0, 1.0, 0)  # top_p=0: only the best token


def test_defaults_and_context_cap(client, fake):
    client.chat.completions.create(model=MODEL, messages=HI)
    p = fake.submits[0].params
    ctx = fake.model.context_length
    # no limit in the request and none configured: the whole room the prompt leaves
    assert (p.max_tokens, p.temperature, p.top_p) == (ctx - len(fake.submits[0].prompt_ids), 1.0, 1.0)
    # fits the context alone but not next to this prompt: capped to the room left
    client.chat.completions.create(model=MODEL, messages=HI, max_tokens=ctx)
    n_prompt = len(fake.submits[1].prompt_ids)
    assert fake.submits[1].params.max_tokens == ctx - n_prompt
    # larger than the whole context: refused (as OpenAI does), nothing submitted
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=HI, max_tokens=100_000)
    assert err.value.body["param"] == "max_tokens" and len(fake.submits) == 2


def test_model_field_optional_and_aliases(server, fake):
    for model in (None, MODEL, fake.model.path):
        body = {"messages": HI, "max_tokens": 2} | ({"model": model} if model else {})
        r = httpx.post(server.url + "/v1/chat/completions", json=body)
        assert r.status_code == 200 and r.json()["model"] == MODEL


# -- completions -----------------------------------------------------------------------------


def test_completions_prompt_forms(client, fake):
    r = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=5)
    assert r.choices[0].text == expected_text(fake, 5) and r.object == "text_completion"
    assert fake.submits[-1].prompt_ids == fake.tokenizer.encode("def f(x):")
    r = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=2)
    assert fake.submits[-1].prompt_ids == [5, 6, 7] and len(r.choices) == 1
    fake.reset()
    r = client.completions.create(model=MODEL, prompt=["a", "b", "c"], max_tokens=2, n=2, seed=0)
    assert [c.index for c in r.choices] == list(range(6))
    assert [s.params.seed for s in fake.submits] == [0, 1] * 3
    assert r.usage.prompt_tokens == 3 and r.usage.completion_tokens == 12
    r = client.completions.create(model=MODEL, prompt=[[5, 6], [7]], max_tokens=2)
    assert len(r.choices) == 2


def test_completions_echo(client, fake):
    r = client.completions.create(model=MODEL, prompt="x = ", max_tokens=3, echo=True)
    assert r.choices[0].text == "x = " + expected_text(fake, 3)
    chunks = list(
        client.completions.create(model=MODEL, prompt="x = ", max_tokens=3, echo=True, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    r = client.completions.create(model=MODEL, prompt="x = ", max_tokens=0, echo=True)
    assert r.choices[0].text == "x = " and len(fake.submits) == 2


def test_completions_logprobs(client, fake):
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=30, logprobs=2)
    lp = r.choices[0].logprobs
    text = r.choices[0].text
    assert (
        len(lp.tokens)
        == len(lp.token_logprobs)
        == len(lp.top_logprobs)
        == len(lp.text_offset)
        == 30
    )
    for tok, off, top, lpv in zip(
        lp.tokens, lp.text_offset, lp.top_logprobs, lp.token_logprobs, strict=True
    ):
        if not tok.startswith("bytes:"):
            assert text[off:].startswith(tok)
        assert top[tok] == lpv and 1 <= len(top) <= 2
    streamed = {"tokens": [], "text_offset": []}
    for c in client.completions.create(
        model=MODEL, prompt="x", max_tokens=30, logprobs=2, stream=True
    ):
        if c.choices and c.choices[0].logprobs:
            streamed["tokens"] += c.choices[0].logprobs.tokens
            streamed["text_offset"] += c.choices[0].logprobs.text_offset
    assert streamed == {"tokens": lp.tokens, "text_offset": lp.text_offset}


def test_completions_stream_and_stop(client, fake):
    full = expected_text(fake, 50)
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="x", max_tokens=50, stop=["a + b"], stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == full[: full.index("a + b")]
    assert chunks[-1].choices[0].finish_reason == "stop"


# -- config: defaults from flags, API key, CORS ----------------------------------------------


def test_config_defaults_key_and_cors(fake):
    cfg = ServerConfig(
        api_key="sekrit",
        allowed_origins=["http://ui.example"],
        default_max_tokens=7,
        default_temperature=0.0,
        default_top_p=0.9,
        model_alias="coder",
    )
    with ServerThread(create_app(fake, cfg)) as srv:
        bad = openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as ei:
            bad.chat.completions.create(model="coder", messages=HI)
        assert ei.value.body["code"] == "invalid_api_key"
        assert httpx.get(srv.url + "/health").status_code == 200  # probes need no key
        good = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekrit", max_retries=0)
        r = good.chat.completions.create(model="coder", messages=HI)
        assert r.model == "coder" and r.usage.completion_tokens == 7
        p = fake.submits[-1].params
        assert (p.max_tokens, p.temperature, p.top_p) == (7, 0.0, 0.9)
        r = httpx.post(
            srv.url + "/v1/completions",
            headers={"x-api-key": "sekrit"},
            json={"model": "tinycoder-16m", "prompt": "x", "max_tokens": 1},
        )
        assert r.status_code == 200
        pre = httpx.options(
            srv.url + "/v1/chat/completions",
            headers={
                "Origin": "http://ui.example",
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization,content-type",
            },
        )
        assert pre.status_code == 200
        assert pre.headers["access-control-allow-origin"] == "http://ui.example"
        r = httpx.post(
            srv.url + "/v1/chat/completions",
            headers={"Origin": "http://ui.example"},
            json={"messages": HI},
        )
        assert (
            r.status_code == 401 and r.headers["access-control-allow-origin"] == "http://ui.example"
        )
        assert json.loads(r.text)["error"]["type"] == "authentication_error"
