"""Which served model a request's `model` names, and Ollama's `keep_alive`.

`ModelRouter.select(name)` returns the `ServedModel` a request runs on:

- None, or one of the default model's names (its served name, its model id, its directory, as
  with a single model), or one of its LoRA adapters: the default model (an adapter as a view of
  it whose `name` is the adapter's, so responses report what the client asked for);
- another configured model's name (`mlxd serve --model NAME=DIR`, `--models-dir`): that model,
  its tokenizer read on first use (`EngineClient.model_info`) while its weights load later,
  on `submit`;
- anything else: 404 `model_not_found`. Names are matched against the list the engine was
  configured with, so a path or repo id a client makes up never reaches the filesystem.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from engine.api import EngineClient, keep_alive_seconds
from server.errors import APIError, bad_request
from server.prompts import ServedModel

KEEP_ALIVE_HELP = ("keep_alive must be a number of seconds or a duration such as '90s', '5m' or "
                   "'1h30m' (0: unload once idle; negative: keep loaded)")


def parse_keep_alive(value: Any, param: str = "keep_alive") -> float | None:
    """A request's keep_alive (Ollama's) → seconds (engine.api.keep_alive_seconds); None: not
    set; anything else: 400."""
    if value is None:
        return None
    try:
        return keep_alive_seconds(value)
    except (TypeError, ValueError):
        raise bad_request(KEEP_ALIVE_HELP, param) from None


class ModelRouter:
    """The served models by name (one per app)."""

    def __init__(self, client: EngineClient, default: ServedModel):
        self.client = client
        self.default = default
        self._adapters = {a: dataclasses.replace(default, name=a, adapter=a) for a in default.adapters}
        self._others = [s.name for s in client.list_models() if not s.default]
        self._served: dict[str, ServedModel] = {}
        self._opening: dict[str, asyncio.Lock] = {}

    def names(self) -> list[str]:
        """Every model name a request may use, as /v1/models lists them."""
        return [self.default.name, *self.default.adapters, *self._others]

    def adapter_view(self, name: str) -> ServedModel:
        """The default model running with adapter `name`."""
        return self._adapters[name]

    def opened(self, name: str) -> ServedModel | None:
        """A configured model other than the default, once a request has used it."""
        return self._served.get(name)

    def is_default(self, name: str) -> bool:
        return name not in self._others and (name == self.default.name or name in self._adapters)

    async def select(self, requested: str | None, param: str = "model") -> ServedModel:
        """The model `requested` names (None: the default); APIError 404 for any other name."""
        if requested is None:
            return self.default
        if requested in self._others:
            return await self._open(requested)
        if requested in self.default.aliases:
            return self._adapters.get(requested, self.default)
        shown = ", ".join(f"'{n}'" for n in self.names()[:8])
        raise APIError(404, f"The model '{requested}' does not exist; this server serves {shown}.",
                       param=param, code="model_not_found")

    async def _open(self, name: str) -> ServedModel:
        served = self._served.get(name)
        if served is not None:
            return served
        lock = self._opening.setdefault(name, asyncio.Lock())
        async with lock:  # concurrent first requests read the tokenizer once
            served = self._served.get(name)
            if served is None:
                info = await self.client.model_info(name)  # EngineError: its own status
                served = await asyncio.to_thread(ServedModel.from_info, info, name)
                served.engine_name = name
                served.adapters = ()
                self._served[name] = served
        return served
