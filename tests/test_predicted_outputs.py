"""Predicted outputs (OpenAI's chat `prediction`) through the real app on the bundled model: a
lookup drafter copies drafts from the prediction, the answer is what it is without one, and
usage counts the prediction's accepted and rejected tokens; without speculation the prediction
is accepted and unused."""

from __future__ import annotations

import json

import httpx
import pytest

from engine.core import AsyncEngine, Engine, EngineConfig
from engine.loader import load_model
from engine.scheduler import SchedulerConfig
from engine.spec import SpecConfig
from server.app import create_app
from server.config import ServerConfig
from tests.fake_engine import ServerThread

MESSAGES = [{"role": "user", "content": "Write a Python function that reverses a string."}]


def _chat(url: str, model: str, **kw) -> dict:
    body = dict(model=model, messages=MESSAGES, max_tokens=48, temperature=0.0, **kw)
    r = httpx.post(url + "/v1/chat/completions", timeout=120, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _streamed(url: str, model: str, **kw) -> tuple[str, dict]:
    body = dict(model=model, messages=MESSAGES, max_tokens=48, temperature=0.0, stream=True,
                stream_options={"include_usage": True}, **kw)
    text, usage = "", None
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=120, json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                for c in chunk["choices"]:
                    text += c["delta"].get("content") or ""
                usage = chunk.get("usage") or usage
    assert usage is not None
    return text, usage


@pytest.mark.parametrize("spec", [SpecConfig("ngram", num_draft_tokens=4, adaptive=False),
                                  SpecConfig("prediction", num_draft_tokens=4, adaptive=False), None],
                         ids=["ngram", "prediction", "no-speculation"])
def test_a_predicted_output_leaves_the_answer_unchanged_and_is_counted(tinycoder_path, spec):
    lm = load_model(str(tinycoder_path), dtype="float32")
    engine = Engine(lm, EngineConfig(SchedulerConfig(), spec=spec))
    client = AsyncEngine(engine)
    client.start()
    try:
        with ServerThread(create_app(client, ServerConfig())) as srv:
            model = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]
            plain = _chat(srv.url, model)
            if spec is not None and spec.method == "prediction":  # no prediction: nothing drafted
                assert client.stats().spec.spec_steps == 0
            answer = plain["choices"][0]["message"]["content"]
            assert "completion_tokens_details" not in plain["usage"]
            n_pred = len(lm.tokenizer.encode(answer, add_special_tokens=False))
            half = len(answer) // 2
            parts = [{"type": "text", "text": answer[:half]}, {"type": "text", "text": answer[half:]}]
            for prediction in (answer, parts):
                got = _chat(srv.url, model, prediction={"type": "content", "content": prediction})
                assert got["choices"][0]["message"]["content"] == answer
                details = got["usage"]["completion_tokens_details"]
                accepted = details["accepted_prediction_tokens"]
                assert accepted + details["rejected_prediction_tokens"] == n_pred
                if spec is None:
                    assert accepted == 0
                else:  # every round verifies the prediction's next 4 tokens: most are accepted
                    assert accepted >= 0.7 * n_pred, details
            text, usage = _streamed(srv.url, model,
                                    prediction={"type": "content", "content": answer})
            assert text == answer
            assert usage["completion_tokens_details"]["accepted_prediction_tokens"] == accepted
            assert got["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]
            # a prediction longer than the context counts (and is used) up to the context length
            huge = _chat(srv.url, model, prediction={"type": "content", "content": "x = 1\n" * 20000})
            details = huge["usage"]["completion_tokens_details"]
            assert sum(details.values()) == lm.context_length
        stats = client.stats()
    finally:
        client.stop()
    if spec is not None:
        assert stats.spec is not None and stats.spec.accepted_tokens >= 2 * accepted
