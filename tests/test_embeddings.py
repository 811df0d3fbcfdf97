"""POST /v1/embeddings: last-token pooling on the engine thread (engine.embed), the route's
shapes and errors (server.embeddings), and the OpenAI SDK against the real engine."""

from __future__ import annotations

import asyncio
import base64
import json
import threading

import httpx
import mlx.core as mx
import numpy as np
import openai
import pytest
from mlx_lm.models.cache import make_prompt_cache

from engine.api import EmbeddingRequest, EngineError
from engine.core import AsyncEngine, Engine, EngineConfig
from engine.embed import Embedder, normalise
from engine.kv.memory import MemoryBudget
from engine.loader import load_model
from engine.scheduler import SchedulerConfig
from server.app import create_app
from server.config import ServerConfig
from tests.fake_engine import FakeEngine, ServerThread
from tests.tiny_models import VOCAB, tiny_model

MODEL = "tinycoder-16m"
TEXTS = ["hello", "def add(a, b):\n    return a + b\n" * 4, "a much longer input " * 30, "x = 1"]


# -- the pooling itself, on tiny random models ------------------------------------------------


def _embedder(arch: str, **kw) -> tuple[Embedder, object]:
    model, cfg = tiny_model(arch)
    budget = MemoryBudget.for_model(model, None, {})
    return Embedder(model, cfg, cfg["max_position_embeddings"], VOCAB, budget, **kw), model


def _rows(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, VOCAB, n).tolist() for n in lengths]


@pytest.mark.parametrize("arch", ["qwen3", "llama", "gemma3_text"])
def test_batched_equals_alone_and_the_incremental_hidden_state(arch):
    """Each row's vector inside a right-padded batch of different lengths (longer than the
    llama/gemma sliding window of 24) equals the row alone, and equals the final hidden state of
    its last token computed one token at a time through mlx-lm's own caches (float32)."""
    emb, model = _embedder(arch)
    rows = _rows(1, [5, 40, 1, 17, 33])
    batched = normalise(emb.forward(rows))
    for row, got in zip(rows, batched, strict=True):
        alone = normalise(emb.forward([row]))[0]
        np.testing.assert_allclose(got, alone, rtol=0, atol=1e-5)
        cache = make_prompt_cache(model)
        for t in row:  # the reference: one token per forward, KV through the cache
            h = model.model(mx.array([[t]]), cache=cache)
        ref = normalise(np.array(h[:, -1].astype(mx.float32)))[0]
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5)
    assert batched.dtype == np.float32 and batched.shape == (5, 64)
    np.testing.assert_allclose(np.linalg.norm(batched, axis=1), 1.0, atol=1e-6)


def test_batches_are_bounded_by_tokens_and_by_the_memory_left():
    emb, _ = _embedder("qwen3", max_batch_tokens=64)
    done: list = []
    from engine.embed import EmbedJob

    job = EmbedJob(EmbeddingRequest("a", _rows(2, [10, 10, 10, 10, 10, 10, 10, 30])),
                   lambda r, e: done.append((r, e)))
    emb.add(job)
    room = emb.budget.budget - emb.budget.weights
    picks = emb._pick(room, decoding=True)
    assert len(picks) == 6  # 6 x 10 tokens <= 64 < 7 x 10
    # with the running rows' KV leaving room for two rows of 10 tokens only
    job.next = 0
    picks = emb._pick(emb.batch_bytes(2, 10), decoding=True)
    assert len(picks) == 2
    # no room at all: while rows decode the batch waits; alone a row always runs
    job.next = 0
    assert emb._pick(0, decoding=True) == []
    assert len(emb._pick(0, decoding=False)) == 1
    # the job ends once every row has run, with its inputs' vectors in input order
    job.next = 0
    while emb.step(0, decoding=False):
        pass
    (result, error), = done
    assert error is None and result.vectors.shape == (8, 64) and result.num_prompt_tokens == 100
    np.testing.assert_allclose(result.vectors[7], normalise(emb.forward([job.request.inputs[7]]))[0],
                               atol=1e-5)


def test_matryoshka_dimensions_are_declared_in_the_config():
    emb, _ = _embedder("qwen3")
    req = EmbeddingRequest("a", _rows(3, [4]), dimensions=16)
    with pytest.raises(EngineError) as exc:
        emb.check(req)
    assert exc.value.status == 400 and "matryoshka_dimensions" in exc.value.message
    emb.check(EmbeddingRequest("a", _rows(3, [4]), dimensions=64))  # its own size: always
    emb.matryoshka = (16, 32)
    emb.check(req)
    with pytest.raises(EngineError, match="one of 16, 32"):
        emb.check(EmbeddingRequest("a", _rows(3, [4]), dimensions=20))
    full = emb.forward(req.inputs)
    cut = normalise(full, 16)
    assert cut.shape == (1, 16)
    np.testing.assert_allclose(cut[0], full[0, :16] / np.linalg.norm(full[0, :16]), atol=1e-6)


def test_refusals_before_anything_is_queued():
    emb, _ = _embedder("qwen3")
    cases = {
        "empty_input": [[]],
        "context_length_exceeded": [[1] * 2049],
    }
    for code, inputs in cases.items():
        with pytest.raises(EngineError) as exc:
            emb.check(EmbeddingRequest("a", inputs))
        assert (exc.value.status, exc.value.code) == (400, code)
    with pytest.raises(EngineError, match="outside the vocabulary"):
        emb.check(EmbeddingRequest("a", [[VOCAB]]))
    emb.budget = MemoryBudget(emb.budget.weights + 1000, emb.budget.weights, emb.budget.footprint)
    with pytest.raises(EngineError) as exc:
        emb.check(EmbeddingRequest("a", _rows(4, [100])))
    assert exc.value.status == 413
    emb.backbone = None  # an architecture whose inner model is not where mlxd looks
    with pytest.raises(EngineError) as exc:
        emb.check(EmbeddingRequest("a", _rows(4, [3])))
    assert (exc.value.status, exc.value.code) == (501, "embeddings_unsupported")


# -- the route over the fake engine -------------------------------------------------------------


@pytest.fixture(autouse=True)
def _fresh(fake):
    fake.reset()


def _post(srv, **body) -> httpx.Response:
    return httpx.post(srv.url + "/v1/embeddings", json=body, timeout=60)


def test_route_shapes_usage_and_base64(server, fake):
    r = _post(server, model=MODEL, input=TEXTS)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "list" and out["model"] == MODEL
    assert [d["index"] for d in out["data"]] == [0, 1, 2, 3]
    assert all(d["object"] == "embedding" and len(d["embedding"]) == 64 for d in out["data"])
    ids = [fake.tokenizer.encode(t) for t in TEXTS]
    assert fake.embeds[0].inputs == ids  # texts tokenized with the tokenizer's special tokens
    n = sum(map(len, ids))
    assert out["usage"] == {"prompt_tokens": n, "total_tokens": n}
    b = _post(server, model=MODEL, input=TEXTS, encoding_format="base64").json()
    for d, f in zip(b["data"], out["data"], strict=True):
        vec = np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4")
        np.testing.assert_array_equal(vec, np.array(f["embedding"], dtype=np.float32))
    # token ids: one list, or a list of lists
    one = _post(server, model=MODEL, input=ids[1]).json()["data"][0]["embedding"]
    assert one == out["data"][1]["embedding"]
    many = _post(server, model=MODEL, input=ids).json()["data"]
    assert [d["embedding"] for d in many] == [d["embedding"] for d in out["data"]]


def test_route_dimensions(server, fake):
    r = _post(server, model=MODEL, input="hi", dimensions=16)
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_parameter"
    fake.reset(matryoshka=(16,))
    r = _post(server, model=MODEL, input="hi", dimensions=16)
    assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 16
    assert fake.embeds[-1].dimensions == 16
    r = _post(server, model=MODEL, input="hi", dimensions=0)
    assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"


@pytest.mark.parametrize("body, status, code, param", [
    (dict(model=MODEL, input=""), 400, "empty_input", "input"),
    (dict(model=MODEL, input=[]), 400, "invalid_value", "input"),
    (dict(model=MODEL, input=["ok", ""]), 400, "empty_input", "input[1]"),
    (dict(model=MODEL, input=[[1, 2], []]), 400, "empty_input", "input[1]"),
    (dict(model=MODEL, input=[1] * 2049), 400, "context_length_exceeded", "input"),
    (dict(model=MODEL, input=[5, 99999]), 400, None, "input"),
    (dict(model=MODEL, input=[1.5]), 400, "invalid_value", "input"),
    (dict(model=MODEL, input="hi", encoding_format="int8"), 400, "invalid_value", "encoding_format"),
    (dict(input="hi"), 400, "missing_required_parameter", "model"),
    (dict(model="gpt-4", input="hi"), 404, "model_not_found", "model"),
    (dict(model="/etc/passwd", input="hi"), 404, "model_not_found", "model"),
])
def test_route_errors_are_openai_shaped(server, fake, body, status, code, param):
    r = _post(server, **body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["param"] == param and err["message"]
    assert err["type"] == "invalid_request_error"
    assert fake.embeds == []  # refused before the engine saw it
    assert _post(server, model=MODEL, input="still serving").status_code == 200


def test_route_over_context_text_is_refused(server):
    r = _post(server, model=MODEL, input="word " * 5000)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


# -- the real engine on the bundled model -------------------------------------------------------


@pytest.fixture(scope="module")
def real(tinycoder_path):
    lm = load_model(str(tinycoder_path), dtype="float32")
    engine = Engine(lm, EngineConfig(SchedulerConfig()))
    client = AsyncEngine(engine)
    client.start()
    try:
        with ServerThread(create_app(client, ServerConfig())) as srv:
            yield client, srv
    finally:
        client.stop()


def _engine_vectors(client: AsyncEngine, inputs: list[list[int]]) -> np.ndarray:
    """Each input embedded alone through the engine."""
    async def one(ids: list[int]) -> np.ndarray:
        return (await client.embed(EmbeddingRequest("ref", [ids]))).vectors[0]

    async def run() -> list[np.ndarray]:
        return [await one(ids) for ids in inputs]

    return np.stack(asyncio.run(run()))


def test_openai_sdk_against_the_real_engine(real):
    client, srv = real
    sdk = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    tok = client.model.tokenizer
    ids = [tok.encode(t) for t in TEXTS]
    alone = _engine_vectors(client, ids)
    # the SDK asks for base64 and decodes it itself
    got = sdk.embeddings.create(model=MODEL, input=TEXTS)
    vecs = np.array([d.embedding for d in got.data], dtype=np.float32)
    assert vecs.shape == (4, 384) and [d.index for d in got.data] == [0, 1, 2, 3]
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-6)
    np.testing.assert_allclose(vecs, alone, rtol=0, atol=1e-5)  # batched (different lengths) == alone
    assert got.usage.prompt_tokens == got.usage.total_tokens == sum(map(len, ids))
    floats = sdk.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    np.testing.assert_allclose(np.array([d.embedding for d in floats.data]), vecs, atol=1e-6)
    with pytest.raises(openai.BadRequestError) as exc:
        sdk.embeddings.create(model=MODEL, input="hi", dimensions=128)
    assert exc.value.body["code"] == "unsupported_parameter"
    with pytest.raises(openai.NotFoundError):
        sdk.embeddings.create(model="text-embedding-3-small", input="hi")
    over = [1] * (client.model.context_length + 1)
    with pytest.raises(openai.BadRequestError) as exc:
        sdk.embeddings.create(model=MODEL, input=over)
    assert exc.value.body["code"] == "context_length_exceeded"


def test_embeddings_interleave_with_a_running_chat(real, monkeypatch):
    """Embedding requests sent while a chat streams run between its decode steps (an embedding
    batch runs while the chat's row is in the running batch), and the chat's greedy tokens are
    what it gives alone."""
    client, srv = real
    engine = client.engine
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "write a long function"}],
                max_tokens=128, temperature=0.0, ignore_eos=True, stream=True)
    alone = httpx.post(srv.url + "/v1/chat/completions", json=dict(chat, stream=False),
                       timeout=300).json()["choices"][0]["message"]["content"]
    order: list[tuple[str, int]] = []  # engine-thread work in order: (kind, rows decoding)
    step, embed_step = engine._step, engine._embed_step
    monkeypatch.setattr(engine, "_step",
                        lambda: (order.append(("decode", len(engine.scheduler.running))), step()))
    monkeypatch.setattr(engine, "_embed_step", lambda: (
        order.append(("embed", len(engine.scheduler.running))), embed_step()))
    first = threading.Event()
    text: list[str] = []

    def stream() -> None:
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json=chat, timeout=300) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                for choice in json.loads(line[6:])["choices"]:
                    text.append(choice["delta"].get("content") or "")
                    first.set()

    t = threading.Thread(target=stream)
    t.start()
    assert first.wait(120)
    for i in range(3):
        r = _post(srv, model=MODEL, input=[f"input {i} " * (i + 1), "short"])
        assert r.status_code == 200, r.text
    t.join(300)
    assert not t.is_alive()
    embeds = [j for j, (kind, _) in enumerate(order) if kind == "embed"]
    assert len(embeds) == 3
    for j in embeds:  # each batch ran while the chat row decoded, with decode steps around it
        assert order[j][1] == 1
        assert order[j - 1][0] == "decode" and order[j + 1][0] == "decode"
    assert "".join(text) == alone


def test_a_cancelled_request_drops_its_rows_not_yet_run(real, monkeypatch):
    """The client leaves (the await is cancelled): its remaining rows never run, nothing stays
    queued, and the next request is served."""
    client, _ = real
    emb = client.engine.embedder
    monkeypatch.setattr(emb, "max_batch_tokens", 200)  # one 200-token row per batch
    rows = [[(7 * i + j) % 8000 + 1 for j in range(200)] for i in range(40)]
    before = emb.num_rows

    async def leave_early() -> None:
        task = asyncio.ensure_future(client.embed(EmbeddingRequest("gone", rows)))
        while emb.num_rows == before:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.5)

    asyncio.run(leave_early())
    ran = emb.num_rows - before
    assert 1 <= ran < len(rows) and not emb.has_work()
    assert _engine_vectors(client, rows[:1]).shape == (1, 384)
    assert emb.num_rows - before <= ran + 1 and not emb.jobs


def test_an_adapter_name_is_refused_not_served_base_vectors():
    """An adapter is a model name for generation; embeddings come from the base model, so a
    request naming an adapter gets a 400 that says so (not the base's vectors under its name)."""
    fake = FakeEngine()
    fake.model.extra["adapters"] = ["my-adapter"]
    with ServerThread(create_app(fake, ServerConfig())) as srv:
        r = _post(srv, model="my-adapter", input="x")
        assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_model", r.text
        assert fake.embeds == []
        assert _post(srv, model=MODEL, input="x").status_code == 200
