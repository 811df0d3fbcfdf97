"""Streaming that notices a client leaving at once, not only at the next write.

`SSEResponse` sends `data: ...\\n\\n` events from an async iterator of strings while a second task
listens for `http.disconnect`; a disconnect cancels the source, whose cleanup aborts the engine
rows (see `server.generation`). `run_until_disconnect` gives non-streaming handlers the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")

DONE = "[DONE]"
STREAM_ERROR = {
    "error": {
        "message": "The server had an error while processing your request.",
        "type": "server_error",
        "param": None,
        "code": "internal_error",
    }
}
log = logging.getLogger("mlxd.server")


try:  # optional: 10x faster than json for the per-token chunks
    import orjson

    def _dumps(payload: Any) -> bytes:
        return orjson.dumps(payload)
except ImportError:  # pragma: no cover

    def _dumps(payload: Any) -> bytes:
        return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()


def sse_event(payload: Any) -> bytes:
    """One `data:` event; `payload` is a JSON-able object or a literal string such as [DONE]."""
    data = payload.encode() if isinstance(payload, str) else _dumps(payload)
    return b"data: " + data + b"\n\n"


class SSEResponse(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(
        self,
        source: AsyncIterator[bytes],
        headers: dict[str, str] | None = None,
        on_close: Callable[[], None] | None = None,
    ):
        super().__init__(source, status_code=200, headers=headers, media_type=self.media_type)
        self.source = source
        self.on_close = on_close  # runs however the response ends: done, disconnect, error
        self.raw_headers.extend([(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")])

    def _close(self) -> None:
        if self.on_close is not None:
            on_close, self.on_close = self.on_close, None
            on_close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as tg:

            async def watch_disconnect() -> None:
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        self._close()  # abort at once: the rows' queue places are free from now on
                        tg.cancel_scope.cancel()
                        return

            tg.start_soon(watch_disconnect)
            try:
                await send(
                    {
                        "type": "http.response.start",
                        "status": self.status_code,
                        "headers": self.raw_headers,
                    }
                )
                try:
                    async for chunk in self.source:
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                except OSError:
                    raise
                except Exception:  # a bug after the 200 went out: say so in the stream, end it
                    log.exception("stream failed")
                    tail = sse_event(STREAM_ERROR) + sse_event(DONE)
                    await send({"type": "http.response.body", "body": tail, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except OSError:
                pass  # the client went away mid-write
            finally:
                self._close()
                aclose = getattr(self.source, "aclose", None)
                if aclose is not None:
                    with anyio.move_on_after(2.0, shield=True):
                        await aclose()
                tg.cancel_scope.cancel()


async def run_until_disconnect(request: Request, work: Callable[[], Awaitable[T]]) -> T | None:
    """Await `work()`; if the client disconnects first, cancel it and return None."""

    async def run() -> T:  # a Task of its own, whatever `work()` returns (a gather, a future)
        return await work()

    task = asyncio.ensure_future(run())

    async def wait_disconnect() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        with contextlib.suppress(BaseException):
            await watcher
        if not task.done():  # the client left (or we are being cancelled): stop the work
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        return None
    return task.result()
