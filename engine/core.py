"""The engine thread (owns MLX) and its asyncio bridge (`AsyncEngine`, an `EngineClient`).

The thread sleeps on a condition variable while there is no work, and wakes the moment a request
or an abort arrives: a new request joins at the next step, with no polling sleeps. Each step:

    self._drain_inbox()                          # admissions and aborts
    plan = scheduler.schedule()                  # prefill chunk, who joins the batch
    result = runner.run(plan)                    # the forwards (engine.runner)
    events = scheduler.update(plan, result)      # finished rows leave the batch at once

Embedding requests (engine.embed) come through the same inbox and run one batch at a time
between decode steps, so a decoding row waits at most one embedding batch for its next token.

With speculation on (engine.spec), the runner's decode width comes from
`Speculation.decide`; a width above 1 is one synchronous draft + verify step whose events carry
several tokens per row. `stats()` reads a snapshot the engine thread publishes (under a lock)
after its steps, never the scheduler's live state.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Self, cast

import mlx.core as mx

from engine.api import (
    FINISH_ABORT,
    FINISH_ERROR,
    MODEL_LOADED,
    EmbeddingRequest,
    EmbeddingResult,
    EngineError,
    EngineOverloaded,
    EngineStats,
    MemoryStats,
    ModelInfo,
    ModelStatus,
    Request,
    ScoreRequest,
    ScoreResult,
    TokenEvent,
    check_token_ids,
)
from engine.batch import EventSink, RowMeta
from engine.embed import Done, Embedder, EmbedJob
from engine.host_memory import memory_readings, release_idle_memory
from engine.kv import batch as kvb
from engine.kv.batch import KVConfig
from engine.kv.memory import MemoryBudget
from engine.kv.prefix_cache import NoPrefix, PrefixIndex
from engine.loader import LoadedModel
from engine.runner import (
    BUCKET_HIT_TOKENS,
    Runner,
    Shape,
    WarmUp,
    buckets_prefill_shapes,
    shapes_build_on_first_use,
)
from engine.scheduler import Plan, Scheduler, SchedulerConfig, StepResult, auto_prefill_budget
from engine.score import CHUNK as SCORE_CHUNK
from engine.score import ScoreDone, ScoreJob, Scorer
from engine.spec import SpecConfig, build_speculation
from engine.spec.decoder import Speculation
from engine.steptrace import StepTrace
from kernels.affine.prebuild import prebuild as prebuild_qmm

log = logging.getLogger("mlxd.engine")


# prefix-cache granularity in tokens: 64-token blocks cost a 4,000-token prefill a quarter of the
# per-block copies and trie work of 16-token ones (0.43 -> 0.10 s of its 7.7 s on a CPU; on a GPU
# that host work is most of a long prompt's time); a turn re-prefills at most 63 tokens more
PREFIX_BLOCK_SIZE = 64


@dataclass(slots=True)
class EngineConfig:
    scheduler: SchedulerConfig
    kv: KVConfig = field(default_factory=KVConfig)
    # the prefix cache's most bytes: None = a `PREFIX_CACHE_SHARE`th of the memory budget
    # (`--prefix-cache-bytes auto`), 0 = off; it never holds more than the budget leaves
    prefix_cache_bytes: int | None = None
    prefix_block_size: int = PREFIX_BLOCK_SIZE
    memory_budget: int | None = None  # None = 75 % of device memory
    # MLX keeps freed buffers for reuse up to this many bytes (None: the smaller of MLX's own
    # default and a tenth of the memory budget); 0 = no buffer cache
    mlx_cache_limit: int | None = None
    release_every_s: float = 10.0  # while busy, give idle memory back this often
    idle_release_s: float = 1.0  # and once the engine has been idle this long
    spec: SpecConfig | None = None  # speculative decoding (None: off)
    # run the first requests' shapes at start-up (Runner.warm_up); `mlxd serve` turns it on
    # (--no-warmup: off), engines built in code (tests, benchmarks) start without it
    warmup: bool = False
    # with the warm-up, also the long-prompt chunk widths the measured budget gives (off where
    # ranks must agree on that budget first: engine.distributed warms them after)
    warm_chunks: bool = True
    embed_batch_tokens: int = 4096  # padded tokens per embedding batch (one longer input: alone)
    trace_steps: str | None = None  # append each step's phases to this file (engine.steptrace)


# the automatic prefix cache is this fraction of the memory budget: 16 growing agent sessions on
# a 1B model's KV (32 KiB a token) need ~24 GiB to keep reusing their histories, a quarter of an
# H200's budget; on a 16 GiB Mac it is 3 GiB, and what the running rows need is evicted anyway
PREFIX_CACHE_SHARE = 4
SNAPSHOT_EVERY_S = 0.05  # while busy, stats() sees the engine's state at most this old
WARM_DECODE_ROWS = 16  # the warm-up runs the decode batch at 1..this many rows


def _on_new_thread(main: Callable[[threading.Thread], None]) -> None:
    """`main(thread)` on a new daemon thread."""
    thread = threading.Thread(target=lambda: main(thread), name="mlxd-engine", daemon=True)
    thread.start()


class EngineThread:
    """The one thread that owns MLX: `start` runs the subclass's `_loop` on it, `stop` sets
    `_stopping`, wakes it through `_wake` and joins it (the engine, the pool of engines).

    `spawn` builds the object on that thread in the first place. MLX keeps state per thread:
    on CUDA the command encoders, the default streams, cuDNN's attention graphs (one per exact
    shape, tens of ms each to build) and `mx.compile`'s functions. A warm-up run on the thread
    that built the engine leaves all of that behind for a loop on another thread to build
    again, in front of the first requests."""

    _thread: threading.Thread | None
    _wake: threading.Condition
    _stopping: bool

    def _loop(self) -> None:
        raise NotImplementedError

    @classmethod
    def spawn(cls, *args: Any, **kwargs: Any) -> Self:
        """`cls(*args, **kwargs)` built on a new thread, which then runs its loop (`start` is
        then a no-op); this thread waits for the build and raises what it raised."""
        return cls.spawn_on(_on_new_thread, *args, **kwargs)

    @classmethod
    def spawn_on(cls, run: Callable[[Callable[[threading.Thread], None]], None], *args: Any,
                 **kwargs: Any) -> Self:
        """`spawn` on the thread where `run(main)` calls `main(handle)`: it builds the object
        there and runs its loop, `handle` being what `stop` joins (a benchmark runs engines
        one after another on one thread this way)."""
        built: dict[str, Any] = {}
        done = threading.Event()

        def main(handle: threading.Thread) -> None:
            try:
                obj = cls(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                built["error"] = exc
                done.set()
                return
            obj._thread = handle
            built["obj"] = obj
            done.set()
            obj._loop()

        run(main)
        done.wait()
        if "error" in built:
            raise built["error"]
        return cast(Self, built["obj"])

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="mlxd-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            if not self._thread.is_alive():
                _wait_for_native_exit(getattr(self._thread, "native_id", None))
            self._thread = None


def _wait_for_native_exit(native_id: int | None, timeout: float = 2.0) -> None:
    """Wait until the OS thread `native_id` is gone (Linux: its /proc/self/task entry).

    `Thread.join` returns once the thread's Python state is released, before the OS thread runs
    its thread-local destructors. One of them is MLX's per-thread `mx.compile` cache, whose
    entries hold Python objects (mlx-lm's compiled activations, called on the engine thread):
    freeing them takes the GIL. If the interpreter is already finalizing by then (a script that
    stops its engine and exits), taking the GIL ends the thread with a forced unwind through a
    C++ destructor, and the process aborts ("terminate called without an active exception",
    exit status 134). Waiting here lets the destructors run while the interpreter is alive.
    Without /proc (macOS) this thread sleeps 50 ms instead, giving up the GIL they wait for."""
    if native_id is None:
        return
    if not os.path.isdir("/proc/self/task"):
        time.sleep(0.05)
        return
    task = f"/proc/self/task/{native_id}"
    deadline = time.monotonic() + timeout
    while os.path.exists(task) and time.monotonic() < deadline:
        time.sleep(0.001)


class Engine(EngineThread):
    """Owns MLX on one thread. Thread-safe entry points: `add`, `abort`, `stats`, `stop`."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None,
                 wake: threading.Condition | None = None):
        """`wake`: the condition (and lock) of the thread that drives this engine; engine.pool
        gives its engines one shared condition and drives them from its one thread."""
        self.loaded = loaded
        self.config = cfg = config or EngineConfig(SchedulerConfig())
        chunk = cfg.scheduler.prefill_chunk
        model = loaded.model
        kv = cfg.kv

        def make(num_rows: int) -> list[Any]:
            # no ring slack for speculation: a round writes only its accepted columns into the
            # target's rings (engine/spec/ringcommit.py), so they keep the plain engine's shape
            return kvb.new_batch(model, num_rows, kv)

        self.spec = build_speculation(cfg.spec, model, loaded.vocab_size)
        self.prefix: PrefixIndex | NoPrefix = (
            PrefixIndex(make, cfg.prefix_cache_bytes or 0, cfg.prefix_block_size, chunk)
            if cfg.prefix_cache_bytes != 0 else NoPrefix(make, chunk)
        )
        self.runner = Runner(model, kv, self.spec, self.prefix)
        self.spec = self.runner.spec  # NoSpec where an optional speculation cannot run
        self.runner.on_first = self._first_tokens
        if buckets_prefill_shapes(make(0)):  # MLX-CUDA: few prefill shapes, each built once
            self.runner.bucket_widths = True
            if isinstance(self.prefix, PrefixIndex):
                self.prefix.hit_blocks = max(1, BUCKET_HIT_TOKENS // self.prefix.block_size)
        self._trace = StepTrace(cfg.trace_steps) if cfg.trace_steps else None
        if self._trace is not None:
            self.runner.timings = {}
        # after the runner's start-up checks: this runs the first forward
        self.budget = self._new_budget(
            model, cfg.memory_budget,
            dict(kv_bits=kv.kv_bits, kv_group_size=kv.kv_group_size, max_kv_size=kv.max_kv_size),
        )
        if cfg.prefix_cache_bytes is None and isinstance(self.prefix, PrefixIndex):
            self.prefix.cache.max_bytes = self.budget.budget // PREFIX_CACHE_SHARE
        self.scheduler = Scheduler(
            cfg.scheduler, make, loaded.vocab_size, self.budget, self.prefix, self.spec
        )
        self.warm_up: WarmUp | None = self._warm_up() if cfg.warmup else None
        self._warm_up_spec()
        self.mlx_cache_limit = self._apply_cache_limit(cfg.mlx_cache_limit)
        self._steps_since_release = 0
        self._last_release = time.monotonic()
        self._num_releases = 0
        self._release_seconds = 0.0
        self._sinks: dict[str, EventSink] = {}
        self._inbox: deque[tuple[str, Any]] = deque()
        self._wake = wake or threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._last_error: str | None = None
        self._num_steps = 0
        self._num_generated = 0
        self.num_prompt_tokens = 0  # counted by AsyncEngine.submit (event-loop thread)
        # what max_queue bounds: requests admitted and not yet in a prefill group, less those
        # aborted (they stop counting when `abort` is called, not when the engine reaps them)
        self._queued: set[str] = set()
        self.embedder = Embedder.for_model(loaded, self.budget, cfg.embed_batch_tokens)
        # a scoring chunk ends on a block boundary and fits a prefill chunk (prefix_cache)
        bs = self.prefix.block_size
        self.scorer = Scorer(self.runner.logits, lambda: self.runner.new_caches(1), kvb.state_arrays,
                             loaded.context_length, loaded.vocab_size, self.budget,
                             max(bs, min(SCORE_CHUNK, self.prefix.chunk) // bs * bs),
                             store=self.prefix.store_scored, resume=self.prefix.scored_prefix)
        self._snapshot_lock = threading.Lock()
        self._snapshot = EngineStats()
        self._snapshot_at = 0.0
        self._publish()

    # -- thread-safe API -------------------------------------------------------------------

    def add(self, request: Request, sink: EventSink) -> None:
        self.enqueue(self._validate(request), sink)

    def enqueue(self, row: RowMeta, sink: EventSink) -> None:
        """Queue a validated row; EngineOverloaded when max_queue requests are queued."""
        with self._wake:
            if len(self._queued) >= self.config.scheduler.max_queue:
                raise EngineOverloaded(
                    f"the server is busy: {self.config.scheduler.max_queue} requests are already "
                    "waiting; retry shortly",
                    retry_after=1.0,
                )
            self._queued.add(row.req_id)
            self._inbox.append(("add", (row, sink)))
            self._wake.notify()

    def abort(self, req_id: str) -> None:
        """Idempotent; safe for finished or unknown ids. The request gives its queue place back
        here and now (a disconnect never holds one until the engine thread reaps the abort); one
        still in the inbox is dropped at once."""
        with self._wake:
            self._queued.discard(req_id)
            for item in self._inbox:
                if item[0] == "add" and item[1][0].req_id == req_id:
                    self._inbox.remove(item)
                    row, sink = item[1]
                    sink([self.scheduler.abort_event(row)])
                    return
            self._inbox.append(("abort", req_id))
            self._wake.notify()

    def add_embedding(self, request: EmbeddingRequest, done: Done) -> EmbedJob:
        """Queue an embedding request (checked first: EngineError); `done(result, error)` is
        called once on the engine thread. Set the returned job's `cancelled` to drop it."""
        self.embedder.check(request)
        return self._queue_job("embed", EmbedJob(request, done), len(self.embedder.jobs),
                               "embedding requests")

    def add_scoring(self, request: ScoreRequest, done: ScoreDone) -> ScoreJob:
        """Queue a prompt to score (checked first: EngineError); `done(result, error)` is called
        once on the engine thread. Set the returned job's `cancelled` to drop it."""
        self.scorer.check(request)
        return self._queue_job("score", ScoreJob(request, done), len(self.scorer.jobs),
                               "prompts to score")

    def _queue_job(self, kind: str, job: Any, held: int, what: str) -> Any:
        """Into the inbox, unless `max_queue` jobs of this kind wait (`held` of them already
        with the engine thread): EngineOverloaded."""
        with self._wake:
            queued = held + sum(1 for k, _ in self._inbox if k == kind)
            if queued >= self.config.scheduler.max_queue:
                raise EngineOverloaded(f"the server is busy: {queued} {what} are already "
                                       "waiting; retry shortly", retry_after=1.0)
            self._inbox.append((kind, job))
            self._wake.notify()
        return job

    def _dequeue(self, rows: list[RowMeta]) -> None:
        """Engine thread: these rows left the waiting queue for a prefill group (`_fail_all`
        resets the set to the inbox's requests)."""
        with self._wake:
            self._queued.difference_update(r.req_id for r in rows)

    def stats(self) -> EngineStats:
        """Thread-safe: the engine thread's last snapshot, with the queue and process memory
        as they are now."""
        with self._snapshot_lock:
            s = copy.deepcopy(self._snapshot)
        with self._wake:
            s.num_waiting += sum(1 for k, _ in self._inbox if k == "add")
            s.num_queued = len(self._queued)
        s.num_prompt_tokens = self.num_prompt_tokens
        mem = s.memory
        for key, value in memory_readings().items():
            if hasattr(mem, key):
                setattr(mem, key, value)
        return s

    def _publish(self) -> None:
        """Engine thread: a snapshot of the scheduler's state for `stats`."""
        sched = self.scheduler
        group = sched.prefill
        by_layout = kvb.bytes_by_layout(sched.running.caches)
        if group is not None:
            for k, v in kvb.bytes_by_layout(group.caches).items():
                by_layout[k] = by_layout.get(k, 0) + v
        snap = EngineStats(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            num_prefilling=len(group.rows) if group is not None else 0,
            active_requests=len(self._sinks),
            kv_bytes=sum(by_layout.values()),
            kv_bytes_by_layout=by_layout,
            num_steps=self._num_steps,
            num_generated_tokens=self._num_generated,
            memory=MemoryStats(
                budget_bytes=self.budget.budget, weights_bytes=self.budget.weights,
                mlx_cache_limit=self.mlx_cache_limit, num_releases=self._num_releases,
                release_seconds=round(self._release_seconds, 3),
            ),
            prefix_cache=self.prefix.stats(),
            spec=self.spec.stats(),
            last_error=self._last_error,
        )
        with self._snapshot_lock:
            self._snapshot = snap
        self._snapshot_at = time.monotonic()

    def _apply_cache_limit(self, limit: int | None) -> int:
        """Bound MLX's buffer cache (process-wide); returns the limit in force."""
        mlx_default = mx.set_cache_limit(0)
        if limit is None:
            limit = min(mlx_default, self.budget.budget // 10)
        mx.set_cache_limit(limit)
        return limit

    def _release_memory(self, background: bool = False) -> None:
        """MLX's cached buffers and malloc's free pages back to the OS (engine thread; the
        malloc trim on a helper thread when `background`, i.e. while requests are running)."""
        t0 = time.monotonic()
        release_idle_memory(background=background)
        self._last_release = now = time.monotonic()
        self._release_seconds += now - t0
        self._steps_since_release = 0
        self._num_releases += 1

    def _validate(self, request: Request) -> RowMeta:
        n = len(request.prompt_ids)
        ctx = self.loaded.context_length
        if n == 0:
            raise EngineError("the prompt is empty", status=400, code="empty_prompt")
        if n >= ctx:
            raise EngineError(
                f"this model's maximum context length is {ctx} tokens; the prompt has {n} "
                "tokens and no room is left to generate",
                status=400,
                code="context_length_exceeded",
            )
        check_token_ids(request.prompt_ids, self.loaded.vocab_size)
        if request.prediction_ids:  # nothing past the context could be copied
            request.prediction_ids = request.prediction_ids[: ctx - n]
            check_token_ids(request.prediction_ids, self.loaded.vocab_size, " in the prediction")
        params = request.params
        # no limit (None): the room left in the context
        max_new = ctx - n if params.max_tokens is None else max(1, min(params.max_tokens, ctx - n))
        chunk = self.prefix.chunk  # the prefill chunk the scheduler runs
        if not self.budget.fits_alone(n, max_new, chunk):
            need = self.budget.alone_bytes(n, max_new, chunk)
            raise EngineError(
                f"this request needs about {need / 2**20:.0f} MiB (weights, KV for {n} prompt "
                f"and {max_new} new tokens, prefill activations), more than the memory budget of "
                f"{self.budget.budget / 2**20:.0f} MiB; lower max_tokens or the prompt",
                status=413,
                code="memory_budget_exceeded",
            )
        try:
            adapter = self.runner.adapter_index(request.adapter)
        except KeyError:
            raise EngineError(f"no adapter {request.adapter!r} is served with this model",
                              status=404, code="model_not_found") from None
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(self.loaded.eos_token_ids)
        return RowMeta(
            request=request,
            queued_at=time.perf_counter(),
            num_prompt_tokens=n,
            max_new_tokens=max_new,
            stop_ids=frozenset(stop_ids),
            constraint=self._compile_constraint(params.constraint),
            adapter=adapter,
        )

    def _warm_up(self) -> WarmUp:
        """The first requests' shapes run before serving (engine.runner, `Runner.warm_up`), one
        log line before and after, a progress bar when it takes over a second; the auto prefill
        budget is sized from the prefill rate it measures."""
        sched = self.config.scheduler
        seconds = prebuild_qmm(self.loaded.model)  # CUDA: MLX's JIT-built row tiles, in parallel
        if seconds > 1.0:
            log.info("built MLX-CUDA's quantized-matmul kernels in %.1f s (kept on disk for "
                     "later starts)", seconds)
        chunk, rows = self.prefix.chunk, min(sched.max_num_seqs, WARM_DECODE_ROWS)
        per_shape = shapes_build_on_first_use()
        shapes = self.runner.warm_up_shapes(chunk, rows, per_shape)
        if per_shape:
            log.info("warming up: prefill %d x %d and %d x %d tokens, decode 1..%d rows",
                     shapes[0][1], shapes[0][2], shapes[1][1], shapes[1][2], rows)
        else:
            log.info("warming up: a %d-token prompt, then the prefill rate of %d tokens",
                     shapes[0][2], chunk)
        from tqdm import tqdm

        # shown after a second, on a terminal only (disable=None: off when stderr is not a tty)
        with tqdm(total=len(shapes), desc="warming up", unit="shape", delay=1.0, leave=False,
                  disable=None) as bar:

            def step(shape: Shape) -> None:
                del shape
                bar.update()

            warm = self.runner.warm_up(chunk, rows, self.loaded.vocab_size, step, per_shape)
        budget = "set by --prefill-budget"
        if sched.prefill_budget is None:
            self.scheduler.prefill_budget = auto_prefill_budget(
                warm.prefill_tokens_per_s, chunk, sched.prefill_step_s)
            budget = f"auto, {sched.prefill_step_s * 1e3:.0f} ms of prefill per step"
        self.scheduler.size_idle_chunk(warm.prefill_tokens_per_s)
        if self.config.warm_chunks and per_shape:
            self.warm_chunks()
        log.info("warm-up done in %.2f s (%d shapes); prefill %.0f tokens/s; prefill budget %d "
                 "row-tokens per step (%s); long prompts in chunks of %s tokens",
                 warm.seconds, len(warm.shapes), warm.prefill_tokens_per_s,
                 self.scheduler.prefill_budget, budget,
                 "/".join(str(w) for w in [chunk, *self.scheduler.chunk_widths()]))
        return warm

    def warm_chunks(self) -> None:
        """Run the long-prompt chunk widths the prefill budget gives (`Scheduler.chunk_widths`)
        once, so that a long prompt's first chunks build nothing."""
        widths = self.scheduler.chunk_widths()
        if widths:
            self.runner.warm_prefill(widths, self.loaded.vocab_size)

    def _warm_up_spec(self) -> None:
        """The speculative shapes built now, not while serving (on a GPU unless configured)."""
        spec, cfg = self.spec, self.config.spec
        if not isinstance(spec, Speculation) or cfg is None:
            return
        warm = cfg.warmup
        if warm is None:
            from kernels.common import gpu_backend

            warm = gpu_backend() is not None and cfg.method != "prediction"
        if warm:
            try:
                spec.warm_up(self.runner, self.loaded.vocab_size)
            except Exception:  # serving works without it: its shapes are then built on first use
                log.exception("speculative warm-up failed; continuing without it")

    def _compile_constraint(self, spec: Any) -> Any:
        """The row's grammar matcher (None when unconstrained); a bad spec is a 400 here,
        before anything is queued."""
        if spec is None:
            return None
        from engine.constrain import ConstraintError, compile_constraint

        lm = self.loaded
        try:
            return compile_constraint(spec, lm.tokenizer, lm.vocab_size, lm.eos_token_ids)
        except ConstraintError as exc:
            raise EngineError(str(exc), status=400, code="invalid_constraint") from None
        except ImportError:
            raise EngineError("structured output needs the 'llguidance' package", status=400,
                              code="constraints_unavailable") from None

    # -- engine thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._wake:
                # with memory to give back, wait for work only idle_release_s, then release it
                wait_s = self.config.idle_release_s if self._steps_since_release else None
                while not (self.has_pending() or self._stopping):
                    if not self._wake.wait(wait_s):
                        break
                if self._stopping:
                    break
            self.turn()
        self.shutdown()

    def has_pending(self) -> bool:
        """Admissions, aborts or rows to run (the caller holds `_wake` for an exact answer)."""
        return bool(self._inbox) or self._has_work()

    def turn(self) -> None:
        """Engine thread: admissions and aborts, one step, one embedding batch; with nothing to
        do, give idle memory back."""
        if not self.has_pending():
            self._release_memory()  # idle: give back what the last burst left behind
            self._publish()
            return
        try:
            self._drain_inbox()
            if self.runner.in_flight or self.scheduler.has_work():
                self._step()
            if self.embedder.has_work():
                self._embed_step()
            if self.scorer.has_work() and self.scorer.step(self._held_bytes(), self._decoding()):
                self._steps_since_release += 1
        except Exception as exc:  # a bug must not kill the server: fail the rows, go on
            log.exception("engine step failed")
            self._last_error = f"{type(exc).__name__}: {exc}"
            self._fail_all(self._last_error)
        if not self._has_work() or time.monotonic() - self._snapshot_at >= SNAPSHOT_EVERY_S:
            self._publish()

    def shutdown(self) -> None:
        """Engine thread, at the end: every request still open ends (abort)."""
        self._fail_all("the engine is shutting down", reason=FINISH_ABORT)
        self._fail_jobs("the engine is shutting down")
        self._publish()
        if self._trace is not None:
            self._trace.close()
            self._trace = None

    def _new_budget(self, model: Any, budget: int | None, kv_kwargs: dict[str, Any]) -> MemoryBudget:
        """The memory admission this engine runs under (engine.pool shares one among models)."""
        return MemoryBudget.for_model(model, budget, kv_kwargs)

    def _has_work(self) -> bool:
        return (self.runner.in_flight or self.scheduler.has_work() or self.embedder.has_work()
                or self.scorer.has_work())

    def _fail_jobs(self, message: str) -> None:
        """Every queued embedding and scoring request fails with `message`."""
        with self._wake:
            queued = [(kind, job) for kind, job in self._inbox if kind in ("embed", "score")]
            self._inbox = deque(item for item in self._inbox if item[0] not in ("embed", "score"))
        for kind, job in queued:
            (self.embedder if kind == "embed" else self.scorer).add(job)
        self.embedder.fail_all(message)
        self.scorer.fail_all(message)

    def _decoding(self) -> bool:
        return bool(self.runner.in_flight or self.scheduler.has_work())

    def _held_bytes(self) -> int:
        """Memory the running rows hold, which embedding and scoring work must fit beside."""
        return self.scheduler.reserved_bytes()

    def _embed_step(self) -> None:
        """One embedding batch, under the memory the running rows leave."""
        if self.embedder.step(self._held_bytes(), self._decoding()):
            self._steps_since_release += 1

    def _drain_inbox(self) -> None:
        while True:
            with self._wake:
                if not self._inbox:
                    return
                kind, payload = self._inbox.popleft()
            if kind == "add":
                row, sink = payload
                self._sinks[row.req_id] = sink
                self.scheduler.add(row)
            elif kind == "embed":
                self.embedder.add(payload)
            elif kind == "score":
                self.scorer.add(payload)
            else:
                row = self.scheduler.abort(payload)
                if row is not None:
                    self._emit([self.scheduler.abort_event(row)])

    def _step(self) -> None:
        start = time.perf_counter()
        sched = self.scheduler
        if self.runner.timings is not None:
            self.runner.timings.clear()  # what the runner ran outside steps (the warm-up)
        plan = sched.schedule()
        scheduled = time.perf_counter()
        prefill_from = plan.prefill.done if plan.prefill is not None else 0
        if plan.prefill is not None:
            self._dequeue(plan.prefill.rows)  # a started row no longer counts against max_queue
        result = self.runner.run(plan)
        num_rows = len(plan.batch)
        ran = time.perf_counter()
        events = sched.update(plan, result)
        updated = time.perf_counter()
        self._num_steps += 1
        self._num_generated += sum(len(e.token_ids) for e in events)
        self._steps_since_release += 1
        if time.monotonic() - self._last_release >= self.config.release_every_s:
            self._release_memory(background=True)  # a never-idle server gives memory back too
        if events:
            self._emit(events)
        if result.width:  # the speculation learns what a step costs
            seconds = time.perf_counter() - start
            # typical: no prefill, and no row left the batch (moving rows into the freed
            # slots is once-off work, and may wait for the step in flight)
            left = num_rows > len(sched.running)
            self.spec.record(num_rows, result.width, seconds, plan.prefill is None and not left)
        if self._trace is not None:
            self._trace_step(plan, result, start, scheduled, ran, updated, prefill_from, num_rows)

    def _first_tokens(self, plan: Plan, first: StepResult) -> None:
        """The runner read a prefill's first tokens: out to the clients before the step goes on
        (the prompt's blocks into the prefix cache, the rows' join and first decode launch)."""
        events = self.scheduler.row_events(first)
        self._num_generated += sum(len(e.token_ids) for e in events)
        if events:
            self._emit(events)

    def _trace_step(self, plan: Plan, result: StepResult, start: float, scheduled: float,
                    ran: float, updated: float, prefill_from: int, num_rows: int) -> None:
        """One line of the step trace (engine.steptrace)."""
        assert self._trace is not None and self.runner.timings is not None
        end = time.perf_counter()
        group = plan.prefill
        record: dict[str, Any] = {
            "t": round(start, 6), "seconds": round(end - start, 6),
            "schedule": round(scheduled - start, 6),
            **{k: round(v, 6) for k, v in self.runner.timings.items()},
            "update": round(updated - ran, 6), "emit": round(end - updated, 6),
            "decode_rows": num_rows, "width": result.width,
            "prefill_rows": len(group.rows) if group is not None else 0,
            "prefill_cols": plan.prefill_end - prefill_from if group is not None else 0,
            "prefill_cached": (sum(r.num_cached_tokens for r in group.rows)
                               if group is not None and prefill_from == 0 else 0),
            "joined": len(plan.join) if plan.join is not None else 0,
        }
        self._trace.write(record)

    def _emit(self, events: list[TokenEvent]) -> None:
        by_sink: dict[int, tuple[EventSink, list[TokenEvent]]] = {}
        finished = False
        for ev in events:
            sink = self._sinks.get(ev.req_id)
            if sink is None:
                continue
            by_sink.setdefault(id(sink), (sink, []))[1].append(ev)
            if ev.finish_reason is not None:
                del self._sinks[ev.req_id]
                finished = True
        if finished:  # a client told its request ended sees stats() without it
            self._publish()
        for sink, evs in by_sink.values():
            try:
                sink(evs)
            except Exception:  # noqa: BLE001 - a broken consumer ends its requests, not the engine
                log.exception("an event sink failed; its requests are aborted")
                self._drop_sink(sink)

    def _drop_sink(self, sink: EventSink) -> None:
        """Abort every request that delivers to `sink` (it failed): their rows leave at once
        (KV freed, queue places given back), and nothing is delivered to it again."""
        for req_id in [r for r, s in self._sinks.items() if s is sink]:
            del self._sinks[req_id]
            self.scheduler.abort(req_id)
            with self._wake:
                self._queued.discard(req_id)

    def _fail_all(self, message: str, reason: str = FINISH_ERROR) -> None:
        sched = self.scheduler
        rows = list(sched.waiting) + (sched.prefill.rows if sched.prefill else []) + sched.running.rows
        sched.waiting.clear()
        sched.prefill = None
        for row in rows:  # prefix hits looked up for rows that will never run
            sched.prefix.forget(row)
        sched.running.take([])
        self.runner.reset()
        events = []
        for row in rows:
            ev = sched.abort_event(row, reason)
            ev.error = message if reason == FINISH_ERROR else None
            events.append(ev)
        self._emit(events)
        # requests the scheduler lost track of (a step that failed after taking rows off the
        # waiting queue, before their prefill group existed) still end, and no queue place stays
        # held by anything but the requests still in the inbox
        error = message if reason == FINISH_ERROR else None
        self._emit([TokenEvent(req_id=r, token_ids=[], finish_reason=reason, error=error)
                    for r in list(self._sinks)])
        with self._wake:
            self._queued &= {item[1][0].req_id for item in self._inbox if item[0] == "add"}


# A request refused for a full queue is retried this many event-loop turns before its 429: a
# client that left a moment ago holds its queue place until its disconnect reaches `abort` (lost
# connection -> the SSE watcher -> abort: a turn or two of this loop). A burst of requests that
# arrives with that disconnect must not be turned away for it.
OVERLOAD_SETTLE_TURNS = 4


class AsyncEngine:
    """The `EngineClient` the server uses: an asyncio face on the engine thread."""

    def __init__(self, engine: Engine):
        self.engine = engine
        loaded = engine.loaded
        self.model = ModelInfo(
            model_id=loaded.model_id,
            path=str(loaded.path),
            tokenizer=loaded.tokenizer,
            eos_token_ids=loaded.eos_token_ids,
            context_length=loaded.context_length,
            chat_template=loaded.chat_template,
            created=int(time.time()),
            extra=dict(loaded.extra, vocab_size=loaded.vocab_size, dtype=loaded.dtype),
        )
        self.model.extra.pop("config", None)
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self.engine.start()

    def stop(self) -> None:
        self.engine.stop()

    async def submit(self, request: Request) -> AsyncIterator[TokenEvent]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()

        def sink(events: list[TokenEvent]) -> None:  # runs on the engine thread
            loop.call_soon_threadsafe(_put_all, queue, events)

        if not request.arrival_time:
            request.arrival_time = time.time()
        row = self.engine._validate(request)  # raises EngineError
        await self._enqueue(row, sink)  # raises EngineOverloaded
        with self.engine._wake:
            self.engine.num_prompt_tokens += len(request.prompt_ids)
        return self._stream(request.req_id, queue)

    async def _enqueue(self, row: RowMeta, sink: EventSink) -> None:
        for _ in range(OVERLOAD_SETTLE_TURNS):
            try:
                return self.engine.enqueue(row, sink)
            except EngineOverloaded:
                await asyncio.sleep(0)  # let disconnects already on this loop reach `abort`
        self.engine.enqueue(row, sink)

    async def _stream(self, req_id: str, queue: asyncio.Queue[TokenEvent]) -> AsyncIterator[TokenEvent]:
        finished = False
        try:
            while True:
                event = await queue.get()
                if event.finish_reason is not None:
                    finished = True
                yield event
                if finished:
                    return
        finally:
            if not finished:
                self.engine.abort(req_id)

    def abort(self, req_id: str) -> None:
        self.engine.abort(req_id)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def list_models(self) -> list[ModelStatus]:
        """The one model, always loaded."""
        return [ModelStatus(self.model.model_id, MODEL_LOADED, default=True,
                            weights_bytes=self.engine.budget.weights)]

    async def model_info(self, name: str) -> ModelInfo:
        if name != self.model.model_id:
            raise EngineError(f"The model '{name}' does not exist.", status=404,
                              code="model_not_found")
        return self.model

    async def embed(self, request: EmbeddingRequest) -> EmbeddingResult:
        """Queue `request` on the engine thread and wait for its vectors; cancelling the wait
        drops its rows that have not run."""
        return await _wait_for_job(request, lambda done: self.engine.add_embedding(request, done))

    async def score(self, request: ScoreRequest) -> ScoreResult:
        """Queue the prompt on the engine thread and wait for its logprobs; cancelling the wait
        drops the job before its next chunk."""
        return await _wait_for_job(request, lambda done: self.engine.add_scoring(request, done))


async def _wait_for_job(request: Any, add: Any) -> Any:
    """`add(done)` queues a job whose `done(result, error)` runs on the engine thread; the
    result (or the error, raised) comes back to this event loop."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, error: EngineError | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def done(result: Any, error: EngineError | None) -> None:
        try:  # runs on the engine thread
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the event loop is gone: nobody waits for this result
            pass

    if not request.arrival_time:
        request.arrival_time = time.time()
    job = add(done)  # raises EngineError / EngineOverloaded
    try:
        return await future
    except asyncio.CancelledError:  # the caller left (this also cancels `future`)
        job.cancelled = True
        raise


def _put_all(queue: asyncio.Queue[TokenEvent], events: list[TokenEvent]) -> None:
    for ev in events:
        queue.put_nowait(ev)
