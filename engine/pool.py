"""Many models by name on the one engine thread: loaded on first use, one memory budget,
unloaded least-recently-used when a new one needs the room or after a keep-alive.

    pool = EnginePool([ModelSpec("coder", "/models/coder"), ModelSpec("chat", "/models/chat")],
                      PoolConfig(EngineConfig(SchedulerConfig())))
    client = AsyncPool(pool)        # engine.pool_client: the EngineClient; Request.model picks
    client.start()

One thread owns MLX, as with a single model (engine.core). Each loaded model keeps its own
`Engine` (scheduler, runner, KV, prefix cache); the pool's thread drives them all. A turn:

    for every loaded model with work:  engine.turn()     # admissions, one step, one embedding batch
    one unit of the load in progress                      # build, a slice of weights, or the engine
    unload models idle past their keep-alive

so between two steps of one model every other model runs at most one step, and a load adds at
most one slice (`PoolConfig.load_slice_bytes` of weights read and converted) to the wait. mlx-lm
builds a model lazily (`engine.loader.build_model`); its parameters are evaluated a slice per
turn, then the `Engine` is built (its first, one-token forward) and the waiting requests start.

Memory: `--memory-budget` is shared. A model loads only when the weights and reserved KV of the
loaded models plus its own weights fit; until then the least-recently-used idle model is
unloaded, one at a time (a model with queued or running rows, or a request about to join it, is
never unloaded). Each engine admits rows against the budget less what the other models hold
(`MemoryBudget.others`). A model whose weights alone exceed the budget is refused (413).

Config and tokenizer are read off the engine thread on first use (`AsyncPool.model_info`,
engine.pool_client) and kept across unloads, so the server can tokenize while the weights load.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import mlx.core as mx
from mlx.utils import tree_flatten

from engine.api import (
    MODEL_LOADED,
    MODEL_LOADING,
    MODEL_UNLOADED,
    EngineError,
    ModelInfo,
    ModelStatus,
)
from engine.core import AsyncEngine, Engine, EngineConfig, EngineThread
from engine.kv.memory import device_memory_bytes
from engine.loader import LoadedModel, ModelFiles, build_model, read_model_files

log = logging.getLogger("mlxd.engine")

GiB = float(1 << 30)
ROOM_RETRY_S = 0.005  # a load waiting for room checks again this often while nothing runs


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A model the server may serve: its name in the API and where its files are."""

    name: str
    source: str  # a model directory or a Hugging Face repo id
    adapters: tuple[tuple[str, str], ...] = ()  # LoRA adapters (name, directory) on this model
    chat_template: str | None = None
    revision: str | None = None


@dataclass(slots=True)
class PoolConfig:
    engine: EngineConfig  # each model's engine (memory_budget: the one shared budget)
    dtype: str = "auto"
    keep_alive: float | None = None  # seconds idle before a model is unloaded; None: never
    load_slice_bytes: int = 64 << 20  # weights evaluated per engine turn while a model loads


class PooledEngine(Engine):
    """An `Engine` driven by the pool's thread, its memory admission counting what the other
    models hold (`MemoryBudget.others`, set by the pool before each turn; its embedding batches
    and scoring chunks too: they fit next to it)."""

    def _held_bytes(self) -> int:
        return self.scheduler.reserved_bytes() + self.budget.others


@dataclass(slots=True)
class _Load:
    """A load in progress on the engine thread."""

    started: float
    loaded: LoadedModel | None = None  # built, parameters not yet evaluated
    params: list[mx.array] = field(default_factory=list)
    next_param: int = 0
    done_bytes: int = 0
    total_bytes: int = 0
    waiting_for_room: bool = False
    said_waiting: bool = False  # the log line about it is written once

    @property
    def progress(self) -> float:
        return self.done_bytes / self.total_bytes if self.total_bytes else 0.0


Waiter = Callable[[AsyncEngine | None, EngineError | None], None]


@dataclass(slots=True)
class ModelSlot:
    """One configured model's state (fields written under the pool's lock)."""

    spec: ModelSpec
    default: bool
    keep_alive: float | None
    files: ModelFiles | None = None  # config + tokenizer, kept across unloads
    info: ModelInfo | None = None
    engine: PooledEngine | None = None
    client: AsyncEngine | None = None  # the asyncio face of `engine`
    load: _Load | None = None
    queued: bool = False  # waiting for the thread to start its load
    reading: bool = False  # its config and tokenizer are being read (AsyncPool.model_info)
    waiters: list[Waiter] = field(default_factory=list)
    pins: int = 0  # requests on their way into this model's engine
    last_used: float = 0.0
    error: str | None = None
    load_seconds: float | None = None

    @property
    def state(self) -> str:
        if self.engine is not None:
            return MODEL_LOADED
        busy = self.load is not None or self.queued or self.reading
        return MODEL_LOADING if busy else MODEL_UNLOADED


def size_text(num_bytes: int) -> str:
    """Bytes in GiB (MiB below a tenth of a GiB), for the log."""
    if num_bytes >= GiB / 10:
        return f"{num_bytes / GiB:.2f} GiB"
    return f"{num_bytes / (1 << 20):.1f} MiB"


def _weights_bytes(params: Sequence[mx.array]) -> int:
    return sum(int(p.nbytes) for p in params)


def info_of(files: ModelFiles, adapters: Sequence[str], extra: dict[str, Any] | None = None) -> ModelInfo:
    """The server's view of a model (no MLX objects)."""
    return ModelInfo(
        model_id=files.model_id, path=str(files.path), tokenizer=files.tokenizer,
        eos_token_ids=files.eos_token_ids, context_length=files.context_length,
        chat_template=files.chat_template, created=int(time.time()),
        extra=dict(extra or {}, vocab_size=files.vocab_size, adapters=list(adapters)),
    )


class _TooLarge(Exception):
    def __init__(self, need: int, budget: int):
        super().__init__(f"{need} bytes of weights, budget {budget}")
        self.need, self.budget = need, budget


def load_error(name: str, exc: BaseException) -> EngineError:
    """What a client is told about a model that cannot be loaded: the reason in a phrase, no
    paths or tracebacks (those go to the log)."""
    from engine.kv.batch import UnsupportedKV
    from engine.lora import AdapterError
    from engine.models.registry import UnsupportedArchitecture

    if isinstance(exc, _TooLarge):
        return EngineError(
            f"The model '{name}' needs {exc.need / GiB:.2f} GiB for its weights, more than the "
            f"memory budget of {exc.budget / GiB:.2f} GiB.", status=413,
            code="memory_budget_exceeded")
    if isinstance(exc, (UnsupportedArchitecture, UnsupportedKV, AdapterError)):
        why = str(exc).splitlines()[0]
    elif isinstance(exc, FileNotFoundError):
        text = str(exc)
        why = ("its weights (*.safetensors) are missing" if "safetensors" in text
               else "its config.json is missing" if "config.json" in text
               else "a file it needs is missing")
    elif isinstance(exc, json.JSONDecodeError):
        why = "its config.json is not valid JSON"
    elif isinstance(exc, (ValueError, KeyError, TypeError, AttributeError)):
        why = "its config.json or weights do not describe a model mlx-lm can build"
    else:
        why = f"{type(exc).__name__} while loading"
    return EngineError(f"The model '{name}' could not be loaded: {why}.", status=503,
                       code="model_load_failed")


class EnginePool(EngineThread):
    """The models and the one thread that drives their engines (thread-safe entry points:
    `request_load`, `pin`, `unpin`, `statuses`, `stop`)."""

    def __init__(self, specs: Sequence[ModelSpec], config: PoolConfig):
        if not specs:
            raise ValueError("no models to serve")
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be unique: {names}")
        self.config = config
        self.budget = config.engine.memory_budget or int(device_memory_bytes() * 0.75)
        self._engine_config = dataclasses.replace(config.engine, memory_budget=self.budget)
        self._wake = threading.Condition()
        self.slots = {s.name: ModelSlot(s, i == 0, config.keep_alive) for i, s in enumerate(specs)}
        self._queue: deque[ModelSlot] = deque()
        self._loading: ModelSlot | None = None
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.on_turn: Callable[[str], None] | None = None  # each engine turn / load unit, by name
        self.default = self.slots[specs[0].name]
        self._load_default()

    # -- start-up ----------------------------------------------------------------------------
    def _load_default(self) -> None:
        """The default model loads before serving (with the warm-up, if configured), on the
        caller's thread, as a single engine does (`EnginePool.spawn`: the pool's own)."""
        slot = self.default
        t0 = time.monotonic()
        spec = slot.spec
        slot.files = read_model_files(spec.source, chat_template=spec.chat_template,
                                      revision=spec.revision)
        loaded = build_model(slot.files, dtype=self.config.dtype, adapters=spec.adapters)
        flat = cast(list[tuple[str, mx.array]], tree_flatten(loaded.model.parameters()))
        log.info("loading model %s from %s (%s of weights)", spec.name, slot.files.path,
                 size_text(_weights_bytes([p for _, p in flat])))
        mx.eval(loaded.model.parameters())
        engine = PooledEngine(loaded, dataclasses.replace(self._engine_config), self._wake)
        self._install(slot, engine, time.monotonic() - t0)

    def _install(self, slot: ModelSlot, engine: PooledEngine, seconds: float) -> None:
        """The model is loaded: requests may join its engine."""
        client = AsyncEngine(engine)
        client.model.model_id = slot.spec.name
        if slot.info is None:
            slot.info = client.model
        with self._wake:
            slot.engine, slot.client, slot.load, slot.error = engine, client, None, None
            slot.load_seconds = seconds
            slot.last_used = time.monotonic()
        log.info("loaded model %s in %.2f s (%s of weights)", slot.spec.name, seconds,
                 size_text(engine.budget.weights))

    # -- thread-safe API -----------------------------------------------------------------------
    def slot(self, name: str | None) -> ModelSlot:
        """The configured model `name` (None: the default); EngineError 404 otherwise."""
        if name is None:
            return self.default
        slot = self.slots.get(name)
        if slot is None:
            raise EngineError(f"The model '{name}' does not exist.", status=404,
                              code="model_not_found")
        return slot

    def request_load(self, slot: ModelSlot, waiter: Waiter) -> AsyncEngine | None:
        """The model's client if it is loaded; else `waiter(client, error)` is called on the
        engine thread once its load ends (the load is queued unless it is under way)."""
        with self._wake:
            if slot.client is not None:
                return slot.client
            slot.waiters.append(waiter)
            if not slot.queued and slot.load is None:
                slot.queued = True
                self._queue.append(slot)
                self._wake.notify()
            return None

    def pin(self, slot: ModelSlot, keep_alive: float | None) -> None:
        """A request is on its way into this model: it is not unloaded until `unpin`. The
        request's keep-alive (None: the server's; negative: never) becomes the model's."""
        with self._wake:
            slot.pins += 1
            if keep_alive is None:
                slot.keep_alive = self.config.keep_alive
            else:
                slot.keep_alive = None if keep_alive < 0 else keep_alive

    def unpin(self, slot: ModelSlot) -> None:
        with self._wake:
            slot.pins -= 1
            slot.last_used = time.monotonic()
            self._wake.notify()  # a keep-alive may now run from here

    def statuses(self) -> list[ModelStatus]:
        now = time.monotonic()
        out = []
        with self._wake:
            for slot in self.slots.values():
                eng, load = slot.engine, slot.load
                idle = eng is not None and not self._busy(slot)
                out.append(ModelStatus(
                    name=slot.spec.name, state=slot.state,
                    progress=round(load.progress, 3) if load is not None
                    else 0.0 if slot.state == MODEL_LOADING else None,
                    weights_bytes=eng.budget.weights if eng is not None
                    else load.total_bytes if load is not None else 0,
                    load_seconds=slot.load_seconds,
                    idle_seconds=round(now - slot.last_used, 3) if idle else None,
                    keep_alive=slot.keep_alive, error=slot.error, default=slot.default))
        return out

    def engines(self) -> list[PooledEngine]:
        with self._wake:
            return [s.engine for s in self.slots.values() if s.engine is not None]

    # -- engine thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._wake:
                while not (self._has_work() or self._stopping):
                    if not self._wake.wait(self._wait_s()):
                        break
                if self._stopping:
                    break
            try:
                self._turn()
            except Exception:  # a bug must not stop every model: log it, go on
                log.exception("engine pool turn failed")
        for engine in self.engines():
            engine.shutdown()
        self._fail_loads(EngineError("the server is shutting down", status=503))

    def _has_work(self) -> bool:
        """Engine turns or load units to run (a load waiting for busy models to go idle is
        retried every ROOM_RETRY_S, see `_wait_s`)."""
        loading = self._loading
        return bool(self._queue) or (
            loading is not None and loading.load is not None and not loading.load.waiting_for_room
        ) or any(s.engine is not None and s.engine.has_pending() for s in self.slots.values())

    def _wait_s(self) -> float | None:
        """How long the thread may sleep: until the next keep-alive ends or idle memory is due
        to be given back (None: until woken)."""
        now, waits = time.monotonic(), []
        if self._loading is not None:
            waits.append(ROOM_RETRY_S)
        for slot in self.slots.values():
            if slot.engine is None:
                continue
            if slot.keep_alive is not None and slot.pins == 0:  # `unpin` wakes the thread
                waits.append(slot.last_used + slot.keep_alive - now)
            if slot.engine._steps_since_release:
                waits.append(slot.last_used + self.config.engine.idle_release_s - now)
        return max(0.0, min(waits)) if waits else None

    def _turn(self) -> None:
        for slot in list(self.slots.values()):
            engine = slot.engine
            if engine is None or not engine.has_pending():
                continue
            engine.budget.others = self._held(exclude=slot)
            engine.turn()
            slot.last_used = time.monotonic()
            self._traced(slot.spec.name)
        self._advance_load()
        self._expire()

    def _traced(self, what: str) -> None:
        if self.on_turn is not None:
            self.on_turn(what)

    def _busy(self, slot: ModelSlot) -> bool:
        """Rows queued or running, or a request on its way in (call under `_wake`)."""
        return slot.pins > 0 or (slot.engine is not None and slot.engine.has_pending())

    def _held(self, exclude: ModelSlot | None = None) -> int:
        """Bytes the models hold (weights + reserved KV), and the weights of the one loading."""
        total = 0
        for slot in self.slots.values():
            if slot is exclude:
                continue
            if slot.engine is not None:
                budget = slot.engine.budget
                total += budget.weights + budget.side + slot.engine.scheduler.reserved_bytes()
            elif slot.load is not None and not slot.load.waiting_for_room:
                total += slot.load.total_bytes
        return total

    def _expire(self) -> None:
        now = time.monotonic()
        for slot in self.slots.values():
            engine = slot.engine
            if engine is None:
                continue
            with self._wake:
                due = (slot.keep_alive is not None and not self._busy(slot)
                       and now - slot.last_used >= slot.keep_alive)
            if due:
                self._unload(slot, f"idle for {now - slot.last_used:.1f} s")
            elif engine._steps_since_release and not engine.has_pending() and (
                    now - slot.last_used >= self.config.engine.idle_release_s):
                engine.turn()  # idle: give its memory back

    def _unload(self, slot: ModelSlot, why: str) -> None:
        with self._wake:
            engine, slot.engine, slot.client = slot.engine, None, None
        weights = engine.budget.weights if engine is not None else 0
        del engine
        gc.collect()  # the model's modules hold reference cycles
        mx.clear_cache()
        log.info("unloaded model %s (%s), %s of weights freed", slot.spec.name, why,
                 size_text(weights))

    # -- loading, a unit per turn -------------------------------------------------------------
    def _advance_load(self) -> None:
        slot = self._loading
        if slot is None:
            with self._wake:
                if not self._queue:
                    return
                slot = self._queue.popleft()
                slot.queued = False
                slot.load = _Load(time.monotonic())
            self._loading = slot
        load = slot.load
        assert load is not None
        try:
            self._load_unit(slot, load)
        except Exception as exc:
            log.error("loading model %s (%s) failed: %s: %s", slot.spec.name, slot.spec.source,
                      type(exc).__name__, exc, exc_info=log.isEnabledFor(logging.DEBUG))
            self._end_load(slot, load_error(slot.spec.name, exc))
        self._traced(f"load:{slot.spec.name}")

    def _load_unit(self, slot: ModelSlot, load: _Load) -> None:
        """Build the model, make room, evaluate a slice of its parameters, or build its engine:
        whichever comes next."""
        if load.loaded is None:
            assert slot.files is not None  # AsyncPool.model_info read them before queueing
            load.loaded = build_model(slot.files, dtype=self.config.dtype,
                                      adapters=slot.spec.adapters)
            flat = cast(list[tuple[str, mx.array]], tree_flatten(load.loaded.model.parameters()))
            load.params = [p for _, p in flat]
            load.total_bytes = _weights_bytes(load.params)
            load.waiting_for_room = True
            log.info("loading model %s from %s (%s of weights)", slot.spec.name,
                     slot.files.path, size_text(load.total_bytes))
            if load.total_bytes > self.budget:
                raise _TooLarge(load.total_bytes, self.budget)
            return
        if load.waiting_for_room:
            load.waiting_for_room = not self._make_room(slot, load.total_bytes)
            if load.waiting_for_room and not load.said_waiting:
                load.said_waiting = True
                log.info("model %s waits for room: the loaded models are busy and hold %s of "
                         "the %s budget", slot.spec.name, size_text(self._held(exclude=slot)),
                         size_text(self.budget))
            return
        if load.next_param < len(load.params):
            self._eval_slice(load)
            return
        engine = PooledEngine(load.loaded, dataclasses.replace(self._engine_config, warmup=False),
                              self._wake)
        self._install(slot, engine, time.monotonic() - load.started)
        self._end_load(slot, None)

    def _eval_slice(self, load: _Load) -> None:
        group: list[mx.array] = []
        size = 0
        while load.next_param < len(load.params) and (not group or size < self.config.load_slice_bytes):
            p = load.params[load.next_param]
            group.append(p)
            size += int(p.nbytes)
            load.next_param += 1
        mx.eval(group)
        load.done_bytes += size

    def _make_room(self, slot: ModelSlot, need: int) -> bool:
        """Unload least-recently-used idle models until `need` more bytes fit (False: the
        others are busy; the load waits for them)."""
        while self._held(exclude=slot) + need > self.budget:
            with self._wake:
                idle = [s for s in self.slots.values()
                        if s is not slot and s.engine is not None and not self._busy(s)]
            if not idle:
                return False
            victim = min(idle, key=lambda s: s.last_used)
            self._unload(victim, f"to make room for {slot.spec.name}")
        return True

    def _end_load(self, slot: ModelSlot, error: EngineError | None) -> None:
        with self._wake:
            waiters, slot.waiters = slot.waiters, []
            slot.load = None
            if error is not None:
                slot.error = error.message
            client = slot.client
        self._loading = None
        if error is not None:
            gc.collect()
            mx.clear_cache()
        for waiter in waiters:
            waiter(client, error)

    def _fail_loads(self, error: EngineError) -> None:
        with self._wake:
            slots = [s for s in self.slots.values() if s.waiters]
            self._queue.clear()
        for slot in slots:
            slot.queued = False
            self._end_load(slot, error)
