"""With no output limit anywhere (request or `--max-tokens`), the real engine on the bundled
model admits requests whose limit is the whole room the prompt leaves, and runs them to the end
of the context (server.params: the limit is that room; the engine reserves KV for it)."""

from __future__ import annotations

import httpx

MODEL = "tinycoder-16m"
ROOM = 12  # small to keep CPU runs short (tests/test_request_params.py: a room above 512)


def test_a_long_prompt_without_a_limit_runs_to_the_end_of_the_context(real_server, real_engine):
    ctx = real_engine.model.context_length
    code = "def add(a, b):\n    return a + b\n\n"
    ids = real_engine.model.tokenizer.encode(code * (ctx // 4), add_special_tokens=False)
    ids = ids[: ctx - ROOM]
    assert len(ids) == ctx - ROOM
    body = {"model": MODEL, "prompt": ids, "temperature": 0, "ignore_eos": True}
    r = httpx.post(real_server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == ROOM


def test_a_short_prompt_without_a_limit_is_admitted(real_server):
    """Its limit is nearly the whole context: the reservation must still fit, not be a 413."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long program."}],
            "stream": True, "temperature": 0}
    with httpx.stream("POST", real_server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        chunks = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                chunks.append(line)
            if len(chunks) >= 3:
                break
    assert all('"error"' not in c for c in chunks), chunks
