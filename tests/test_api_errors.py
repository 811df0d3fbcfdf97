"""Every bad input gets its OpenAI error body and status, never a 500; the server keeps serving."""

from __future__ import annotations

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.api import EngineError
from server.app import create_app
from server.config import ServerConfig
from tests.fake_engine import FakeEngine, ServerThread

MODEL = "tinycoder-16m"
HI = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"


@pytest.fixture(scope="module")
def fake():
    return FakeEngine(context_length=64)


@pytest.fixture(scope="module")
def server(fake):
    with ServerThread(create_app(fake, ServerConfig(max_request_bytes=64 * 1024))) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=10) as c:
        yield c


@pytest.fixture(autouse=True)
def _fresh(fake):
    fake.reset()


def check_error(r: httpx.Response, status: int, *, param=None, code=None, type=None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    assert err["type"] == (type or ("invalid_request_error" if status < 500 else "server_error"))
    return err


def assert_still_serving(http):
    r = http.post(CHAT, json={"model": MODEL, "messages": HI, "max_tokens": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    r = http.post(COMP, json={"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": True})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")


def chat(**kw):
    return {"model": MODEL, "messages": HI, **kw}


def comp(**kw):
    return {"model": MODEL, "prompt": "x", **kw}


BAD_JSON = [
    b"{",
    b"not json",
    b'{"messages": [}',
    b"",
    b"   ",
    b"[1, 2]",
    b'"hi"',
    b"null",
    b"\xff\xfe",
]


@pytest.mark.parametrize("path", [CHAT, COMP])
@pytest.mark.parametrize("raw", BAD_JSON)
def test_malformed_json(http, path, raw):
    r = http.post(path, content=raw, headers={"content-type": "application/json"})
    check_error(r, 400, code="invalid_json")


BAD_BODIES = [
    # (path, body, param, code)
    (CHAT, {"model": MODEL}, "messages", "missing_required_parameter"),
    (COMP, {"model": MODEL}, "prompt", "missing_required_parameter"),
    (CHAT, chat(messages=[]), "messages", None),
    (CHAT, chat(messages="hi"), "messages", None),
    (CHAT, chat(messages=[{"content": "x"}]), "messages[0].role", "missing_required_parameter"),
    (CHAT, chat(messages=[{"role": "bot", "content": "x"}]), "messages[0].role", None),
    (CHAT, chat(messages=[{"role": "user", "content": 5}]), "messages[0].content", None),
    (
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "text"}]}]),
        "messages[0].content[0]",
        None,
    ),
    (
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "video"}]}]),
        "messages[0].content[0]",
        None,
    ),
    (CHAT, chat(temperature="hot"), "temperature", "invalid_value"),
    (CHAT, chat(temperature=2.5), "temperature", "invalid_value"),
    (CHAT, chat(temperature=-0.1), "temperature", "invalid_value"),
    (CHAT, chat(top_p=1.5), "top_p", None),
    (CHAT, chat(top_k=-5), "top_k", None),
    (CHAT, chat(min_p=2), "min_p", None),
    (CHAT, chat(repetition_penalty=0), "repetition_penalty", None),
    (CHAT, chat(presence_penalty=3), "presence_penalty", None),
    (CHAT, chat(frequency_penalty=-2.5), "frequency_penalty", None),
    (CHAT, chat(max_tokens="10"), "max_tokens", None),
    (CHAT, chat(max_tokens=-1), "max_tokens", None),
    (CHAT, chat(max_tokens=0), "max_tokens", None),
    (CHAT, chat(max_completion_tokens=1.5), "max_completion_tokens", None),
    (CHAT, chat(n=0), "n", None),
    (CHAT, chat(n=17), "n", None),
    (CHAT, chat(n=True), "n", None),
    (CHAT, chat(stream="yes"), "stream", None),
    (
        CHAT,
        chat(stream=True, stream_options={"include_usage": "yes"}),
        "stream_options.include_usage",
        None,
    ),
    (CHAT, chat(seed="1"), "seed", None),
    (CHAT, chat(seed=2**70), "seed", None),
    (CHAT, chat(stop=[1, 2]), "stop", None),
    (CHAT, chat(stop=""), "stop", None),
    (CHAT, chat(stop=[str(i) for i in range(17)]), "stop", None),
    (CHAT, chat(stop_token_ids=[10**9]), "stop_token_ids", None),
    (CHAT, chat(stop_token_ids="3"), "stop_token_ids", None),
    (CHAT, chat(logit_bias={"5": 101}), "logit_bias", None),
    (CHAT, chat(logit_bias={"abc": 1}), "logit_bias", None),
    (CHAT, chat(logit_bias={"99999": 1}), "logit_bias", None),
    (CHAT, chat(logit_bias=[1]), "logit_bias", None),
    (CHAT, chat(logprobs=1), "logprobs", None),
    (CHAT, chat(logprobs=True, top_logprobs=21), "top_logprobs", None),
    (CHAT, chat(top_logprobs=2), "top_logprobs", None),
    (CHAT, chat(chat_template_kwargs=[1]), "chat_template_kwargs", None),
    (CHAT, chat(continue_final_message=True), "continue_final_message", None),
    (CHAT, chat(prediction={"type": "text", "content": "x"}), "prediction", None),
    (CHAT, chat(prediction={"type": "content"}), "prediction", None),
    (CHAT, chat(prediction={"type": "content", "content": [{"type": "image_url"}]}),
     "prediction.content", None),
    (CHAT, chat(prediction="x"), "prediction", None),
    (COMP, comp(prompt=[]), "prompt", None),
    (COMP, comp(prompt=5), "prompt", None),
    (COMP, comp(prompt=[1, "a"]), "prompt", None),
    (COMP, comp(prompt=[[1], []]), "prompt", None),
    (COMP, comp(prompt=[-1]), "prompt", None),
    (COMP, comp(prompt=[10**6]), "prompt", None),
    (COMP, comp(prompt=""), "prompt", "empty_prompt"),
    (COMP, comp(logprobs=6), "logprobs", None),
    (COMP, comp(logprobs=True), "logprobs", None),
    (COMP, comp(echo="yes"), "echo", None),
    (COMP, comp(max_tokens=0), "max_tokens", None),
    (COMP, comp(prompt=["x"] * 9, n=16), "n", None),
]


@pytest.mark.parametrize(
    "path,body,param,code", BAD_BODIES, ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD_BODIES)]
)
def test_bad_values_are_400(http, fake, path, body, param, code):
    check_error(http.post(path, json=body), 400, param=param, code=code)
    assert not fake.submits  # nothing reached the engine


UNSUPPORTED = [
    (CHAT, chat(modalities=["text", "audio"]), "modalities"),
    (COMP, comp(suffix="pass"), "suffix"),
    (COMP, comp(best_of=3), "best_of"),
]


@pytest.mark.parametrize("path,body,param", UNSUPPORTED, ids=[u[2] for u in UNSUPPORTED])
def test_unsupported_fields_say_so(http, path, body, param):
    err = check_error(http.post(path, json=body), 400, param=param, code="unsupported_parameter")
    assert "not supported" in err["message"]


def test_neutral_values_of_unsupported_fields_are_fine(http):
    ok = chat(
        max_tokens=2,
        tools=[{"type": "function", "function": {"name": "f"}}],
        tool_choice="none",
        response_format={"type": "text"},
        modalities=["text"],
        user="u",
        store=False,
        metadata={"a": "b"},
        service_tier="auto",
        parallel_tool_calls=False,
        unknown_field=1,
    )
    assert http.post(CHAT, json=ok).status_code == 200
    assert http.post(COMP, json=comp(max_tokens=2, best_of=1, suffix=None)).status_code == 200


def test_image_input_rejected(http):
    body = chat(
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is this"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                ],
            }
        ]
    )
    err = check_error(
        http.post(CHAT, json=body), 400, param="messages[0].content[1]", code="unsupported_content"
    )
    assert "vision" in err["message"]


def test_unknown_model_is_404(server, http):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError) as ei:
        client.chat.completions.create(model="gpt-4o", messages=HI)
    assert ei.value.body["code"] == "model_not_found" and ei.value.body["param"] == "model"
    check_error(http.post(COMP, json=comp(model="nope")), 404, code="model_not_found")
    check_error(http.get("/v1/models/nope"), 404, code="model_not_found")


def test_prompt_longer_than_context(server, http, fake):
    long_text = "word " * 200  # > 64 tokens
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": long_text}]
        )
    assert ei.value.body["code"] == "context_length_exceeded"
    check_error(
        http.post(COMP, json=comp(prompt=long_text, stream=True)),
        400,
        code="context_length_exceeded",
    )
    check_error(
        http.post(COMP, json=comp(prompt=list(range(64)))), 400, code="context_length_exceeded"
    )
    assert not fake.submits
    assert_still_serving(http)


def test_engine_errors_keep_their_status(http, fake):
    fake.reset(submit_error=EngineError("too many stop ids", status=422, code="bad_params"))
    check_error(http.post(CHAT, json=chat()), 422, code="bad_params")
    check_error(http.post(CHAT, json=chat(stream=True)), 422, code="bad_params")


def test_overloaded_is_429_with_retry_after(server, http, fake):
    fake.reset(overloaded=True)
    r = http.post(CHAT, json=chat(stream=True))
    check_error(r, 429, code="overloaded", type="rate_limit_error")
    assert r.headers["retry-after"] == "3"
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model=MODEL, prompt="x")
    fake.reset()
    assert_still_serving(http)


def test_n_rows_all_aborted_when_one_is_refused(http, fake):
    calls = {"n": 0}
    real_submit = fake.submit

    async def flaky(request):
        calls["n"] += 1
        if calls["n"] == 3:
            raise EngineError("no room", status=429, code="overloaded")
        return await real_submit(request)

    fake.submit = flaky
    try:
        check_error(http.post(CHAT, json=chat(n=4)), 429, type="rate_limit_error")
    finally:
        del fake.submit
    assert sorted(r for r, _ in fake.aborts) == sorted(s.req_id for s in fake.submits)


def test_body_too_large_is_413(server, http):
    big = chat(messages=[{"role": "user", "content": "x" * 70_000}])
    check_error(http.post(CHAT, json=big), 413, code="request_too_large")

    def chunked():
        yield b'{"model": "tinycoder-16m", "prompt": "'
        for _ in range(40):
            yield b"y" * 4096
        yield b'"}'

    r = httpx.post(
        server.url + COMP, content=chunked(), headers={"content-type": "application/json"}
    )
    check_error(r, 413, code="request_too_large")
    assert_still_serving(http)


def test_unknown_route_and_method(http):
    check_error(http.get("/v1/nothing"), 404, code="not_found")
    check_error(http.get(CHAT), 405)


def test_a_bug_is_a_json_500_and_the_server_survives(http, fake):
    fake.reset(submit_error=RuntimeError("boom"))
    err = check_error(http.post(CHAT, json=chat()), 500)
    assert "boom" not in err["message"]  # no internals leak
    check_error(http.post(COMP, json=comp(stream=True)), 500)
    fake.reset()
    assert_still_serving(http)


def test_a_bug_mid_stream_ends_the_stream_cleanly(http, fake):
    fake.reset(script=lambda request: [5, 6, 7, "not a token id"])
    r = http.post(CHAT, json=chat(max_tokens=10, stream=True))
    assert r.status_code == 200
    lines = [ln for ln in r.text.splitlines() if ln]
    assert '"internal_error"' in lines[-2] and lines[-1] == "data: [DONE]"
    fake.wait_until(lambda: fake.stats().num_running == 0)
    check_error(http.post(CHAT, json=chat(max_tokens=10)), 500, code="internal_error")
    fake.reset()
    assert_still_serving(http)


def test_engine_failure_mid_generation(http, fake):
    fake.reset(fail_after=3)
    err = check_error(http.post(CHAT, json=chat(max_tokens=10)), 500, code="generation_failed")
    assert "fake engine failure" in err["message"]
    r = http.post(CHAT, json=chat(max_tokens=10, stream=True))
    assert r.status_code == 200
    lines = [ln for ln in r.text.splitlines() if ln]
    assert '"error"' in lines[-2] and lines[-1] == "data: [DONE]"
    fake.reset()
    assert_still_serving(http)


def test_good_request_after_every_kind_of_bad_one(http):
    for raw in BAD_JSON[:3]:
        http.post(CHAT, content=raw)
    for path, body, *_ in BAD_BODIES[::5] + UNSUPPORTED:
        assert http.post(path, json=body).status_code in (400, 404)
    assert_still_serving(http)


FIELDS = [
    "model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p",
    "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias",
    "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "top_logprobs", "n", "stream",
    "stream_options", "echo", "chat_template_kwargs", "tools", "response_format", "best_of",
]  # fmt: skip
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**65), 2**65) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)  # fmt: skip
MESSAGES = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "tool", "x"])},
        optional={"content": st.one_of(st.text(max_size=10), JSON_VALUES)},
    ),
    max_size=3,
)


@settings(
    max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    path=st.sampled_from([CHAT, COMP]),
    body=st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, max_size=6),
    messages=st.none() | MESSAGES,
)
def test_fuzzed_bodies_never_500(http, fake, path, body, messages):
    fake.reset()
    if messages is not None:
        body["messages"] = messages
    for key in ("max_tokens", "max_completion_tokens"):  # keep the fake's work small
        value = body.get(key)
        if value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 3):
            body[key] = 3
    r = http.post(path, json=body)
    assert r.status_code in (200, 400, 404), r.text
    if r.status_code != 200:
        check_error(r, r.status_code)
