"""Tensor- and pipeline-parallel serving: N processes (ranks) run one engine in lockstep.

Rank 0 runs the HTTP server and the real engine (engine.core); every other rank runs
`Follower.run`, the same scheduler, runner, prefix cache and speculation, on its own shard of
the weights and its own KV (its heads under tensor parallelism, its layers under pipeline
parallelism). The model's own collectives (mlx-lm's `shard()` / `pipeline()`) need every rank
to run the same forwards with the same inputs, so every decision that depends on what only rank
0 sees or measures is made there and sent to the others at the point where it is made:

* requests admitted (the request, its output limit and stop ids; an unseeded request gets its
  seed here, so that every rank samples the same token) and aborted, in inbox order;
* which waiting rows the scheduler looked up in the prefix cache and picked for the next
  prefill group, with its chunk (the pick depends on the measured prefill budget and on memory
  admission); the prefill budget and idle chunk themselves are agreed once, at start-up
  (`agree_on_budget`);
* what the speculation learned from each step's measured cost (`Speculation.record`), so its
  width and draft ceilings come out the same everywhere.

Everything else (the group's chunks, joins, the KV layouts' merges and filters, prefix-cache
inserts and evictions, sampling) is a deterministic function of that, and runs on every rank.
Logits are identical on every rank (the last collective of a forward is an all-reduce or an
all-gather), so each rank samples the same tokens from the same seeds. Each message carries the
tokens rank 0 produced in the previous step; a rank whose own differ stops with an error
instead of serving a diverged KV.

One message per step, `StepMessage`, pickled and broadcast by `Channel` as int32 arrays through
`mx.distributed.all_sum` (rank 0 contributes the bytes, the others zeros). While idle rank 0
sends a heartbeat every `HEARTBEAT_S`. A rank that dies makes the next collective fail at once;
one that hangs is caught by a watchdog after `rank_timeout` seconds; either way rank 0 fails
its requests with 503 and exits with `GROUP_FAILED` (docs/distributed.md).
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import random
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from engine.api import FINISH_ERROR, EngineError, Request, TokenEvent
from engine.batch import RowMeta
from engine.core import AsyncEngine, Engine, EngineConfig
from engine.host_memory import release_idle_memory
from engine.kv.prefix_cache import PrefixIndex
from engine.loader import LoadedModel
from engine.runner import shapes_build_on_first_use
from engine.scheduler import Plan, Scheduler, StepResult

log = logging.getLogger("mlxd.distributed")

GROUP_FAILED = 75  # exit status of a rank whose group broke (EX_TEMPFAIL: --supervise restarts)
HEARTBEAT_S = 2.0  # an idle rank 0 tells the others it is alive this often
EXIT_GRACE_S = 1.0  # after a failure, the 503 responses get this long to go out before exit
HEAD_WORDS = 512  # int32 words of the first collective of a message (longer ones take two)

# (looked up, picked, their cached tokens, the most columns a step of the group runs)
Pick = tuple[list[str], list[str], list[int], int]


class GroupError(RuntimeError):
    """The ranks disagree (model files, a step's tokens) or one of them is gone."""


# -- the channel -----------------------------------------------------------------------------


class Channel:
    """Rank 0's bytes to every rank over the group's all_sum (zeros from the other ranks)."""

    def __init__(self, group: Any, stream: Any = None) -> None:
        self.group = group
        # ring / JACCL / MPI reduce host arrays on the CPU stream; NCCL needs the GPU's
        self.stream = mx.cpu if stream is None else stream
        self.rank = int(group.rank())
        self.size = int(group.size())
        self.num_messages = 0
        self.seconds = 0.0  # time spent in broadcasts (the plan exchange's share of a step)

    def _sum(self, words: np.ndarray) -> np.ndarray:
        out = mx.distributed.all_sum(mx.array(words), group=self.group, stream=self.stream)
        return np.asarray(out)

    def broadcast(self, payload: bytes | None) -> bytes:
        """Rank 0 passes `payload`, the others None; every rank gets rank 0's bytes. The first
        collective carries the length and up to `HEAD_WORDS - 1` words; a longer message
        sends the rest in a second one."""
        t0 = time.perf_counter()
        head = np.zeros(HEAD_WORDS, np.int32)
        words = np.zeros(0, np.int32)
        if self.rank == 0:
            assert payload is not None
            padded = payload + b"\0" * (-len(payload) % 4)
            words = np.frombuffer(padded, np.int32)
            head[0] = len(payload)
            head[1 : 1 + min(len(words), HEAD_WORDS - 1)] = words[: HEAD_WORDS - 1]
        head = self._sum(head)
        n = int(head[0])
        if n <= 0:  # a broken ring hands back zeros instead of raising
            raise GroupError("rank 0's message did not arrive: the distributed group is broken")
        num_words = -(-n // 4)
        data = head[1 : 1 + num_words]
        if num_words > HEAD_WORDS - 1:
            rest = np.zeros(num_words - (HEAD_WORDS - 1), np.int32)
            if self.rank == 0:
                rest[:] = words[HEAD_WORDS - 1 :]
            data = np.concatenate([data, self._sum(rest)])
        self.num_messages += 1
        self.seconds += time.perf_counter() - t0
        return data.tobytes()[:n]

    def gather_bytes(self, data: bytes, width: int) -> list[bytes]:
        """Every rank's `width`-byte value (width a multiple of 4), in rank order."""
        words = np.frombuffer(data.ljust(width, b"\0")[:width], np.int32)
        out = mx.distributed.all_gather(mx.array(words), group=self.group, stream=self.stream)
        flat = np.array(out).tobytes()
        return [flat[r * width : (r + 1) * width] for r in range(self.size)]

    def gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's list of (non-negative, < 2**62) ints, in rank order."""
        arr = np.array(values, np.int64).view(np.int32)
        out = np.array(mx.distributed.all_gather(mx.array(arr), group=self.group,
                                                 stream=self.stream))
        per = out.reshape(self.size, -1).view(np.int64)
        return [[int(v) for v in row] for row in per]


# -- start-up checks -------------------------------------------------------------------------

FINGERPRINT_EDGE = 1 << 20  # bytes read at each end of a weight file


def model_fingerprint(path: Path) -> bytes:
    """A digest of a model directory that differs when its files do: the small files (config,
    tokenizer, index) whole, and for each weight file its name, size, safetensors header and
    first and last MiB. Cheap for a 70B model, unlike hashing every byte."""
    h = hashlib.sha256()
    for file in sorted(p for p in path.iterdir() if p.is_file()):
        size = file.stat().st_size
        h.update(f"{file.name}\0{size}\0".encode())
        with file.open("rb") as f:
            if file.suffix != ".safetensors" or size <= 2 * FINGERPRINT_EDGE:
                h.update(f.read())
                continue
            head_len = int.from_bytes(f.read(8), "little")
            f.seek(0)
            h.update(f.read(8 + min(head_len, 1 << 26) + FINGERPRINT_EDGE))
            f.seek(size - FINGERPRINT_EDGE)
            h.update(f.read())
    return h.digest()


def check_same_model(channel: Channel, path: Path) -> None:
    """GroupError on every rank when some rank's model files differ from rank 0's."""
    digests = channel.gather_bytes(model_fingerprint(path), 32)
    odd = [r for r, d in enumerate(digests) if d != digests[0]]
    if odd:
        ranks = ", ".join(str(r) for r in odd)
        raise GroupError(f"the model files of rank(s) {ranks} differ from rank 0's ({path}); "
                         "copy the same model directory to every host")


def agree_on_memory(channel: Channel, engine: Engine) -> None:
    """Rank 0 admits requests for every rank: its memory budget counts the largest rank's
    weights. The prefix cache's evictions must fall alike on every rank, so its blocks must
    cost the same bytes everywhere (true of tensor parallelism; pipeline stages must hold
    alike layers)."""
    budget = engine.budget
    per_token = budget.footprint.bytes_per_token()
    cache = engine.prefix.cache if isinstance(engine.prefix, PrefixIndex) else None
    mine = [budget.weights, cache.max_bytes if cache else 0, per_token,
            budget.footprint.row_bytes(1)]
    every = channel.gather_ints(mine)
    budget.weights = max(r[0] for r in every)
    if cache is not None:  # an automatic size follows each rank's budget: the smallest holds
        cache.max_bytes = min(r[1] for r in every)
    if cache is not None and any(r[2:] != every[0][2:] for r in every):
        raise GroupError("the ranks' KV blocks differ in size (pipeline stages with different "
                         "layers), so their prefix caches would evict differently; serve with "
                         "--prefix-cache-bytes 0")


def agree_on_budget(channel: Channel, engine: Engine) -> None:
    """Every rank takes rank 0's measured prefill budget and idle chunk (they size each step's
    prefill) and, after a warm-up, runs the long-prompt chunk widths they give, in lockstep."""
    sched = engine.scheduler
    every = channel.gather_ints([sched.prefill_budget, sched.idle_chunk])
    sched.prefill_budget, sched.idle_chunk = every[0]
    if engine.config.warmup and shapes_build_on_first_use():
        engine.warm_chunks()


# -- rank 0 ----------------------------------------------------------------------------------


@dataclass(slots=True)
class StepMessage:
    """What rank 0 tells the other ranks before each step (module docstring)."""

    kind: str  # "step", "beat" (nothing to run) or "stop"
    items: list[tuple[str, Any]] = field(default_factory=list)  # ("add", ...) / ("abort", id)
    picks: list[Pick] = field(default_factory=list)  # the scheduler's `_pick` calls this step
    record: tuple[int, int, float, bool] | None = None  # the last step's `Speculation.record`
    check: list[tuple[str, list[int]]] | None = None  # the last step's tokens per row


class _LookupRecorder:
    """The prefix index as `_pick` sees it on rank 0: each row it looks up is noted."""

    def __init__(self, inner: Any, looked: list[str]) -> None:
        self._inner = inner
        self._looked = looked

    def lookup(self, row: RowMeta) -> None:
        self._looked.append(row.req_id)
        self._inner.lookup(row)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class LeaderScheduler(Scheduler):
    """Rank 0's scheduler: decides as on one process and sends each step's decisions."""

    channel: Channel

    def attach(self, channel: Channel) -> None:
        self.channel = channel
        self.pending = StepMessage("step")
        self.last_sent = time.monotonic()

    def add(self, row: RowMeta) -> None:
        params = row.request.params
        if params.seed is None:  # every rank draws this row's tokens from the same seed
            row.request = replace(row.request, params=replace(params,
                                                              seed=random.getrandbits(32)))
        super().add(row)
        self.pending.items.append(("add", (row.request, row.max_new_tokens, row.stop_ids)))

    def abort(self, req_id: str) -> RowMeta | None:
        self.pending.items.append(("abort", req_id))
        return super().abort(req_id)

    def _pick(self, long_ok: bool) -> list[RowMeta]:
        looked: list[str] = []
        prefix = self.prefix
        self.prefix = _LookupRecorder(prefix, looked)  # type: ignore[assignment]
        try:
            rows = super()._pick(long_ok)
        finally:
            self.prefix = prefix
        self.pending.picks.append((looked, [r.req_id for r in rows],
                                   [r.num_cached_tokens for r in rows], self._picked_chunk))
        return rows

    def schedule(self) -> Plan:
        plan = super().schedule()
        self.send("step")
        return plan

    def update(self, plan: Plan, result: StepResult) -> list:
        self.pending.check = [(r.req_id, t) for r, t in zip(result.rows, result.tokens,
                                                             strict=True)]
        return super().update(plan, result)

    def send(self, kind: str) -> None:
        msg, self.pending = self.pending, StepMessage("step")
        msg.kind = kind
        self.channel.broadcast(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
        self.last_sent = time.monotonic()

    def beat_due(self) -> bool:
        return time.monotonic() - self.last_sent >= HEARTBEAT_S

    def has_work(self) -> bool:  # a heartbeat that is due is work for the engine thread
        return super().has_work() or self.beat_due()


class _RecordingSpec:
    """The engine's speculation on rank 0: what each step's cost taught it is sent on."""

    def __init__(self, inner: Any, leader: LeaderScheduler) -> None:
        self._inner = inner
        self._leader = leader

    def record(self, num_rows: int, width: int, seconds: float, typical: bool) -> None:
        self._leader.pending.record = (num_rows, width, seconds, typical)
        self._inner.record(num_rows, width, seconds, typical)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class DistributedEngine(Engine):
    """Rank 0's engine: `Engine` whose scheduler sends its decisions, with a heartbeat while
    idle and a watchdog over every step; a failed step (a rank died, a collective broke) or
    a step that outlives `rank_timeout` fails every request with 503 and exits the process
    with `GROUP_FAILED`."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig, channel: Channel,
                 rank_timeout: float = 20.0, exit_fn: Callable[[int], None] = os._exit):
        super().__init__(loaded, config)
        self.channel = channel
        self.rank_timeout = rank_timeout
        self._exit_fn = exit_fn
        old = self.scheduler
        leader = LeaderScheduler(old.config, None, old.vocab_size, old.budget, old.prefix,
                                 old.spec)
        leader.prefill_budget = old.prefill_budget  # the warm-up's measured budget
        leader.idle_chunk = old.idle_chunk
        leader.attach(channel)
        self.scheduler = leader
        self.spec = _RecordingSpec(self.spec, leader)  # type: ignore[assignment]
        self.failed: str | None = None
        self._fail_lock = threading.Lock()
        self._busy_since: float | None = None
        self._stop_event = threading.Event()

    def start(self) -> None:
        super().start()
        threading.Thread(target=self._watch, name="mlxd-rank-watchdog", daemon=True).start()

    def stop(self, timeout: float = 10.0) -> None:
        """The engine thread ends, then the other ranks are told to stop. The watchdog runs
        until then: a thread stuck in a collective with a rank that is gone still ends the
        process, after `rank_timeout`."""
        thread = self._thread
        super().stop(timeout)
        self._stop_event.set()
        if self.failed is None and (thread is None or not thread.is_alive()):
            try:  # the engine thread has ended: this thread may use MLX now
                assert isinstance(self.scheduler, LeaderScheduler)
                self.scheduler.send("stop")
            except Exception as exc:  # noqa: BLE001 - the others are gone already
                log.warning("could not tell the other ranks to stop: %s", exc)

    def add_embedding(self, request: Any, done: Any) -> Any:
        raise EngineError("embeddings are not served by a tensor- or pipeline-parallel group",
                          status=501, code="embeddings_unsupported")

    def add_scoring(self, request: Any, done: Any) -> Any:
        raise EngineError("prompt logprobs are not served by a tensor- or pipeline-parallel group",
                          status=501, code="scoring_unsupported")

    def _step(self) -> None:
        self._busy_since = time.monotonic()
        try:
            sched = self.scheduler
            assert isinstance(sched, LeaderScheduler)
            if not (self.runner.in_flight or Scheduler.has_work(sched)):
                sched.send("beat")
            else:
                super()._step()
        except Exception as exc:  # noqa: BLE001 - the group cannot go on after a failed step
            log.exception("a distributed engine step failed")
            self.fail_group(f"the distributed group failed: {type(exc).__name__}: {exc}")
        finally:
            self._busy_since = None

    def _fail_all(self, message: str, reason: str = FINISH_ERROR) -> None:
        """A failure outside a step (the engine's last resort) would leave the other ranks
        holding rows this one dropped: it fails the group. Shutting down is as on one rank."""
        if reason == FINISH_ERROR and self.failed is None:
            self.fail_group(f"the distributed group failed: {message}")
        super()._fail_all(message, reason)

    def _watch(self) -> None:
        """A step (its collectives) that outlives `rank_timeout`: some rank hangs."""
        while not self._stop_event.wait(0.25):
            since = self._busy_since
            if since is not None and time.monotonic() - since > self.rank_timeout:
                self.fail_group(f"the distributed group failed: a rank did not answer within "
                                f"{self.rank_timeout:g} s")
                return
            if self.failed is not None:
                return

    def fail_group(self, message: str) -> None:
        """Every request ends with `message` (503 through `DistributedAsyncEngine`), and the
        process exits with `GROUP_FAILED` after `EXIT_GRACE_S`. Safe from any thread."""
        with self._fail_lock:
            if self.failed is not None:
                return
            self.failed = message
        log.error("%s; failing every request and exiting", message)
        with self._wake:
            queued = [item[1] for item in self._inbox if item[0] == "add"]
            self._inbox.clear()
            self._stopping = True
            self._wake.notify()
        sinks = [*self._sinks.items(), *((row.req_id, sink) for row, sink in queued)]
        self._sinks.clear()
        for req_id, sink in sinks:
            try:
                sink([TokenEvent(req_id, [], finish_reason=FINISH_ERROR, error=message)])
            except RuntimeError:  # the server's event loop has already closed
                pass
        threading.Timer(EXIT_GRACE_S, self._exit_fn, (GROUP_FAILED,)).start()


def start_heartbeat(engine: DistributedEngine) -> threading.Thread:
    """Wakes rank 0's engine thread when a heartbeat is due (it sleeps on its condition
    variable while idle, and sends the heartbeat itself: all MLX calls stay on its thread)."""

    def beat() -> None:
        while not engine._stop_event.wait(HEARTBEAT_S / 2):
            with engine._wake:
                engine._wake.notify()

    thread = threading.Thread(target=beat, name="mlxd-heartbeat", daemon=True)
    thread.start()
    return thread


class DistributedAsyncEngine(AsyncEngine):
    """The server's client on rank 0: requests that the group's failure ended raise
    EngineError 503 (a JSON error response where no bytes were sent yet)."""

    engine: DistributedEngine

    def start(self) -> None:
        super().start()
        start_heartbeat(self.engine)

    async def submit(self, request: Request) -> AsyncIterator[TokenEvent]:
        self._refuse_if_failed()
        return await super().submit(request)

    def _refuse_if_failed(self) -> None:
        if self.engine.failed is not None:
            raise EngineError(self.engine.failed, status=503, code="distributed_group_failed")

    async def _stream(self, req_id: str, queue: Any) -> AsyncIterator[TokenEvent]:
        async for event in super()._stream(req_id, queue):
            if event.finish_reason == FINISH_ERROR and self.engine.failed is not None:
                self._refuse_if_failed()
            yield event


# -- the other ranks -------------------------------------------------------------------------


class FollowerScheduler(Scheduler):
    """A non-zero rank's scheduler: rank 0's picks instead of its own (module docstring)."""

    script: list[Pick]

    def _pick(self, long_ok: bool) -> list[RowMeta]:
        del long_ok
        looked, picked, cached, self._picked_chunk = self.script.pop(0)
        by_id = {r.req_id: r for r in self.waiting}
        for req_id in looked:
            self.prefix.lookup(by_id[req_id])
        rows = [by_id[req_id] for req_id in picked]
        mine = [r.num_cached_tokens for r in rows]
        if mine != cached:
            raise GroupError(f"prefix cache diverged from rank 0's: cached tokens {mine} here, "
                             f"{cached} on rank 0")
        return rows


class Follower:
    """Runs a non-zero rank: the engine's state machinery, driven by rank 0's messages."""

    def __init__(self, engine: Engine, channel: Channel, rank_timeout: float = 20.0,
                 exit_fn: Callable[[int], None] = os._exit) -> None:
        self.engine = engine
        self.channel = channel
        self.rank_timeout = rank_timeout
        self._exit_fn = exit_fn
        old = engine.scheduler
        sched = FollowerScheduler(old.config, None, old.vocab_size, old.budget, old.prefix,
                                  old.spec)
        sched.prefill_budget, sched.idle_chunk = old.prefill_budget, old.idle_chunk  # agreed
        sched.script = []
        engine.scheduler = sched
        self.scheduler = sched
        self.num_steps = 0
        self._last: list[tuple[str, list[int]]] = []
        self._busy_since: float | None = None
        self._limit = rank_timeout

    def run(self) -> int:
        """Until rank 0 says stop (0); raises on a broken group or a divergence."""
        threading.Thread(target=self._watch, name="mlxd-rank-watchdog", daemon=True).start()
        while True:
            self._busy_since, self._limit = time.monotonic(), self.rank_timeout + HEARTBEAT_S
            msg: StepMessage = pickle.loads(self.channel.broadcast(None))
            self._busy_since, self._limit = time.monotonic(), self.rank_timeout
            self._apply(msg)
            if msg.kind == "stop":
                return 0
            if msg.kind == "beat":
                release_idle_memory()
                continue
            self._step(msg.picks)

    def _watch(self) -> None:
        while True:
            time.sleep(0.25)
            since = self._busy_since
            if since is not None and time.monotonic() - since > self._limit:
                log.error("rank %d: rank 0 did not answer within %.0f s; exiting",
                          self.channel.rank, self._limit)
                self._exit_fn(GROUP_FAILED)
                return

    def _apply(self, msg: StepMessage) -> None:
        if msg.record is not None:
            self.engine.spec.record(*msg.record)
        if msg.check is not None and msg.check != self._last:
            raise GroupError(f"rank {self.channel.rank} diverged from rank 0 at step "
                             f"{self.num_steps}: its tokens {self._last[:4]} ... vs rank 0's "
                             f"{msg.check[:4]} ...")
        for kind, payload in msg.items:
            if kind == "add":
                request, max_new, stop_ids = payload
                self.scheduler.add(self._row(request, max_new, stop_ids))
            else:
                self.scheduler.abort(payload)

    def _row(self, request: Request, max_new: int, stop_ids: frozenset[int]) -> RowMeta:
        return RowMeta(request=request, num_prompt_tokens=len(request.prompt_ids),
                       max_new_tokens=max_new, stop_ids=stop_ids,
                       constraint=self.engine._compile_constraint(request.params.constraint))

    def _step(self, picks: list[Pick]) -> None:
        sched = self.scheduler
        sched.script = list(picks)
        plan = sched.schedule()
        result = self.engine.runner.run(plan)
        sched.update(plan, result)
        self._last = [(r.req_id, t) for r, t in zip(result.rows, result.tokens, strict=True)]
        self.num_steps += 1


# -- sharding --------------------------------------------------------------------------------


class ShardError(ValueError):
    """The model cannot be split this way (a one-line start-up error)."""


def shard_model(model: Any, config: dict[str, Any], group: Any, how: str) -> None:
    """Split `model` across `group` before its weights load: `how` is "tensor" (mlx-lm's
    `Model.shard`: each rank holds 1/N of every layer's heads and MLP columns, two all-reduces
    per layer) or "pipeline" (`model.model.pipeline`: each rank holds a run of layers, one
    send/recv per stage and an all-gather of the last hidden state per forward)."""
    size = int(group.size())
    name = str(config.get("model_type", type(model).__module__))
    if how == "tensor":
        if not hasattr(model, "shard"):
            raise ShardError(f"--tensor-parallel: mlx-lm's {name} model has no tensor-parallel "
                             "sharding (Model.shard); try --pipeline-parallel")
        text = config.get("text_config") or config
        for key in ("num_attention_heads", "num_key_value_heads"):
            value = text.get(key)
            if isinstance(value, int) and value % size:
                raise ShardError(f"--tensor-parallel {size}: {key} = {value} is not divisible "
                                 f"by {size}")
        model.shard(group)
        return
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "pipeline"):
        raise ShardError(f"--pipeline-parallel: mlx-lm's {name} model has no pipeline "
                         "splitting (PipelineMixin); try --tensor-parallel")
    if len(inner.layers) < size:
        raise ShardError(f"--pipeline-parallel {size}: the model has only {len(inner.layers)} "
                         "layers")
    inner.pipeline(group)
    install_pipeline_cache_hook()


def install_pipeline_cache_hook() -> None:
    """mlx-lm's pipeline stages tie their send to the last layer's cache
    (`cache[-1].keys = mx.depends(cache[-1].keys, h)`), so that evaluating the KV after a
    prefill also sends the stage's output on. Our layouts expose their key buffer as `keys`
    for that (read: the buffer; write: the buffer with the dependency)."""
    from engine.kv.attention import KVLayout

    if isinstance(getattr(KVLayout, "keys", None), property):
        return

    def get(self: Any) -> Any:
        return self._bufs[0] if self._bufs else None

    def put(self: Any, value: Any) -> None:
        if self._bufs:
            self._bufs[0] = value

    KVLayout.keys = property(get, put)  # type: ignore[attr-defined]
