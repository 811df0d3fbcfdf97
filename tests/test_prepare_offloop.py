"""Request preparation off the event loop (server.prepare): while large prompts are templated
and tokenized, the server keeps answering; a text that cannot fit the context is refused before
the tokenizer sees it."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from server.app import create_app
from server.config import ServerConfig
from server.prompts import ServedModel, max_token_chars
from tests.fake_engine import FakeEngine, ServerThread, load_tokenizer

MODEL = "tinycoder-16m"
ENCODE_SECONDS = 2.0


class SlowTokenizer:
    """The real tokenizer, but `encode` and `decode` take `delay` seconds (the lengths of the
    texts encoded are recorded)."""

    def __init__(self, tok: Any, delay: float = 0.0):
        self._tok = tok
        self.delay = delay
        self.encoded: list[int] = []
        self.started = threading.Semaphore(0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)

    def __len__(self) -> int:
        return len(self._tok)

    def encode(self, text: str, **kw: Any) -> list[int]:
        self.encoded.append(len(text))
        self.started.release()
        time.sleep(self.delay)
        return self._tok.encode(text, **kw)

    def decode(self, ids: Any, **kw: Any) -> str:  # /detokenize (streams use the Rust decoder)
        self.started.release()
        time.sleep(self.delay)
        return self._tok.decode(ids, **kw)


@pytest.fixture
def slow():
    fake = FakeEngine(context_length=64)
    tok = SlowTokenizer(fake.tokenizer)
    fake.model.tokenizer = tok
    fake.reset(script=lambda request: [fake.eos_id])
    with ServerThread(create_app(fake, ServerConfig(prepare_threads=2))) as srv:
        yield srv, tok, fake


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=30)


CHAT = ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
TOKENIZE = ("/tokenize", {"prompt": "def f(x):"})
DETOKENIZE = ("/detokenize", {"tokens": [1, 2, 3]})
ANTHROPIC = ("/v1/messages", {"model": MODEL, "max_tokens": 4,
                              "messages": [{"role": "user", "content": "hi"}]})


@pytest.mark.parametrize("path, body", [CHAT, TOKENIZE, DETOKENIZE, ANTHROPIC])
def test_health_answers_while_prompts_are_prepared(slow, path, body):
    srv, tok, _ = slow
    tok.delay = ENCODE_SECONDS
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(_post, srv.url, path, body) for _ in range(3)]
        assert tok.started.acquire(timeout=10)  # a prompt is being prepared now
        waits = []
        for _ in range(3):  # the median: one probe may lose the CPU on a busy machine
            t0 = time.monotonic()
            assert httpx.get(srv.url + "/health", timeout=30).status_code == 200
            waits.append(time.monotonic() - t0)
        in_flight = not all(f.done() for f in futures)
        assert [f.result().status_code for f in futures] == [200] * 3
    assert sorted(waits)[1] < ENCODE_SECONDS / 2, f"/health waited {waits} s"
    assert in_flight  # the probes ran while prompts were being prepared (3 x 2 s on 2 threads)


def test_preparation_is_bounded_by_the_pool(slow):
    srv, tok, _ = slow
    tok.delay = ENCODE_SECONDS
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(_post, srv.url, *CHAT) for _ in range(3)]
        for _ in range(2):
            assert tok.started.acquire(timeout=10)
        # two threads: the third prompt waits for one of them
        assert not tok.started.acquire(timeout=ENCODE_SECONDS / 2)
        assert [f.result().status_code for f in futures] == [200] * 3
    assert len(tok.encoded) == 3


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "TEXT"}]}),
        ("/v1/completions", {"model": MODEL, "prompt": "TEXT"}),
        ("/v1/completions", {"model": MODEL, "prompt": ["hi", "TEXT"]}),
        ("/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "TEXT"}]}),
        ("/v1/responses", {"model": MODEL, "input": "TEXT"}),
        ("/tokenize", {"prompt": "TEXT"}),
    ],
)
def test_oversized_prompt_is_refused_before_tokenizing(slow, path, body):
    srv, tok, fake = slow
    bound = ServedModel.from_info(fake.model).max_token_chars * fake.context_length
    text = "x" * (bound + 1)
    raw = httpx.post(srv.url + path, content=_fill(body, text), timeout=30,
                     headers={"content-type": "application/json"})
    assert raw.status_code == 400, raw.text
    assert "maximum context length" in raw.text
    assert all(n <= bound for n in tok.encoded)  # the long text never reached the tokenizer
    assert not fake.submits


def _fill(body: dict, text: str) -> bytes:
    import json

    return json.dumps(body).replace("TEXT", text).encode()


def test_a_long_text_under_the_bound_is_tokenized_and_counted(slow):
    srv, tok, fake = slow
    text = "word " * 200
    r = _post(srv.url, "/v1/completions", {"model": MODEL, "prompt": text})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    n = len(tok.encode(text))
    assert n > fake.context_length and f"your prompt has {n} tokens" in r.json()["error"]["message"]
    assert tok.encoded[0] == len(text)


def test_max_token_chars_bounds_the_text_of_every_token():
    tok = load_tokenizer()
    limit = max_token_chars(tok)
    assert limit >= max(len(tok.decode([i])) for i in range(len(tok)))
    for text in ("#" + "-" * 500, "🎉" * 300, "  \n\t" * 200, "héllo 世界 " * 50):
        assert len(text) <= limit * len(tok.encode(text, add_special_tokens=False))


def test_tokenizers_that_drop_input_have_no_bound():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()  # "a      a" is two tokens
    assert max_token_chars(PreTrainedTokenizerFast(tokenizer_object=raw)) == 0
