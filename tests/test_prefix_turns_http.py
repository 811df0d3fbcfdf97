"""Multi-turn chat over real HTTP with the bundled model (the real app on uvicorn, the real
engine): each turn re-sends the whole conversation with the previous answer as returned; turn
n+1 reports `cached_tokens` at least turn n's prompt plus its answer (whole blocks), and every
turn's greedy answer equals the answer with the prefix cache off."""

from __future__ import annotations

from typing import Any

import httpx

from engine.core import AsyncEngine, Engine, EngineConfig
from engine.loader import load_model
from engine.scheduler import SchedulerConfig
from server.app import create_app
from server.config import ServerConfig
from tests.fake_engine import ServerThread

BLOCK = 16
QUESTIONS = [
    "Write a Python function that returns the sum of a list.",
    "Now make it skip None values.",
    "Add a docstring and type hints.",
    "Write a test for it.",
]


def _conversation(lm: Any, prefix_bytes: int) -> list[dict[str, Any]]:
    """Run the turns; returns per turn: answer text, usage, and (last turn) Anthropic usage."""
    engine = Engine(lm, EngineConfig(SchedulerConfig(), prefix_cache_bytes=prefix_bytes,
                                     prefix_block_size=BLOCK))
    client = AsyncEngine(engine)
    client.start()
    turns: list[dict[str, Any]] = []
    try:
        with ServerThread(create_app(client, ServerConfig())) as srv:
            model = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]
            messages: list[dict[str, str]] = [
                {"role": "system", "content": "You write short, correct Python."}]
            for q in QUESTIONS:
                messages.append({"role": "user", "content": q})
                r = httpx.post(srv.url + "/v1/chat/completions", timeout=300, json=dict(
                    model=model, messages=messages, max_tokens=40, temperature=0.0))
                assert r.status_code == 200, r.text
                body = r.json()
                answer = body["choices"][0]["message"]["content"]
                messages.append({"role": "assistant", "content": answer})
                turns.append({"answer": answer, "usage": body["usage"]})
            # the same history once more through the Anthropic API
            r = httpx.post(srv.url + "/v1/messages", timeout=300, json=dict(
                model=model, max_tokens=8, temperature=0.0, system=messages[0]["content"],
                messages=[*messages[1:], {"role": "user", "content": "Thanks."}]))
            assert r.status_code == 200, r.text
            turns.append({"anthropic": r.json()["usage"]})
    finally:
        client.stop()
    return turns


def test_next_turn_hits_through_the_previous_answer_and_answers_as_without_cache(tinycoder_path):
    lm = load_model(str(tinycoder_path), dtype="float32")
    got = _conversation(lm, 64 << 20)
    chat = got[:-1]
    for prev, turn in zip(chat, chat[1:], strict=False):
        seen = prev["usage"]["prompt_tokens"] + prev["usage"]["completion_tokens"]
        cached = turn["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert seen // BLOCK * BLOCK <= cached < turn["usage"]["prompt_tokens"], (prev, turn)
    last = chat[-1]["usage"]
    anthropic = got[-1]["anthropic"]
    assert anthropic["cache_read_input_tokens"] >= (
        last["prompt_tokens"] + last["completion_tokens"]) // BLOCK * BLOCK
    assert anthropic["input_tokens"] > 0

    ref = _conversation(lm, 0)
    assert [t["answer"] for t in chat] == [t["answer"] for t in ref[:-1]]
    assert all(t["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 for t in ref[:-1])
    assert [t["usage"]["prompt_tokens"] for t in chat] == [t["usage"]["prompt_tokens"]
                                                         for t in ref[:-1]]
