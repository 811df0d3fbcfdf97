"""Prompt logprobs (engine.score) and completions' `echo` with `logprobs` over real HTTP.

The engine's values equal the log-softmax of mlx-lm's own full forward (tiny random models of
three architectures, sliding windows passed; the bundled model past its 256-token window), rows
decoding beside a scoring job keep their tokens, and over HTTP the echoed prompt's logprobs agree
with the logprobs the same tokens get when they are generated.
"""

from __future__ import annotations

import json
import threading

import httpx
import mlx.core as mx
import numpy as np
import openai
import pytest

from engine.api import EngineError, Request, SamplingParams, ScoreRequest, ScoreResult
from engine.core import PREFIX_BLOCK_SIZE, Engine, EngineConfig
from engine.loader import load_model
from engine.scheduler import SchedulerConfig
from tests.tiny_models import VOCAB, loaded, tiny_model

MODEL = "tinycoder-16m"


def _reference(model, ids: list[int]) -> np.ndarray:
    """log p(ids[i] | ids[:i]) for i >= 1 from one full forward of mlx-lm's model (no cache)."""
    z = model(mx.array([ids]))[0].astype(mx.float32)
    lp = z - mx.logsumexp(z, axis=-1, keepdims=True)
    return np.array(mx.take_along_axis(lp[:-1], mx.array(ids[1:])[:, None], axis=-1)[:, 0])


def _score(engine: Engine, ids: list[int], k: int = 0) -> ScoreResult:
    got: dict = {}
    done = threading.Event()

    def finish(result, error):
        got["result"], got["error"] = result, error
        done.set()

    engine.add_scoring(ScoreRequest("s", ids, k), finish)
    assert done.wait(120)
    assert got["error"] is None, got["error"]
    return got["result"]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text"])
def test_scores_equal_the_full_forward(arch):
    """Chunks of 16 positions over mlxd's layouts (rings of the sliding windows wrap) give the
    full forward's log-probabilities; the k best are sorted and include the best token."""
    model, cfg = tiny_model(arch)
    engine = Engine(loaded(model, cfg), EngineConfig(SchedulerConfig(prefill_chunk=16), warmup=False))
    engine.scorer.chunk = 16
    engine.start()
    try:
        ids = np.random.default_rng(3).integers(1, VOCAB, 70).tolist()
        result = _score(engine, ids, k=4)
        assert len(result.logprobs) == len(result.top_logprobs) == len(ids) - 1
        np.testing.assert_allclose(result.logprobs, _reference(model, ids), rtol=0, atol=2e-4)
        z = model(mx.array([ids]))[0].astype(mx.float32)
        full = np.array(z - mx.logsumexp(z, axis=-1, keepdims=True))
        for i, (lp, top, rank) in enumerate(zip(result.logprobs, result.top_logprobs, result.ranks, strict=True)):
            values = [v for _, v in top]
            assert len(top) == 4 and values == sorted(values, reverse=True) and values[0] >= lp - 1e-6
            assert [t for t, _ in top] == np.argsort(-full[i], kind="stable")[:4].tolist()
            chosen = full[i, ids[i + 1]]  # the rank counts the tokens above it (float noise: 1e-4)
            assert 1 + (full[i] > chosen + 1e-4).sum() <= rank <= 1 + (full[i] > chosen - 1e-4).sum()
        assert _score(engine, ids[:1]).logprobs == []  # nothing precedes the only token
        assert len(_score(engine, ids[:2]).logprobs) == 1
    finally:
        engine.stop()


def test_a_cancelled_job_stops_and_frees_its_kv():
    """A job cancelled mid-way (the client left) runs no further chunk, never answers, and
    leaves nothing queued; the next job scores as usual."""
    model, cfg = tiny_model("llama")
    engine = Engine(loaded(model, cfg), EngineConfig(SchedulerConfig(prefill_chunk=8), warmup=False))
    engine.scorer.chunk = 8
    answers = []
    ids = np.random.default_rng(5).integers(1, VOCAB, 60).tolist()
    job = engine.add_scoring(ScoreRequest("c", ids, 0), lambda r, e: answers.append((r, e)))
    free = engine.scheduler._free()  # what admission leaves for rows and the prefix cache
    engine.turn()  # the first chunk (engine thread, driven by hand)
    assert job.pos == 8 and job.caches is not None and not answers
    assert engine.budget.side == engine.scorer.job_bytes(60) > 0  # what admission counts meanwhile
    assert engine.scheduler._free() == free - engine.budget.side
    job.cancelled = True
    engine.turn()
    assert job.pos == 8 and not engine.scorer.jobs and not engine.scorer.has_work() and not answers
    assert job.caches is None and engine.budget.side == 0
    engine.start()
    try:
        np.testing.assert_allclose(_score(engine, ids).logprobs, _reference(model, ids), rtol=0, atol=2e-4)
    finally:
        engine.stop()
    assert not answers


def test_refusals_before_anything_is_queued():
    model, cfg = tiny_model("llama")
    engine = Engine(loaded(model, cfg), EngineConfig(SchedulerConfig(), warmup=False))
    for ids, k, code in (([], 0, "empty_input"), ([1] * (cfg["max_position_embeddings"] + 1), 0,
                                                    "context_length_exceeded"),
                         ([VOCAB], 0, None), ([1, 2], 21, None)):
        with pytest.raises(EngineError) as err:
            engine.add_scoring(ScoreRequest("s", ids, k), lambda r, e: None)
        assert err.value.status == 400 and (code is None or err.value.code == code)
    assert not engine.scorer.jobs and not engine._inbox


def test_rows_decoding_beside_a_scoring_job_keep_their_tokens():
    """A long prompt scored chunk by chunk while two rows decode: their greedy tokens are the
    ones they get alone, and the scores are the full forward's."""
    lm = load_model(f"mlxd/models/{MODEL}")
    engine = Engine(lm, EngineConfig(SchedulerConfig(), warmup=False))
    engine.start()
    try:
        prompts = [lm.tokenizer.encode("def add(a, b):"), lm.tokenizer.encode("class Stack:")]

        def generate(tag: str) -> tuple[list[list[int]], threading.Event]:
            outs: list[list[int]] = [[], []]
            done = threading.Event()
            left = [2]

            def sink_for(i):
                def sink(events):
                    for ev in events:
                        outs[i].extend(ev.token_ids)
                        if ev.finish_reason is not None:
                            left[0] -= 1
                            if not left[0]:
                                done.set()
                return sink

            for i, p in enumerate(prompts):
                engine.add(Request(f"{tag}{i}", p,
                                   SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)),
                           sink_for(i))
            return outs, done

        alone, done = generate("alone")
        assert done.wait(120)
        text = "".join(f"def f{i}(x):\n    return x * {i}\n\n" for i in range(60))
        ids = lm.tokenizer.encode(text)[:700]
        beside, done = generate("beside")
        scored = _score(engine, ids)
        assert done.wait(120)
        assert beside == alone
        np.testing.assert_allclose(scored.logprobs, _reference(lm.model, ids), rtol=0, atol=1e-4)
        assert engine.scorer.num_jobs >= 1 and not engine.scorer.jobs
    finally:
        engine.stop()


def test_echo_with_logprobs_over_http(real_server):
    """lm-eval's loglikelihood request (echo, max_tokens 0, logprobs 1) and echo before a
    generation: the prompt's tokens come back with null first, their logprobs, offsets into the
    echoed text; a prompt of a generation's own tokens scores them as the generation did."""
    client = openai.OpenAI(base_url=real_server.url + "/v1", api_key="x", max_retries=0)
    prompt = "def add(a, b):\n    return a + b\n"
    gen = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=2,
                                    echo=True)
    lp = gen.choices[0].logprobs
    n_prompt = gen.usage.prompt_tokens
    assert gen.choices[0].text.startswith(prompt)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == n_prompt + 8
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(v, float) for v in lp.token_logprobs[1:])
    text = gen.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert lp.text_offset[n_prompt - 1] < len(prompt) <= lp.text_offset[n_prompt]
    assert text[lp.text_offset[1]:].startswith(" add")  # "def" | " add" | ...
    for tok, v, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
        assert top[tok] == v and len(top) <= 3
    # the generated tokens, scored as a prompt, get the logprobs the generation reported
    scored = client.completions.create(model=MODEL, prompt=text, echo=True, max_tokens=0, logprobs=0)
    slp = scored.choices[0].logprobs
    assert scored.choices[0].text == text and scored.choices[0].finish_reason == "length"
    assert slp.tokens == lp.tokens
    np.testing.assert_allclose(slp.token_logprobs[n_prompt:], lp.token_logprobs[n_prompt:], rtol=0, atol=1e-3)
    np.testing.assert_allclose(slp.token_logprobs[1:n_prompt], lp.token_logprobs[1:n_prompt], rtol=0, atol=1e-5)
    # token-id prompts, several at once, streamed: the echo chunk carries its logprobs
    body = {"model": MODEL, "prompt": [[5, 6, 7], [8, 9]], "echo": True, "max_tokens": 1, "logprobs": 1,
            "temperature": 0, "stream": True}
    first = {}
    with httpx.stream("POST", real_server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    first.setdefault(c["index"], c["logprobs"])
    assert [len(first[i]["token_logprobs"]) for i in (0, 1)] == [3, 2]
    assert first[0]["token_logprobs"][0] is None


def test_offsets_of_an_id_prompt_count_its_special_tokens(real_server):
    """A prompt sent as ids echoes its special tokens' text; the offsets count it."""
    ids = httpx.post(real_server.url + "/tokenize", json={"model": MODEL, "prompt": "<|im_start|>user\nhi"}).json()["tokens"]
    r = httpx.post(real_server.url + "/v1/completions", json={"model": MODEL, "prompt": ids, "echo": True,
                                                              "max_tokens": 0, "logprobs": 0}).json()
    text, lp = r["choices"][0]["text"], r["choices"][0]["logprobs"]
    assert text == "<|im_start|>user\nhi" and len(lp["tokens"]) == len(ids)
    assert lp["text_offset"][0] == 0 and lp["text_offset"][1] == len("<|im_start|>")


def test_vllm_prompt_logprobs(real_server):
    """vLLM's `prompt_logprobs` on /v1/completions: per choice, null first, then per token a map
    from token id to logprob, rank and text holding the token itself and the k best; the same
    values as echo's; streamed in the choice's first chunk; a 400 on chat completions."""
    url = real_server.url + "/v1/completions"
    body = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2,
            "echo": True, "logprobs": 0, "n": 2}
    r = httpx.post(url, json=body).json()
    c0, c1 = r["choices"]
    plp, echo = c0["prompt_logprobs"], c0["logprobs"]
    n_prompt = r["usage"]["prompt_tokens"]
    assert c1["prompt_logprobs"] == plp and len(plp) == n_prompt and plp[0] is None
    for entry, lp in zip(plp[1:], echo["token_logprobs"][1:n_prompt], strict=True):
        ranks = sorted(v["rank"] for v in entry.values())
        assert 2 <= len(entry) <= 3 and ranks[:2] == [1, 2]
        assert any(abs(v["logprob"] - lp) < 1e-6 for v in entry.values())  # the token itself
        assert all(isinstance(v["decoded_token"], str) for v in entry.values())
    best = [max(e.values(), key=lambda v: v["logprob"]) for e in plp[1:]]
    assert all(b["rank"] == 1 for b in best)
    only = httpx.post(url, json={**body, "echo": False, "logprobs": None, "max_tokens": 1, "n": 1}).json()
    assert only["choices"][0]["prompt_logprobs"] == plp and only["choices"][0]["logprobs"] is None
    first = {}
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    first.setdefault(c["index"], c.get("prompt_logprobs"))
    assert first == {0: plp, 1: plp}


@pytest.mark.parametrize("tools", [False, True])
def test_vllm_prompt_logprobs_on_chat(real_server, tools):
    """vLLM's `prompt_logprobs` on /v1/chat/completions: one list for the response (the chat
    template's tokens), the values completions gives for the same ids; with tools too (the
    agent path); a 400 when streamed."""
    msgs = [{"role": "user", "content": "def add(a, b):"}]
    body = {"model": MODEL, "messages": msgs, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2}
    if tools:
        body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    r = httpx.post(real_server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    plp = r.json()["prompt_logprobs"]
    assert len(plp) == r.json()["usage"]["prompt_tokens"] and plp[0] is None
    if not tools:  # /tokenize renders messages without tools
        ids = httpx.post(real_server.url + "/tokenize", json={"model": MODEL, "messages": msgs}).json()["tokens"]
        same = httpx.post(real_server.url + "/v1/completions", json={
            "model": MODEL, "prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2}).json()
        assert same["choices"][0]["prompt_logprobs"] == plp
    else:  # the tool's name is in the prompt, scored like any token
        assert any(e and any(v["decoded_token"].strip() == "f" for v in e.values()) for e in plp)
    streamed = httpx.post(real_server.url + "/v1/chat/completions", json={**body, "stream": True})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"


def test_echo_logprobs_refusals(real_server):
    r = httpx.post(real_server.url + "/v1/completions", json={"model": MODEL, "prompt": "x " * 5000, "echo": True,
                                                         "max_tokens": 0, "logprobs": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def _generate(engine: Engine, ids: list[int], tag: str, max_tokens: int = 24) -> tuple[list[int], int]:
    """Greedy tokens for `ids` and the prompt tokens the prefix cache served."""
    out: list[int] = []
    cached = [0]
    done = threading.Event()

    def sink(events):
        for ev in events:
            out.extend(ev.token_ids)
            cached[0] = max(cached[0], ev.num_cached_tokens)
            if ev.finish_reason is not None:
                done.set()

    engine.add(Request(tag, ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)), sink)
    assert done.wait(120)
    return out, cached[0]


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_a_scored_prompt_is_not_prefilled_again(arch):
    """Scoring stores the prompt's complete blocks in the prefix cache (chunks on block
    boundaries, within a ring's reach: gemma3's sliding window wraps), so a generation from the
    same prompt (echo + logprobs + max_tokens) restores them; its greedy tokens are those of an
    engine without a prefix cache, and the scores do not change."""
    model, cfg = tiny_model(arch)
    lm = loaded(model, cfg)
    ids = np.random.default_rng(7).integers(1, VOCAB, 75).tolist()
    plain = Engine(lm, EngineConfig(SchedulerConfig(prefill_chunk=32), warmup=False, prefix_cache_bytes=0))
    plain.start()
    try:
        want, cached = _generate(plain, ids, "plain")
        assert cached == 0
    finally:
        plain.stop()
    engine = Engine(lm, EngineConfig(SchedulerConfig(prefill_chunk=32), warmup=False, prefix_cache_bytes=1 << 26,
                                     prefix_block_size=8))
    assert engine.scorer.chunk % 8 == 0 and engine.scorer.chunk <= engine.prefix.chunk
    engine.start()
    try:
        scored = _score(engine, ids, k=2)
        np.testing.assert_allclose(scored.logprobs, _reference(model, ids), rtol=0, atol=2e-4)
        assert engine.prefix.cache.num_blocks == (len(ids) - 1) // 8
        got, cached = _generate(engine, ids, "after")
        assert cached == (len(ids) - 1) // 8 * 8  # every complete block of the scored positions
        assert got == want
    finally:
        engine.stop()


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_a_pass_over_a_scored_prefix_reads_its_scores(arch):
    """Multiple choice (a context, then each answer, scored as separate prompts): the second
    and later passes restore the context's blocks and their stored scores from the prefix
    cache and run only what follows (from one block before the first new token), with the
    values a pass from scratch gives; a pass asking for more alternatives than were stored
    runs from the start."""
    model, cfg = tiny_model(arch)
    lm = loaded(model, cfg)
    rng = np.random.default_rng(9)
    context = rng.integers(1, VOCAB, 70).tolist()
    answers = [rng.integers(1, VOCAB, 9).tolist() for _ in range(3)]
    engine = Engine(lm, EngineConfig(SchedulerConfig(prefill_chunk=32), warmup=False,
                                     prefix_cache_bytes=1 << 26, prefix_block_size=8))
    engine.start()
    try:
        scorer = engine.scorer
        first = _score(engine, context + answers[0], k=2)
        ran = scorer.num_positions
        assert ran == len(context) + len(answers[0]) - 1
        for a in answers[1:]:
            ids = context + a
            before = scorer.num_positions
            got = _score(engine, ids, k=2)
            cached = (len(context) // 8 - 1) * 8  # the context's whole blocks but the last
            assert scorer.num_positions - before == len(ids) - 1 - cached
            np.testing.assert_allclose(got.logprobs, _reference(model, ids), rtol=0, atol=2e-4)
            assert got.logprobs[: len(context) - 1] == pytest.approx(first.logprobs[: len(context) - 1], abs=2e-4)
            assert [t[0][0] for t in got.top_logprobs[:cached]] == [t[0][0] for t in first.top_logprobs[:cached]]
            assert got.ranks[:cached] == first.ranks[:cached]
        before = scorer.num_positions
        _score(engine, context + answers[0], k=3)  # more alternatives than stored: from scratch
        assert scorer.num_positions - before == len(context) + len(answers[0]) - 1
    finally:
        engine.stop()


def test_echo_logprobs_then_generation_restores_the_prompt_over_http(real_server):
    """lm-eval's loglikelihood request with a token to generate (echo, logprobs, max_tokens 1):
    the generation reports the scored prompt's blocks as cached tokens."""
    prompt = "".join(f"def g{i}(y):\n    return y - {i}\n\n" for i in range(30))
    body = {"model": MODEL, "prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
    r = httpx.post(real_server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    n = usage["prompt_tokens"]
    assert n > 300  # past tinycoder's 256-token window
    assert usage["prompt_tokens_details"]["cached_tokens"] == (n - 1) // PREFIX_BLOCK_SIZE * PREFIX_BLOCK_SIZE
