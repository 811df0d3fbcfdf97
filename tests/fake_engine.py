"""A fake `EngineClient` for server tests, and a uvicorn-in-a-thread helper.

`FakeEngine` uses the real tinycoder tokenizer and "generates" a deterministic token script
(default: the tokens of `DEFAULT_TEXT`, rotated by the seed), one or more tokens per event with a
configurable delay. It records every submit, abort and stream close, honours max_tokens,
stop_token_ids and eos (unless ignore_eos), returns fake logprobs, and refuses prompts that do not
fit the context the way the real engine does (EngineError 400 context_length_exceeded).
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np
import uvicorn

from engine.api import (
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    MODEL_LOADED,
    EmbeddingRequest,
    EmbeddingResult,
    EngineError,
    EngineOverloaded,
    EngineStats,
    ModelInfo,
    ModelStatus,
    Request,
    TokenEvent,
)
from mlxd import DEFAULT_MODEL_DIR

DEFAULT_TEXT = "Hello, world! def add(a, b):\n    return a + b  # héllo 世界 🎉\n"


@lru_cache(maxsize=1)
def load_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_DIR))


@dataclass
class FakeEngine:
    script: str | Sequence[int] | Callable[[Request], list[int]] = DEFAULT_TEXT
    step_delay: float = 0.0  # seconds between events
    tokens_per_event: int = 1
    context_length: int = 2048
    send_stop_token: bool = (
        True  # include the eos/stop token in the last event (the real engine does not)
    )
    overloaded: bool = False  # submit raises EngineOverloaded
    fail_after: int | None = None  # finish with FINISH_ERROR after this many tokens
    submit_error: Exception | None = None  # submit raises this (e.g. a RuntimeError: a "bug")
    cached_tokens: int = 4  # prompt tokens each request reports served by the prefix cache
    submits: list[Request] = field(default_factory=list)
    aborts: list[tuple[str, float]] = field(default_factory=list)  # (req_id, time.monotonic())
    closes: list[tuple[str, float]] = field(default_factory=list)  # streams closed before finishing
    finished: list[str] = field(default_factory=list)  # rows that ran to their end
    tokens_sent: dict[str, int] = field(default_factory=dict)
    embed_dim: int = 64  # the fake embeddings' size
    matryoshka: tuple[int, ...] = ()  # `dimensions` the fake accepts (besides embed_dim)
    embeds: list[EmbeddingRequest] = field(default_factory=list)

    def __post_init__(self) -> None:
        tok = load_tokenizer()
        self.tokenizer = tok
        self.eos_id = tok.convert_tokens_to_ids("<|im_end|>")
        self.model = ModelInfo(
            model_id="tinycoder-16m",
            path=str(DEFAULT_MODEL_DIR),
            tokenizer=tok,
            eos_token_ids=(self.eos_id,),
            context_length=self.context_length,
            chat_template=None,
            created=1_700_000_000,
            extra={
                "device": "fake",
                "dtype": "float32",
                "blas": {"status": "fake"},
                "vocab_size": len(tok),
            },
        )
        self._aborted: set[str] = set()
        self._active: set[str] = set()

    # -- configuration helpers --------------------------------------------------------------
    def reset(self, **changes: Any) -> None:
        defaults = FakeEngine.__dataclass_fields__
        for name in (
            "script",
            "step_delay",
            "tokens_per_event",
            "send_stop_token",
            "overloaded",
            "fail_after",
            "submit_error",
            "cached_tokens",
            "embed_dim",
            "matryoshka",
        ):
            f = defaults[name]
            setattr(self, name, f.default)
        for name in ("submits", "aborts", "closes", "finished", "embeds"):
            getattr(self, name).clear()
        self.tokens_sent.clear()
        self._aborted.clear()
        for k, v in changes.items():
            setattr(self, k, v)

    def tokens_for(self, request: Request) -> list[int]:
        if callable(self.script):
            return list(self.script(request))
        if isinstance(self.script, str):
            base = self.tokenizer.encode(self.script, add_special_tokens=False)
        else:
            base = list(self.script)
        seed = request.params.seed or 0
        k = seed % len(base)
        return base[k:] + base[:k]

    def aborted(self, req_id: str) -> bool:
        return any(r == req_id for r, _ in self.aborts) or any(r == req_id for r, _ in self.closes)

    def wait_until(self, predicate: Callable[[], bool], timeout: float = 2.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(0.005)
        return predicate()

    # -- EngineClient -----------------------------------------------------------------------
    async def submit(self, request: Request) -> AsyncIterator[TokenEvent]:
        if self.submit_error is not None:
            raise self.submit_error
        if self.overloaded:
            raise EngineOverloaded("the fake engine is full", retry_after=2.5)
        n = len(request.prompt_ids)
        if n == 0:
            raise EngineError("the prompt is empty", status=400, code="empty_prompt")
        if n >= self.context_length:
            raise EngineError(
                f"prompt of {n} tokens does not fit {self.context_length}",
                status=400,
                code="context_length_exceeded",
            )
        self.submits.append(request)
        self._active.add(request.req_id)
        return self._stream(request)

    def abort(self, req_id: str) -> None:
        self.aborts.append((req_id, time.monotonic()))
        self._aborted.add(req_id)

    def list_models(self) -> list[ModelStatus]:
        return [ModelStatus(self.model.model_id, MODEL_LOADED, default=True)]

    async def model_info(self, name: str) -> ModelInfo:
        if name != self.model.model_id:
            raise EngineError(f"The model '{name}' does not exist.", status=404,
                              code="model_not_found")
        return self.model

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self._active), num_generated_tokens=sum(self.tokens_sent.values())
        )

    async def _stream(self, request: Request) -> AsyncIterator[TokenEvent]:
        req_id, params = request.req_id, request.params
        script = self.tokens_for(request)
        end_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else {self.eos_id})
        n_prompt = len(request.prompt_ids)
        done = False
        sent = 0
        try:
            i = 0
            while True:
                await asyncio.sleep(self.step_delay)
                if req_id in self._aborted:
                    done = True
                    yield TokenEvent(
                        req_id, [], finish_reason=FINISH_ABORT, num_prompt_tokens=n_prompt
                    )
                    return
                if self.fail_after is not None and sent >= self.fail_after:
                    done = True
                    yield TokenEvent(
                        req_id,
                        [],
                        finish_reason=FINISH_ERROR,
                        num_prompt_tokens=n_prompt,
                        error="fake engine failure",
                    )
                    return
                ids: list[int] = []
                finish = None
                for _ in range(self.tokens_per_event):
                    token = script[i % len(script)]
                    i += 1
                    if token in end_ids:
                        finish = FINISH_STOP
                        if self.send_stop_token:
                            ids.append(token)
                        break
                    ids.append(token)
                    sent += 1
                    if sent >= params.max_tokens:
                        finish = FINISH_LENGTH
                        break
                self.tokens_sent[req_id] = sent
                ev = TokenEvent(
                    req_id,
                    ids,
                    finish_reason=finish,
                    num_prompt_tokens=n_prompt,
                    num_cached_tokens=min(self.cached_tokens, n_prompt - 1),
                )
                if params.logprobs:
                    ev.logprobs = [self.fake_logprob(t) for t in ids]
                    if params.top_logprobs:
                        ev.top_logprobs = [self.fake_top(t, params.top_logprobs) for t in ids]
                if finish is not None:
                    done = True
                    self.finished.append(req_id)
                yield ev
                if done:
                    return
        finally:
            self._active.discard(req_id)
            if not done:
                self.closes.append((req_id, time.monotonic()))

    async def embed(self, request: EmbeddingRequest) -> EmbeddingResult:
        """A unit vector per input drawn from a generator seeded by its token ids; refuses
        what the real engine refuses (empty or over-context inputs, undeclared `dimensions`)."""
        if self.submit_error is not None:
            raise self.submit_error
        for ids in request.inputs:
            if not ids:
                raise EngineError("the input is empty", status=400, code="empty_input")
            if len(ids) > self.context_length:
                raise EngineError(f"input of {len(ids)} tokens does not fit {self.context_length}",
                                  status=400, code="context_length_exceeded")
        dims = request.dimensions
        if dims is not None and dims != self.embed_dim and dims not in self.matryoshka:
            raise EngineError("'dimensions' is not supported by this model", status=400,
                              code="unsupported_parameter")
        self.embeds.append(request)
        await asyncio.sleep(self.step_delay)
        rows = [np.random.default_rng(ids).standard_normal(self.embed_dim) for ids in request.inputs]
        vecs = np.stack(rows)[:, : dims or self.embed_dim]
        vecs = (vecs / np.linalg.norm(vecs, axis=1, keepdims=True)).astype(np.float32)
        return EmbeddingResult(request.req_id, vecs, sum(len(i) for i in request.inputs))

    @staticmethod
    def fake_logprob(token: int) -> float:
        return -0.05 - (token % 17) / 100.0

    def fake_top(self, token: int, k: int) -> list[tuple[int, float]]:
        lp = self.fake_logprob(token)
        alts = [((token + j) % len(self.tokenizer), lp - j) for j in range(1, k)]
        return [(token, lp), *alts]


class ServerThread:
    """uvicorn serving `app` on a free loopback port in a background thread."""

    def __init__(self, app: Any):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(
            app, log_level="warning", lifespan="off", timeout_graceful_shutdown=1
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(5)
        self.sock.close()
