"""`AsyncPool`: the asyncio `EngineClient` over an `engine.pool.EnginePool`.

`Request.model` (None: the default model) picks the model; `submit` and `embed` wait while it
loads (the wait is part of the request's time to first token), with the model pinned so that
it is not unloaded between its load and the request joining its engine. `model_info` reads a
model's config and tokenizer on a worker thread, once, without its weights.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, cast

from engine.api import (
    EmbeddingRequest,
    EmbeddingResult,
    EngineError,
    EngineStats,
    ModelInfo,
    ModelStatus,
    Request,
    ScoreRequest,
    ScoreResult,
    TokenEvent,
)
from engine.core import AsyncEngine
from engine.loader import read_model_files
from engine.pool import EnginePool, ModelSlot, info_of, load_error

log = logging.getLogger("mlxd.engine")


class AsyncPool:
    """The `EngineClient` over an `EnginePool`: `Request.model` (None: the default model)
    picks the model; `submit` waits while it loads."""

    def __init__(self, pool: EnginePool):
        self.pool = pool
        default = pool.default
        assert default.info is not None
        self.model = default.info
        self._owners: dict[str, AsyncEngine] = {}
        self._reading: dict[str, asyncio.Lock] = {}

    def start(self) -> None:
        self.pool.start()

    def stop(self) -> None:
        self.pool.stop()

    def list_models(self) -> list[ModelStatus]:
        return self.pool.statuses()

    async def model_info(self, name: str) -> ModelInfo:
        slot = self.pool.slot(name)
        if slot.info is not None:
            return slot.info
        lock = self._reading.setdefault(name, asyncio.Lock())
        async with lock:  # one read per model, however many requests ask at once
            if slot.info is None:
                slot.reading = True
                try:
                    slot.info = await asyncio.to_thread(self._read, slot)
                finally:
                    slot.reading = False
        return slot.info

    def _read(self, slot: ModelSlot) -> ModelInfo:
        spec = slot.spec
        try:
            files = read_model_files(spec.source, chat_template=spec.chat_template,
                                     revision=spec.revision)
        except Exception as exc:
            log.error("reading model %s (%s) failed: %s: %s", spec.name, spec.source,
                      type(exc).__name__, exc)
            error = load_error(spec.name, exc)
            slot.error = error.message
            raise error from None
        slot.files = files
        return info_of(files, [a for a, _ in spec.adapters])

    async def _ready(self, slot: ModelSlot) -> AsyncEngine:
        """The model's client, once it is loaded (the wait is part of the request's TTFT)."""
        await self.model_info(slot.spec.name)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[AsyncEngine] = loop.create_future()

        def settle(client: AsyncEngine | None, error: EngineError | None) -> None:
            if future.done():
                return
            if error is not None or client is None:
                future.set_exception(error or EngineError("the model was unloaded", status=503))
            else:
                future.set_result(client)

        def waiter(client: AsyncEngine | None, error: EngineError | None) -> None:
            try:  # runs on the engine thread
                loop.call_soon_threadsafe(settle, client, error)
            except RuntimeError:  # the event loop is gone
                pass

        client = self.pool.request_load(slot, waiter)
        return client if client is not None else await future

    async def submit(self, request: Request) -> AsyncIterator[TokenEvent]:
        slot = self.pool.slot(request.model)
        if not request.arrival_time:
            request.arrival_time = time.time()
        self.pool.pin(slot, request.keep_alive)
        try:
            client = await self._ready(slot)
            stream = await client.submit(request)
        finally:
            self.pool.unpin(slot)
        self._owners[request.req_id] = client
        return self._tracked(request.req_id, stream)

    async def _tracked(self, req_id: str, stream: AsyncIterator[TokenEvent]) -> AsyncIterator[TokenEvent]:
        try:
            async for event in stream:
                yield event
        finally:
            self._owners.pop(req_id, None)
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()  # an unfinished stream aborts its row

    def abort(self, req_id: str) -> None:
        client = self._owners.pop(req_id, None)
        if client is not None:
            client.abort(req_id)

    async def embed(self, request: EmbeddingRequest) -> EmbeddingResult:
        """The model stays pinned (never unloaded) until its vectors are back."""
        return cast(EmbeddingResult, await self._pinned(request.model, lambda c: c.embed(request)))

    async def score(self, request: ScoreRequest) -> ScoreResult:
        """The model stays pinned (never unloaded) until the logprobs are back."""
        return cast(ScoreResult, await self._pinned(request.model, lambda c: c.score(request)))

    async def _pinned(self, model: str | None, call: Any) -> Any:
        slot = self.pool.slot(model)
        self.pool.pin(slot, None)
        try:
            return await call(await self._ready(slot))
        finally:
            self.pool.unpin(slot)

    def stats(self) -> EngineStats:
        """The engines' figures added up; memory: the shared budget and every model's weights."""
        parts = [e.stats() for e in self.pool.engines()]
        if not parts:
            out = EngineStats()
            out.memory.budget_bytes = self.pool.budget
            return out
        out = parts[0]
        for s in parts[1:]:
            for key in ("num_running", "num_waiting", "num_prefilling", "num_queued",
                        "active_requests", "kv_bytes", "num_steps", "num_generated_tokens",
                        "num_prompt_tokens"):
                setattr(out, key, getattr(out, key) + getattr(s, key))
            for layout, n in s.kv_bytes_by_layout.items():
                out.kv_bytes_by_layout[layout] = out.kv_bytes_by_layout.get(layout, 0) + n
            out.memory.weights_bytes += s.memory.weights_bytes
            out.last_error = out.last_error or s.last_error
        out.memory.budget_bytes = self.pool.budget
        return out
