"""Responses API token logprobs (`include: ["message.output_text.logprobs"]`, `top_logprobs`)
over real HTTP with the bundled model: the output text's entries are chat completions' own for
the same greedy request, a stream's delta entries add up to the final part's, and without the
include no entries are sent."""

from __future__ import annotations

import json

import httpx
import pytest

MODEL = "tinycoder-16m"
PROMPT = "Write a Python function that returns the square of a number."
INCLUDE = ["message.output_text.logprobs"]


def _responses(url: str, **extra) -> dict:
    body = {"model": MODEL, "input": PROMPT, "temperature": 0, "max_output_tokens": 24, **extra}
    r = httpx.post(url + "/v1/responses", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_output_text_logprobs_are_chat_completions_own(real_server):
    resp = _responses(real_server.url, include=INCLUDE, top_logprobs=3)
    assert resp["top_logprobs"] == 3
    part = resp["output"][-1]["content"][0]
    chat = httpx.post(real_server.url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "temperature": 0,
        "max_tokens": 24, "logprobs": True, "top_logprobs": 3}).json()["choices"][0]
    assert part["text"] == chat["message"]["content"].strip()
    got, want = part["logprobs"], chat["logprobs"]["content"]
    assert len(got) == resp["usage"]["output_tokens"] == len(want) > 0
    for g, w in zip(got, want, strict=True):
        assert g["token"] == w["token"] and g["bytes"] == w["bytes"]
        assert g["logprob"] == pytest.approx(w["logprob"], abs=1e-4)
        assert [t["token"] for t in g["top_logprobs"]] == [t["token"] for t in w["top_logprobs"]]
        assert len(g["top_logprobs"]) == 3


def test_streamed_deltas_carry_the_entries_and_add_up_to_the_part(real_server):
    body = {"model": MODEL, "input": PROMPT, "temperature": 0, "max_output_tokens": 24,
            "include": INCLUDE, "top_logprobs": 2, "stream": True}
    deltas, final = [], None
    with httpx.stream("POST", real_server.url + "/v1/responses", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                ev = json.loads(line[6:])
                if ev["type"] == "response.output_text.delta":
                    deltas.append(ev["logprobs"])
                elif ev["type"] == "response.completed" or ev["type"] == "response.incomplete":
                    final = ev["response"]
    assert final is not None and deltas
    part = final["output"][-1]["content"][0]
    assert [e for d in deltas for e in d] == part["logprobs"]
    assert part["logprobs"] == _responses(real_server.url, include=INCLUDE, top_logprobs=2)[
        "output"][-1]["content"][0]["logprobs"]


def test_no_entries_without_the_include(real_server):
    resp = _responses(real_server.url, top_logprobs=2)
    assert "logprobs" not in resp["output"][-1]["content"][0]
    r = httpx.post(real_server.url + "/v1/responses", timeout=30,
                   json={"model": MODEL, "input": PROMPT, "top_logprobs": 21})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
