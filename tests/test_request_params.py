"""One request → SamplingParams conversion for OpenAI, Anthropic and Responses (server.params):
the same request gives the same engine parameters on every API, defaults come from the server's
config (the CLI's flags), the output limit is capped by the room the prompt leaves (and is that
room when nobody set one), and a bad prompt is a 400 before the engine sees anything."""

from __future__ import annotations

from dataclasses import asdict

import httpx
import pytest

from engine.api import SamplingParams
from server.app import create_app
from server.config import ServerConfig
from server.errors import APIError
from server.params import SamplingRequest, build_params, output_limit
from server.prompts import ServedModel
from tests.fake_engine import FakeEngine, ServerThread

MODEL = "tinycoder-16m"
CTX = 2048  # larger than 512 + a prompt: the room is not a fixed default in disguise
CONFIG = ServerConfig(default_temperature=0.4, default_top_p=0.7)  # as --temp 0.4 --top-p 0.7


@pytest.fixture(scope="module")
def fake():
    return FakeEngine(context_length=CTX)


@pytest.fixture(scope="module")
def server(fake):
    with ServerThread(create_app(fake, CONFIG)) as s:
        yield s


@pytest.fixture(autouse=True)
def _fresh(fake):
    fake.reset(script=lambda request: [fake.eos_id])  # every answer is empty: fast


def _chat(url: str, limit: int | None = None, **extra: object) -> httpx.Response:
    body: dict = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}
    if limit is not None:
        body["max_tokens"] = limit
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=10)


def _anthropic(url: str, limit: int, **extra: object) -> httpx.Response:
    body = {"model": MODEL, "max_tokens": limit, "messages": [{"role": "user", "content": "hi"}], **extra}
    return httpx.post(url + "/v1/messages", json=body, timeout=10)


def _responses(url: str, limit: int | None = None, **extra: object) -> httpx.Response:
    body: dict = {"model": MODEL, "input": [{"role": "user", "content": "hi"}], **extra}
    if limit is not None:
        body["max_output_tokens"] = limit
    return httpx.post(url + "/v1/responses", json=body, timeout=10)


def _sent(fake: FakeEngine) -> tuple[list[int], SamplingParams]:
    assert len(fake.submits) == 1, fake.submits
    request = fake.submits[0]
    fake.submits.clear()
    return request.prompt_ids, request.params


def test_the_three_apis_give_the_same_params(fake, server):
    sent = []
    for call in (_chat, _anthropic, _responses):
        r = call(server.url, 9)
        assert r.status_code == 200, r.text
        sent.append(_sent(fake))
    (ids, chat), (a_ids, anthropic), (r_ids, responses) = sent
    assert ids == a_ids == r_ids
    assert asdict(chat) == asdict(anthropic) == asdict(responses)
    # what the request left out comes from the config: Anthropic's top_p included
    assert (chat.temperature, chat.top_p, chat.max_tokens, chat.seed) == (0.4, 0.7, 9, None)
    assert (chat.top_k, chat.min_p, chat.stop_token_ids, chat.logit_bias) == (0, 0.0, (), {})
    # fields a request does set win over the config, the same on every API
    for call in (_chat, _anthropic, _responses):
        assert call(server.url, 5, temperature=0.9, top_p=0.5).status_code == 200
        p = _sent(fake)[1]
        assert (p.temperature, p.top_p, p.max_tokens) == (0.9, 0.5, 5)


def test_no_limit_means_the_room_left(fake, server):
    for call in (_chat, _responses):  # Anthropic's max_tokens is required
        assert call(server.url).status_code == 200
        ids, p = _sent(fake)
        assert p.max_tokens == CTX - len(ids)


def test_configured_max_tokens_is_the_default(fake):
    with ServerThread(create_app(fake, ServerConfig(default_max_tokens=7))) as srv:
        for call in (_chat, _responses):
            assert call(srv.url).status_code == 200
            assert _sent(fake)[1].max_tokens == 7
            assert call(srv.url, 11).status_code == 200  # the request's own limit wins
            assert _sent(fake)[1].max_tokens == 11
        assert _anthropic(srv.url, 11).status_code == 200
        assert _sent(fake)[1].max_tokens == 11


def test_limits_are_capped_by_the_room(fake, server):
    for call in (_chat, _anthropic, _responses):
        assert call(server.url, CTX - 1).status_code == 200
        ids, p = _sent(fake)
        assert p.max_tokens == CTX - len(ids)
    # above the whole context: OpenAI refuses (as OpenAI does); Anthropic and Responses clients
    # send limits sized for other models, which are capped
    r = _chat(server.url, CTX + 1)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert not fake.submits
    r = _chat(server.url, None, max_completion_tokens=CTX + 1)
    assert r.json()["error"]["param"] == "max_completion_tokens"
    for call in (_anthropic, _responses):
        assert call(server.url, 100_000).status_code == 200
        ids, p = _sent(fake)
        assert p.max_tokens == CTX - len(ids)


@pytest.mark.parametrize(
    "prompt, code",
    [
        ([1, 2, 999_999], None),  # outside the vocabulary
        ([1, -3], None),
        ([5] * CTX, "context_length_exceeded"),  # leaves no room
    ],
)
def test_bad_prompt_ids_never_reach_the_engine(fake, server, prompt, code):
    for stream in (False, True):
        r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": prompt,
                                                             "stream": stream}, timeout=10)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "prompt" and err["code"] == code
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": [[1, 2], prompt]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt[1]"
    assert not fake.submits


def test_long_chat_prompts_never_reach_the_engine(fake, server):
    long = "word " * CTX
    r = _chat(server.url, None, messages=[{"role": "user", "content": long}])
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    body = {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": long}]}
    r = httpx.post(server.url + "/v1/messages", json=body)
    assert r.status_code == 400 and "context length" in r.json()["error"]["message"]
    r = _responses(server.url, None, input=long)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    assert not fake.submits


def test_bad_vocabulary_fields_are_400(fake, server):
    for extra, param in (({"logit_bias": {"99999": 1}}, "logit_bias"),
                         ({"logit_bias": {"x": 1}}, "logit_bias"),
                         ({"stop_token_ids": [99999]}, "stop_token_ids"),
                         ({"max_tokens": 0}, "max_tokens")):
        r = _chat(server.url, None, **extra)
        assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert not fake.submits


# -- the conversion alone ------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(fake):
    return ServedModel.from_info(fake.model)


@pytest.mark.parametrize(
    "requested, default, prompt, want",
    [
        (None, None, 12, CTX - 12),  # nobody set a limit: the room
        (None, 100, 12, 100),  # --max-tokens
        (None, 100, CTX - 30, 30),  # --max-tokens, capped by the room
        (40, 100, 12, 40),  # the request's own
        (CTX, None, 12, CTX - 12),  # capped by the room
    ],
)
def test_output_limit(requested, default, prompt, want):
    req = SamplingRequest(max_tokens=requested)
    assert output_limit(req, ServerConfig(default_max_tokens=default), CTX, prompt) == want


def test_build_params_checks_the_prompt_once_here(served):
    with pytest.raises(APIError) as err:
        build_params(SamplingRequest(), CONFIG, served, [], "messages")
    assert (err.value.param, err.value.code) == ("messages", "empty_prompt")
    with pytest.raises(APIError) as err:
        build_params(SamplingRequest(), CONFIG, served, [served.vocab_size])
    assert "outside the vocabulary" in err.value.message
    p = build_params(SamplingRequest(top_p=0.0, seed=3), CONFIG, served, [1, 2, 3])
    assert (p.temperature, p.top_p, p.seed, p.max_tokens) == (0.0, 1.0, 3, CTX - 3)
