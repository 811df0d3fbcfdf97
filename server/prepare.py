"""Request preparation off the event loop: chat templates and tokenization in a few threads.

Rendering a template and tokenizing a long prompt take seconds of CPU for multi-megabyte inputs.
On the event loop that would stall every other request, `/health` and running streams included;
here it runs in a bounded pool of threads (`ServerConfig.prepare_threads`, default 2), and
requests beyond that wait their turn without blocking the loop. Hugging Face's fast tokenizers
release the GIL while they encode, so the loop keeps answering meanwhile.

    plan = await off_loop(request, plan_turn, model, messages, functions, choice)

Texts that cannot fit the context are refused before tokenizing (`server.prompts.encode`).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
from fastapi import Request

T = TypeVar("T")


class Preparer:
    """A bounded set of worker threads for CPU-heavy request preparation (one per app)."""

    def __init__(self, threads: int = 2):
        self.threads = max(1, threads)
        # made in the running loop on first use (again if the app moves to another loop)
        self._limiter: anyio.CapacityLimiter | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        if self._limiter is None or self._loop is not loop:
            self._limiter, self._loop = anyio.CapacityLimiter(self.threads), loop
        call = functools.partial(fn, *args, **kwargs)
        return await anyio.to_thread.run_sync(call, limiter=self._limiter)


async def off_loop(request: Request, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` on the app's preparation threads; its exceptions propagate."""
    preparer: Preparer = request.app.state.mlxd.preparer
    return await preparer.run(fn, *args, **kwargs)
