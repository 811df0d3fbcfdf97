"""The executor: runs a step's plan (engine.scheduler.Plan) and returns its host values.

    result = runner.run(plan)

`run` does, in order: the plan's prefill chunk (one right-padded forward for the group; the
group's last chunk samples each row's first token from the logits at its last prompt token and
hands it to `on_first` as soon as it is read, or reports it in this step's result without one;
then the prefix cache takes the chunk's complete blocks), the group
joining the running batch when its prefill is complete, and the batch's decode at the width the
speculation picks (`Speculation.decide`; always 1 with `NoSpec`; plain in the step rows join,
and none when a joining row is under a grammar, which must take its first token first):

* width 1, pipelined: the step's graph is built while the previous step computes; once the
  batch's KV is large, the previous step is waited for before this one is launched (`_settle`:
  so that it writes its KV columns in place instead of copying every buffer); the step is
  launched (`mx.async_eval`) and the previous step's tokens are read while it computes, so
  graph building and Python bookkeeping overlap the forward passes; the result is the previous
  step's. (On a CPU, a layer whose attention or SwiGLU takes `kernels.cpu` evaluates
  its inputs while the step is built, so long-context and many-row steps overlap less.) Once
  every row's last token (its max_tokens) is in flight, nothing more is launched: the step
  only reads that one, so the next request does not wait for a step whose tokens would be
  thrown away.
* rows under a grammar: pipelined while their masks hold still (free text before a tool call's
  opening marker, the inside of a long string; `RowMeta.grammar_steady`: a row's mask was
  the same at its last two states). The step is masked with each grammar's mask after the
  last token it has consumed, one token behind (the token in flight has not reached it).
  Before the next step is launched, the grammars have taken that token, and their masks now
  are compared with the ones the step in flight drew with; a row whose mask changed (the
  marker was just written) draws again from that step's logits under its mask now, with the
  same random numbers (`_redraw`), before the token it drew is an input anywhere: exactly
  what a synchronous masked step draws. A row whose mask moved at its last state (JSON
  structure, which moves at almost every token) makes its batch's steps synchronous until
  it holds still again.
* width 1, synchronous (a grammar row whose mask moved, or a lookup drafter that wants the
  newest token): launched and read in the same step.
* width k + 1: a verify step: the speculation's drafts, one forward over
  `[next, d_1 .. d_k]` per row, the verdict (engine.spec.accept), the accepted columns
  committed into the rings (engine.spec.ringcommit).

A synchronous decode while a pipelined step is still in flight first drains it: the result is
that step's (`width` 0), and the decode runs at the width already chosen on the next call.
Every result is a `StepResult`: per row, a list of tokens (and logprobs when asked).

The runner keeps no per-request state beyond the one step in flight. It counts the forwards it
has run per shape, `shapes`: (kind, rows, width) with kind "prefill" (rows x chunk columns),
"decode" (rows x 1) or "verify" (rows x k + 1).

`warm_up` runs, before serving, the shapes the first requests will use: one full prefill chunk
(every long prompt's chunks but its last), a group prefill and the decode batch at 1..N rows,
with greedy and sampled rows (the sampling kernels). MLX-CUDA JIT-compiles each kernel per
dtype and keeps cuBLAS/cuDNN plans per shape, so after it the first request pays for neither;
a prompt of a width not run yet (the last chunk of a long prompt, a short prompt's own length)
still builds its matmul plans on first use. On a CPU nothing is built per shape (a first decode
step at any batch size costs what the next one does), so the warm-up there (`per_shape=False`)
runs one short prompt and its first decode step, for what a process builds once, and times one
full chunk (twice when it is quick: the first also allocates); both warm-ups measure the prefill
rate the scheduler's auto budget is sized from.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import mlx.core as mx
import numpy as np

from engine import constrain, cuda_guard, lora
from engine.api import Request, SamplingParams
from engine.batch import RowMeta, RunningBatch
from engine.kv import batch as kvb
from engine.kv.batch import KVConfig
from engine.kv.prefix_cache import NoPrefix, PrefixIndex
from engine.kv.recurrent import RecurrentLayout
from engine.models import UnsupportedArchitecture, prepare_model, speculation_blocker
from engine.models.heads import logits_at
from engine.sampling import SamplerState, sample, token_logprobs
from engine.scheduler import Plan, PrefillGroup, StepResult
from engine.spec.accept import (
    column_states,
    greedy_verdict_host,
    plain_greedy,
    record_ragged,
    verify,
)
from engine.spec.decoder import NoSpec, Round, Speculation
from engine.spec.ringcommit import RingRound
from kernels.common import gpu_backend

log = logging.getLogger("mlxd.engine")

Shape = tuple[str, int, int]  # (kind, rows, width) of a forward the runner ran


def shapes_build_on_first_use() -> bool:
    """Whether a forward of a new shape builds something on first use (a GPU backend: MLX
    compiles kernels, cuBLAS/cuDNN plan), so the warm-up runs every shape the first requests
    use; on the CPU the first step of any shape costs what the next one does."""
    return gpu_backend() is not None


def buckets_prefill_shapes(layouts: list[Any]) -> bool:
    """Whether prefill shapes are bucketed (`bucketed_width`, `PrefixIndex.hit_blocks`): on
    MLX-CUDA, which builds a cuDNN attention graph (~42 ms on an H100's host) and matmul plans
    for every new (query, key) length pair (2,800 new tokens over 3,392 cached: 75 ms as a
    new pair, 26 ms as a known one), for models whose layouts are all full attention
    (trailing pads are then invisible under the causal mask; ring and recurrent layouts
    would take them in)."""
    return gpu_backend() == "cuda" and all(
        getattr(layer, "ring_size", None) is None and not isinstance(layer, RecurrentLayout)
        for layer in layouts)


BUCKET_MIN_WIDTH = 256  # narrower last chunks run at their own width
BUCKET_HIT_TOKENS = 512  # cached prefixes are used in multiples of this many tokens


def bucketed_width(width: int) -> int:
    """A prefill's last chunk width rounded up to one of four steps an octave (at most 25 %
    of padding, ~10 % on average) from `BUCKET_MIN_WIDTH` on."""
    if width < BUCKET_MIN_WIDTH:
        return width
    step = 1 << (width.bit_length() - 3)
    return -(-width // step) * step


WARM_GROUP_WIDTH = 16  # the warm-up's group prefill: 16-token prompts
# the CPU warm-up times a chunk that took less than this again and keeps the faster (a first
# chunk of tinycoder-16m measured ~20 % slower than the next, allocating its buffers)
CPU_RETIME_S = 0.5


@dataclass(slots=True)
class WarmUp:
    """What `Runner.warm_up` ran and measured."""

    shapes: list[Shape]  # in the order they ran
    seconds: float
    prefill_tokens_per_s: float  # one row, one full chunk, after its shapes were built


@dataclass(slots=True)
class InFlight:
    """A launched decode step: the rows it covers (at launch), its lazy outputs, and the rows
    whose grammar failed while it was built (row index -> message)."""

    rows: list[RowMeta]
    tokens: mx.array  # [B] int32 (plain step), or [B, W] (verify step)
    counts: np.ndarray | None  # verify step: [B] tokens per row (None: a plain step)
    logprobs: mx.array | None = None  # [B] / [B, W]
    top_ids: mx.array | None = None  # [B, K] / [B, W, K]
    top_logprobs: mx.array | None = None  # [B, K] / [B, W, K]
    errors: dict[int, str] = field(default_factory=dict)
    # a plain step with rows under a grammar: the masks it drew with ([B, ceil(V/32)] int32,
    # free rows all ones), those rows' indices, and what drawing again needs (`_redraw`)
    bitmask: np.ndarray | None = None
    grammar_rows: list[int] = field(default_factory=list)
    logits: mx.array | None = None  # [B, V], before the masks
    sampler: SamplerState | None = None  # the state the step drew with (before `record`)


class Runner:
    """Runs plans: prefill chunks, pipelined decode, verification (see the module docstring)."""

    def __init__(
        self,
        model: Any,
        kv: KVConfig | None = None,
        spec: Speculation | NoSpec | None = None,
        prefix: PrefixIndex | NoPrefix | None = None,
    ):
        self.model = model
        self.kv = kv or KVConfig()
        cuda_guard.install()  # MLX-CUDA: RoPE over many rows (engine/cuda_guard.py); no-op elsewhere
        prepare_model(model)  # once: recurrent mixers step through padding / rollback
        kvb.check_supported(model, self.kv)  # quantized KV: fail at start, not per request
        self.spec = spec or NoSpec()
        if isinstance(self.spec, Speculation) and (why := speculation_blocker(model)):
            if not self.spec.optional:
                raise UnsupportedArchitecture(why)  # at start-up, not in every request
            self.spec = NoSpec()  # predictions only: the requests' predictions go unused
        self.prefix = prefix or NoPrefix(self.new_caches)
        self._inflight: InFlight | None = None
        self._held = 0  # a width chosen while a step was in flight: the next decode's
        self.shapes: Counter[Shape] = Counter()  # forwards run so far per shape (warm-up included)
        # seconds of this step's phases so far, while the engine traces steps (engine.steptrace)
        self.timings: dict[str, float] | None = None
        # LoRA adapters installed by the loader (engine/lora.py): each forward's rows select theirs
        self.adapters = lora.attached(model)
        # called with a completed prefill's first tokens as soon as they are read, before the
        # prefix cache stores the prompt's blocks and the rows' first decode step is launched
        # (None: they come back in the step's result with the decode rows' tokens)
        self.on_first: Callable[[Plan, StepResult], None] | None = None
        # pad a group's last chunk to `bucketed_width` (`buckets_prefill_shapes`)
        self.bucket_widths = False
        # grammar rows whose token a pipelined step drew before their mask changed, drawn
        # again with a different token (`_redraw`)
        self.redrawn = 0

    def adapter_index(self, name: str | None) -> int:
        """A request's adapter by name -> its per-row index (KeyError: not served here)."""
        if name is None:
            return lora.NO_ADAPTER
        if self.adapters is None:
            raise KeyError(name)
        return self.adapters.index_of(name)

    def _forward(self, inputs: mx.array, caches: Any, batch: RunningBatch | None,
                 last: list[int] | None = None) -> mx.array:
        """The model over `inputs` with `batch`'s rows' adapters (None: none); with `last`,
        only row i's logits at column last[i], [B, V] (`engine.models.heads`). The adapter
        indices are set only while the (lazy) graph is built, so no other forward of the model
        sees them."""
        if self.adapters is not None:
            self.adapters.select(batch.adapters if batch is not None else None)
        try:
            if last is None:
                return cast(mx.array, self.model(inputs, cache=caches))
            return logits_at(self.model, lambda: self.model(inputs, cache=caches),
                             mx.arange(len(last), dtype=mx.int32), mx.array(last, dtype=mx.int32))
        finally:
            if self.adapters is not None:
                self.adapters.select(None)

    def logits(self, inputs: mx.array, caches: Any) -> mx.array:
        """The base model's logits over `inputs` [B, C] into `caches` (no adapter): [B, C, V]."""
        return self._forward(inputs, caches, None)

    def new_caches(self, num_rows: int) -> list[Any]:
        return kvb.new_batch(self.model, num_rows, self.kv)

    @property
    def in_flight(self) -> bool:
        """A pipelined step has been launched and not read yet."""
        return self._inflight is not None

    def reset(self) -> None:
        """Forget the step in flight (its rows were failed)."""
        self._inflight = None
        self._held = 0

    # -- the step --------------------------------------------------------------------------
    def run(self, plan: Plan) -> StepResult:
        t0 = time.perf_counter()
        first = self._prefill(plan) if plan.prefill is not None else None
        if plan.prefill is not None:
            self._lap("prefill", t0)
        # with `on_first`, the first tokens are out (and counted by the rows) before the rows
        # join; they are then no longer pending in the step's result
        pending = first if self.on_first is None else None
        batch = plan.batch
        if plan.join is not None:
            batch.concat(plan.join)
        if not len(batch):
            self._held = 0  # chosen for rows that are gone
            return _joined(self._drain(batch), pending)
        if first is not None and plan.join is not None:
            # rows that took their first token from the prefill decode plainly in this step (a
            # verify's drafts must have seen that token); under a grammar they wait a step, for
            # it to take that token before it masks the next
            if plan.join.constrained_rows():
                return _joined(self._drain(batch), pending)
            width = 1
        else:
            width, self._held = self._held or self.spec.decide(batch), 0
        constrained = batch.constrained_rows()
        vocab = batch.sampler.vocab_size if batch.sampler is not None else 0
        masks, changed = None, None
        if constrained and width == 1 and self._inflight is not None and vocab:
            # the grammars have taken every token before the one in flight: their masks now
            # check the step in flight and mask the step launched next (module docstring)
            t0 = time.perf_counter()
            masks = _grammar_masks(constrained, len(batch), vocab)
            changed = _changed_masks(self._inflight, batch, masks)
            self._lap("masks", t0)
        # a verify; or a grammar row whose mask moved at its last state (its next likely moves
        # too), or any where the vocabulary is unknown
        steady = bool(vocab) and all(batch.rows[i].grammar_steady for _, i in constrained)
        must_sync = width > 1 or (bool(constrained) and not steady)
        sync = must_sync or self.spec.sync_plain  # or a lookup to be made on the newest token
        if (sync or changed) and self._inflight is not None:
            if must_sync:  # kept for the next step; a lookup miss decides afresh
                self._held = max(width, self._held)
            return _joined(self._drain(batch, changed), pending)
        if width > 1:
            result = self.verify(batch, width)
        elif sync:
            t0 = time.perf_counter()
            step = self._launch(batch, constrained)  # masks of the current state
            t0 = self._lap("launch", t0)
            result = _collect(step)
            self._lap("collect", t0)
        elif _all_at_their_limit(batch, self._inflight, pending):
            # every row's last token is already computed: a launch would be thrown away, and a
            # request arriving now would wait for it
            return _joined(self._drain(batch, changed), pending)
        else:
            t0 = time.perf_counter()
            previous, self._inflight = self._inflight, self._launch(batch, constrained, masks)
            t0 = self._lap("launch", t0)
            result = _collect(previous) if previous is not None else StepResult()
            self._lap("collect", t0)
        result.width = width
        return _joined(result, pending)

    def _drain(self, batch: RunningBatch | None = None,
               changed: dict[int, np.ndarray] | None = None) -> StepResult:
        """The step in flight, read; rows under a grammar whose mask changed under it draw
        again (`changed`: their masks now, by row of the step; None: worked out here)."""
        previous, self._inflight = self._inflight, None
        if previous is None:
            return StepResult()
        result = _collect(previous)
        if previous.bitmask is not None:
            if changed is None:
                changed = _changed_masks(previous, None, None)
            if changed:
                self.redrawn += _redraw(previous, result, batch, changed)
        return result

    # -- prefill ---------------------------------------------------------------------------
    def _prefill(self, plan: Plan) -> InFlight | None:
        """The plan's prefill chunk. The group's last chunk also samples each row's first
        token from the logits at its last prompt token (the head over those positions only,
        `engine.models.heads`): the rows join the batch with it as their next input, and it is
        returned (read) to be reported in this step's result."""
        group = plan.prefill
        assert group is not None
        start, end = group.done, plan.prefill_end
        if end <= start:
            return None
        bucket = self.bucket_widths and end >= group.width
        if start == 0:  # the lengths announced here hold across chunks
            lengths = [len(t) for t in group.token_lists]
            if not kvb.prepare_right_padded(group.caches, lengths) and self.bucket_widths:
                kvb.prepare(group.caches, lengths=lengths)  # a last chunk may be padded
        width = end - start
        if bucket:  # trailing pads, never seen by the real tokens' causal attention
            width = min(bucketed_width(width), max(width, group.chunk))
        rows = [t[start:end] + [0] * (width - len(t[start:end])) for t in group.token_lists]
        self.shapes[("prefill", len(rows), width)] += 1
        inputs = mx.array(rows, dtype=mx.int32)
        first = None
        if end < group.width:
            self._forward(inputs, group.caches, group.batch)
            # launched, not waited for: the prefix cache's bookkeeping below and the next
            # step's graph are built while the device runs this chunk; what was launched
            # before (the previous chunk) is waited for first, so the host stays at most one
            # chunk ahead and this chunk writes the group's KV in place (why: `_settle`)
            mx.synchronize()
            mx.async_eval(kvb.state_arrays(group.caches))
        else:
            # every row of a group ends in its last chunk (several rows run in one chunk)
            last = [len(t) - 1 - start for t in group.token_lists]
            assert min(last) >= 0, "a row of the group ended before its last chunk"
            logits = self._forward(inputs, group.caches, group.batch, last=last)
            kvb.finalize(group.caches)
            first = self._sample(group.batch, logits, group.batch.constrained_rows())
            t0 = time.perf_counter()
            _settle(group.caches)
            mx.eval(*_outputs(first), *kvb.state_arrays(group.caches),
                    *_arrays_of(group.batch.sampler))
            self._lap("prefill_wait", t0)
            if self.on_first is not None:
                self.on_first(plan, _collect(first))
        t0 = time.perf_counter()
        self.prefix.store(group.rows, group.caches, wait=first is not None)
        self._lap("store", t0)
        return first

    def _lap(self, phase: str, since: float) -> float:
        """Now; with `timings` on (engine.steptrace), also record `phase` as lasting since
        `since`."""
        now = time.perf_counter()
        if self.timings is not None:
            self.timings[phase] = now - since
        return now

    def prefill_row(self, caches: list[Any], token_ids: list[int]) -> None:
        """One row's prompt into fresh `caches` (speculation's warm-up batch, no adapter)."""
        self._forward(mx.array([token_ids], dtype=mx.int32), caches, None)
        kvb.eval_state(caches)

    # -- warm-up ---------------------------------------------------------------------------
    def warm_up(
        self, chunk: int, max_rows: int, vocab_size: int,
        on_shape: Callable[[Shape], None] | None = None, per_shape: bool = True,
    ) -> WarmUp:
        """Run the first requests' shapes (module docstring) through `run`, with the prefix
        cache and speculation out of the way (nothing is stored, no drafts), and time one more
        full chunk for the prefill rate. `on_shape` is called after each shape (progress).
        `per_shape=False` (the CPU): one short prompt and its first decode step, then the timed
        chunk (`warm_up_shapes`)."""
        t0 = time.perf_counter()
        before = set(self.shapes)
        order: list[Shape] = []

        def ran() -> None:
            for shape in sorted(set(self.shapes) - before - set(order)):
                order.append(shape)
                if on_shape is not None:
                    on_shape(shape)

        with self._set_aside():
            self.run(self._warm_plan([chunk if per_shape else WARM_GROUP_WIDTH], vocab_size))
            ran()
            if not per_shape:
                self._drain()

            def chunk_rate() -> float:
                t1 = time.perf_counter()
                self._prefill(self._warm_plan([chunk], vocab_size))
                return chunk / max(time.perf_counter() - t1, 1e-9)

            rate = chunk_rate()
            if not per_shape:
                if chunk / rate < CPU_RETIME_S:  # the first chunk also allocated its buffers
                    rate = max(rate, chunk_rate())
                ran()
                return WarmUp(order, time.perf_counter() - t0, rate)
            # rows one token apart: the decode batch runs as serving batches do, rows of
            # different lengths (on CUDA that builds the decode-attention kernels)
            lens = [WARM_GROUP_WIDTH - i % 2 for i in range(max_rows)]
            plan = self._warm_plan(lens, vocab_size)
            self.run(plan)
            ran()
            batch = plan.batch
            for rows in range(max_rows, 0, -1):  # the decode batch at max_rows .. 1 rows
                batch.take(list(range(rows)))
                self.run(Plan(batch))
                ran()
            self._drain()
        return WarmUp(order, time.perf_counter() - t0, rate)

    def warm_prefill(self, widths: list[int], vocab_size: int) -> None:
        """One row's prefill chunk at each of `widths` (the long-prompt chunks the measured
        budget gives, engine.scheduler), so that their first use builds nothing."""
        with self._set_aside():
            for width in widths:
                self._prefill(self._warm_plan([width], vocab_size))

    @contextmanager
    def _set_aside(self) -> Iterator[None]:
        """The warm-up's forwards: the prefix cache, speculation and `on_first` out of the way
        (nothing stored, no drafts, no events), and no step left in flight after."""
        saved = self.prefix, self.spec, self.on_first
        self.prefix, self.spec, self.on_first = NoPrefix(self.new_caches), NoSpec(), None
        try:
            yield
        finally:
            self.reset()
            self.prefix, self.spec, self.on_first = saved

    def _warm_plan(self, prompt_lens: list[int], vocab_size: int) -> Plan:
        """A plan that prefills rows of these prompt lengths in one chunk and joins them to an
        empty batch; odd rows greedy, even rows sampled (temperature, top-p: the sampling
        kernels too)."""
        rows = []
        for i, n in enumerate(prompt_lens):
            prompt = [(7 * i + 3 * j + 1) % vocab_size for j in range(n)]
            params = SamplingParams(temperature=0.0) if i % 2 else SamplingParams(top_p=0.9)
            rows.append(RowMeta(Request(f"warm-up-{i}", prompt, params), n, 1 << 30, frozenset()))
        sampler = SamplerState.from_params(
            [r.request.params for r in rows], [r.request.prompt_ids for r in rows], vocab_size,
            list(range(len(rows))),
        )
        batch = RunningBatch(rows, None, sampler, self.new_caches(len(rows)))
        group = PrefillGroup(batch, [r.request.prompt_ids for r in rows])
        return Plan(RunningBatch(), group, group.width, batch)

    def warm_up_shapes(self, chunk: int, max_rows: int, per_shape: bool = True) -> list[Shape]:
        """The shapes `warm_up` runs (for its log line and progress bar)."""
        if not per_shape:
            return [("prefill", 1, WARM_GROUP_WIDTH), ("decode", 1, 1), ("prefill", 1, chunk)]
        return ([("prefill", 1, chunk), ("prefill", max_rows, WARM_GROUP_WIDTH)]
                + [("decode", r, 1) for r in range(max_rows, 0, -1)])

    # -- plain decode ----------------------------------------------------------------------
    def _launch(self, batch: RunningBatch, constrained: list[tuple[Any, int]],
                masks: tuple[np.ndarray, dict[int, str]] | None = None) -> InFlight:
        """Queue one decode step for every row without waiting for it (async_eval). The
        step's inputs may themselves still be in flight (the previous step's tokens); so may
        the token the grammar rows' `masks` have not seen yet (module docstring)."""
        assert batch.next_tokens is not None
        self.shapes[("decode", len(batch), 1)] += 1
        logits = self._forward(batch.next_tokens[:, None], batch.caches, batch)[:, -1, :]
        step = self._sample(batch, logits, constrained, masks)
        _settle(batch.caches)
        mx.async_eval(*_outputs(step), *batch.arrays(), *_arrays_of(batch.sampler))
        return step

    def _sample(self, batch: RunningBatch, logits: mx.array, constrained: list[tuple[Any, int]],
                masks: tuple[np.ndarray, dict[int, str]] | None = None) -> InFlight:
        """Each row's next token from `logits` [B, V] (masked where a row's grammar says:
        `masks` as `_grammar_masks` gives them, or filled here while the forward runs),
        recorded in the sampler and made the row's next input; the outputs, lazy."""
        sampler = batch.sampler
        assert sampler is not None
        bitmask: np.ndarray | None = None
        errors: dict[int, str] = {}
        if constrained:
            if masks is None:
                mx.async_eval(logits)  # the forward runs while the grammar engine fills masks
                masks = _noted_masks(batch, constrained, int(logits.shape[-1]))
            bitmask, errors = masks
        out = sample(_masked(logits, bitmask).astype(mx.float32), sampler)
        batch.sampler = sampler.record(out.tokens)
        batch.next_tokens = out.tokens
        step = InFlight(list(batch.rows), out.tokens, None, out.logprobs, out.top_ids,
                        out.top_logprobs, errors)
        if bitmask is not None:
            step.bitmask, step.logits, step.sampler = bitmask, logits, sampler
            step.grammar_rows = [i for _, i in constrained]
        return step

    # -- verification ----------------------------------------------------------------------
    def verify(self, batch: RunningBatch, width: int) -> StepResult:
        """Draft, verify and accept for every row; the batch (caches, sampler, next tokens,
        drafter state) ends the step as if the accepted tokens had been decoded plainly."""
        assert isinstance(self.spec, Speculation) and batch.sampler is not None
        t0 = time.perf_counter()
        rnd = self.spec.propose(batch, width)
        t0 = self._lap("propose", t0)
        proposal = rnd.proposal
        K = int(proposal.tokens.shape[1])
        self.shapes[("verify", len(batch), K + 1)] += 1
        # rings are written after the verdict (accepted columns only): no ring slack needed,
        # so the target's layouts are the plain engine's (engine/spec/ringcommit.py)
        ring_round = RingRound(batch.caches or [], K + 1)
        logits = self._forward(_verify_input(batch, rnd), ring_round.model_caches, batch)
        _settle(batch.caches)
        t0 = self._lap("verify_build", t0)
        constrained = batch.constrained_rows()
        errors: dict[int, str] = {}
        if constrained:  # each column under the grammar's state after the drafts before it
            mx.async_eval(logits)
            bitmask, errors, drafted = _draft_masks(batch, constrained, proposal,
                                                    int(logits.shape[-1]), K + 1)
            if drafted:
                logits = _masked(logits, bitmask)
            else:  # only column 0 can be drawn from under a grammar: mask that alone
                first = _masked(logits[:, 0, :], bitmask[:, 0])
                logits = mx.concatenate([first[:, None], logits[:, 1:]], axis=1)
        sampler = batch.sampler
        if plain_greedy(sampler):  # the verdict on the host: one argmax, then numpy on [B, W]
            tokens = mx.argmax(logits, axis=-1).astype(mx.int32)  # [B, W]
            extra = _logprobs(logits, tokens, sampler)
            drafts = proposal.host_tokens
            mx.eval(tokens, *[x for x in extra if x is not None],
                    *([proposal.tokens] if drafts is None and K else []))
            t0 = self._lap("verify_wait", t0)
            drafts = drafts if drafts is not None else np.array(proposal.tokens)
            accepted, last = greedy_verdict_host(np.array(tokens), drafts, proposal.num_drafts)
            num = mx.array(accepted.astype(np.int32) + 1)
            batch.next_tokens = mx.array(last.astype(np.int32))
        else:
            states = proposal.column_states or column_states(sampler, proposal.tokens, K + 1)
            while len(states) < K + 1:
                states.append(states[-1].record(proposal.tokens[:, len(states) - 1]))
            num_drafts = mx.array(proposal.num_drafts.astype(np.int32))
            verdict = verify(logits, states, proposal.tokens, num_drafts, proposal.draft_logits)
            tokens = verdict.tokens
            extra = _logprobs(logits, tokens, sampler)
            mx.eval(verdict.num_accepted, tokens, *[x for x in extra if x is not None])
            t0 = self._lap("verify_wait", t0)
            accepted = np.array(verdict.num_accepted).astype(np.int64)
            num = verdict.num_accepted + 1
            batch.next_tokens = verdict.last
        t0 = self._lap("verdict", t0)
        ring_round.finish(accepted + 1)
        batch.sampler = record_ragged(sampler, tokens, num)
        # the ring commit and the state updates run while the host does the bookkeeping
        mx.async_eval(batch.next_tokens, *batch.arrays(), *_arrays_of(batch.sampler))
        t0 = self._lap("commit", t0)
        self.spec.observe(rnd, accepted)
        chosen, top_ids, top_lps = extra
        result = _collect(InFlight(list(batch.rows), tokens, accepted + 1, chosen, top_ids,
                                   top_lps, errors))
        self._lap("observe", t0)
        return result


SETTLE_BYTES = 256 << 20  # KV buffers from which a step waits for the one before (`_settle`)


def _settle(caches: list[Any] | None) -> None:
    """Wait for everything launched before when `caches` hold at least `SETTLE_BYTES`: call it
    after a step's graph is built and before it is evaluated.

    A step writes its new KV columns into the layouts' buffers, which MLX does in place only
    when nothing else holds the buffer; a step (or a prefix-cache copy) still in flight holds
    it until it has run, and MLX then copies the whole buffer, at every layer of every step:
    at 64 rows of a few thousand tokens, gigabytes a step. The wait costs little: the
    graph is still built (the Python side of a step) while the previous step runs, only its
    dispatch waits, and MLX starts the device on a step's first kernels while it dispatches
    the rest. Below `SETTLE_BYTES` steps are dispatched ahead as before. What the wait gives
    on a GPU (64 long rows decode faster, short ones the same): docs/kv-layouts.md."""
    if caches and kvb.nbytes(caches) >= SETTLE_BYTES:
        mx.synchronize()


def _verify_input(batch: RunningBatch, rnd: Round) -> mx.array:
    """[B, K + 1]: each row's next input token, then its drafts (padding past its own)."""
    proposal = rnd.proposal
    K = int(proposal.tokens.shape[1])
    host = proposal.host_tokens
    if host is not None:  # drafts on the host (a lookup drafter): one upload
        contexts = rnd.ctx.contexts
        nxt = np.fromiter((c[-1] for c in contexts), np.int32, len(contexts))
        return mx.array(np.concatenate([nxt[:, None], host[:, :K].astype(np.int32)], axis=1))
    assert batch.next_tokens is not None
    return mx.concatenate([batch.next_tokens[:, None], proposal.tokens.astype(mx.int32)], axis=1)


def _grammar_masks(
    constrained: list[tuple[Any, int]], rows: int, vocab: int
) -> tuple[np.ndarray, dict[int, str]]:
    """The bitmask ([rows, ceil(vocab/32)] int32) of every row's grammar in its current state
    (free rows all ones), and the rows whose grammar failed (row index -> message; their mask
    allows everything, and the scheduler ends them). `constrained`: (grammar, row index) of
    every row under one (`RunningBatch.constrained_rows`)."""
    bitmask = constrain.new_bitmask(rows, vocab)
    return bitmask, _fill_masks(constrained, bitmask)


def _noted_masks(batch: RunningBatch, constrained: list[tuple[Any, int]],
                 vocab: int) -> tuple[np.ndarray, dict[int, str]]:
    """`_grammar_masks` at the rows' current states, each recorded on its row (`_note_mask`)."""
    bitmask, errors = _grammar_masks(constrained, len(batch), vocab)
    for _, i in constrained:
        if i not in errors:
            _note_mask(batch.rows[i], bitmask[i])
    return bitmask, errors


def _draft_masks(batch: RunningBatch, constrained: list[tuple[Any, int]], proposal: Any,
                 vocab: int, width: int) -> tuple[np.ndarray, dict[int, str], bool]:
    """The masks of a verify's columns ([B, width, ceil(vocab/32)] int32; free rows all ones),
    the rows whose grammar failed, and whether any grammar row has drafts. Column 0 is each
    grammar's current state (noted on its row, `_note_mask`); column j the state after the
    row's first j drafts, as far as the grammar takes them (`constrain.fill_draft_masks`).
    Past the first draft it refuses a column is left all ones: the target's token before it
    was drawn under a mask that excludes that draft, so the verdict stops there. The scheduler
    feeds the grammar the tokens the verdict keeps."""
    B = len(batch)
    num = proposal.num_drafts
    drafted = any(num[i] > 0 for _, i in constrained)
    drafts = proposal.host_tokens
    if drafted and drafts is None:
        drafts = np.array(proposal.tokens)
    bitmask = constrain.new_bitmask(B * width, vocab)
    rows = [(c, i * width, drafts[i, : int(num[i])].tolist() if num[i] else [])
            for c, i in constrained]
    errors = {k // width: e for k, e in _fill_masks(rows, bitmask, constrain.fill_draft_masks).items()}
    for _, i in constrained:
        if i not in errors:
            _note_mask(batch.rows[i], bitmask[i * width])
    return bitmask.reshape(B, width, -1), errors, drafted


def _masked(logits: mx.array, bitmask: np.ndarray | None) -> mx.array:
    """-inf on every token `bitmask` forbids (`[..., ceil(V/32)]` over `logits`' `[..., V]`);
    free rows pass through bit for bit."""
    if bitmask is None:
        return logits
    vocab = int(logits.shape[-1])
    lead = bitmask.shape[:-1]
    flat = bitmask.reshape(-1, bitmask.shape[-1])
    if flat.shape[1] * 32 < vocab:  # a head wider than the config's vocabulary: pad allowed
        pad = np.full((flat.shape[0], -(-vocab // 32) - flat.shape[1]), -1, np.int32)
        flat = np.concatenate([flat, pad], axis=1)
    allowed = constrain.allowed_from_bitmask(np.ascontiguousarray(flat), vocab).reshape(*lead, vocab)
    return mx.where(allowed, logits, mx.array(float("-inf"), dtype=logits.dtype))


def _note_mask(row: RowMeta, mask: np.ndarray) -> None:
    """Record `mask` as the mask of `row`'s grammar at its current state, and whether it is
    the one the state before gave (`RowMeta.grammar_steady`)."""
    if row.grammar_mask_at == row.num_generated:
        return  # the same state again
    row.grammar_steady = row.grammar_mask is not None and np.array_equal(mask, row.grammar_mask)
    row.grammar_mask, row.grammar_mask_at = mask, row.num_generated


def _changed_masks(step: InFlight, batch: RunningBatch | None,
                   masks: tuple[np.ndarray, dict[int, str]] | None) -> dict[int, np.ndarray]:
    """The rows of `step` (by its row index) whose grammar's mask now differs from the one the
    step drew with, and their masks now (each recorded on its row, `_note_mask`). Call it
    while `step` is the one in flight: every token before it has been consumed by the
    grammars, so their masks now are the ones its tokens should have been drawn under.
    `masks`: the current batch's (`_grammar_masks`); rows missing there (or every row, without
    them) are filled here. Finished rows, and rows whose grammar fails, are left out."""
    if step.bitmask is None:
        return {}
    where = {id(r): b for b, r in enumerate(batch.rows)} if batch is not None and masks else {}
    now: dict[int, np.ndarray] = {}
    missing: list[int] = []
    for i in step.grammar_rows:
        row = step.rows[i]
        if row.finished or row.constraint is None:
            continue
        b = where.get(id(row))
        if b is None or masks is None:
            missing.append(i)
        elif b not in masks[1]:
            now[i] = masks[0][b]
    if missing:  # as wide as the step's masks, to compare with them
        bitmask, errors = _grammar_masks([(step.rows[i].constraint, k) for k, i in enumerate(missing)],
                                         len(missing), step.bitmask.shape[1] * 32)
        now.update((i, bitmask[k]) for k, i in enumerate(missing) if k not in errors)
    changed = {}
    for i, mask in now.items():
        _note_mask(step.rows[i], mask)
        if not np.array_equal(mask, step.bitmask[i]):
            changed[i] = mask
    return changed


def _redraw(step: InFlight, result: StepResult, batch: RunningBatch | None,
            changed: dict[int, np.ndarray]) -> int:
    """Draw the `changed` rows of a read plain step again from its logits, under their masks
    now (as `_changed_masks` gives them) and with the same random numbers (the sampler state
    it drew with): exactly what the step would have drawn had it waited for their previous
    token. `result` (the step read) takes the new tokens and logprobs; a row still in `batch`
    whose token changed gets it as its next input and in its sampler's history (the token
    drawn before was never an input: the step after it is not launched). Returns the number
    of rows whose token changed."""
    assert step.bitmask is not None and step.logits is not None and step.sampler is not None
    bitmask = step.bitmask.copy()
    for i, mask in changed.items():
        bitmask[i] = mask
    out = sample(_masked(step.logits, bitmask).astype(mx.float32), step.sampler)
    again = _collect(InFlight(step.rows, out.tokens, None, out.logprobs, out.top_ids,
                              out.top_logprobs))
    moved: list[tuple[int, int, int]] = []  # (row of the step, old token, new token)
    for i in changed:
        old, new = result.tokens[i][0], again.tokens[i][0]
        result.tokens[i] = [new]
        if result.logprobs is not None and again.logprobs is not None:
            result.logprobs[i] = again.logprobs[i]
        if result.top_logprobs is not None and again.top_logprobs is not None:
            result.top_logprobs[i] = again.top_logprobs[i]
        if old != new:
            moved.append((i, old, new))
    if batch is not None and moved:
        _replace_last_tokens(batch, step, moved)
    return len(moved)


def _replace_last_tokens(batch: RunningBatch, step: InFlight,
                         moved: list[tuple[int, int, int]]) -> None:
    """Rows of `batch` whose last draw (in `step`) changed from old to new token: their next
    input and their sampler's counts and seen tokens as if they had drawn the new one."""
    where = {id(r): b for b, r in enumerate(batch.rows)}
    fix = [(where[id(step.rows[i])], i, old, new) for i, old, new in moved
           if id(step.rows[i]) in where]
    if not fix or batch.next_tokens is None or batch.sampler is None or step.sampler is None:
        return
    rows = mx.array([b for b, _, _, _ in fix], dtype=mx.int32)
    olds = mx.array([old for _, _, old, _ in fix], dtype=mx.int32)
    news = mx.array([new for _, _, _, new in fix], dtype=mx.int32)
    batch.next_tokens = batch.next_tokens.at[rows].add(news - olds)
    batch.sampler = batch.sampler.replace_last(rows, olds, news, step.sampler,
                                               [i for _, i, _, _ in fix])


def _fill_masks(constrained: list[tuple[Any, ...]], bitmask: np.ndarray,
                fill: Callable[[Any, np.ndarray], None] = constrain.fill_masks) -> dict[int, str]:
    """All rows' masks in one call; if that fails, row by row, so that one broken grammar
    fails only its own row. `constrained`: (grammar, row index, ...) as `fill` takes them:
    `constrain.fill_masks`' pairs, or `constrain.fill_draft_masks`' triples (with drafts)."""
    try:
        fill(constrained, bitmask)
        return {}
    except Exception:  # noqa: BLE001 - find the row(s) at fault below
        log.debug("batched grammar mask failed; retrying row by row", exc_info=True)
    errors: dict[int, str] = {}
    for row in constrained:
        i = row[1]
        try:
            fill([row], bitmask)
        except Exception as exc:  # noqa: BLE001 - a grammar engine failure ends this row
            errors[i] = f"{type(exc).__name__}: {exc}"
            bitmask[i] = -1
    return errors


def _logprobs(
    logits: mx.array, tokens: mx.array, sampler: SamplerState
) -> tuple[mx.array | None, mx.array | None, mx.array | None]:
    """`engine.sampling.token_logprobs` of every column of a [B, W, V] forward."""
    if not sampler.want_logprobs:
        return None, None, None
    B, W, V = logits.shape
    chosen, ids, lps = token_logprobs(
        logits.reshape(B * W, V), tokens.reshape(B * W), sampler.num_top_logprobs
    )
    if ids is None or lps is None:
        return chosen.reshape(B, W), None, None
    K = ids.shape[-1]
    return chosen.reshape(B, W), ids.reshape(B, W, K), lps.reshape(B, W, K)


def _all_at_their_limit(batch: RunningBatch, inflight: InFlight | None,
                        first: InFlight | None) -> bool:
    """Whether every row of `batch` reaches its max_new_tokens with the tokens already computed
    but not yet reported (the step in flight, the first tokens of this step's prefill)."""
    if any(r.num_generated + 1 < r.max_new_tokens for r in batch.rows):
        return False  # a row with two tokens to go: at most one of them is pending
    pending = {id(r) for r in inflight.rows} if inflight is not None else set()
    if first is not None:
        pending.update(id(r) for r in first.rows)
    return all(r.num_generated + (id(r) in pending) >= r.max_new_tokens for r in batch.rows)


def _outputs(step: InFlight) -> list[mx.array]:
    return [a for a in (step.tokens, step.logprobs, step.top_ids, step.top_logprobs)
            if a is not None]


def _joined(result: StepResult, first: InFlight | None) -> StepResult:
    """`result` with the first tokens of the rows whose prefill completed this step after its
    own rows (`first`: already evaluated)."""
    if first is None:
        return result
    new = _collect(first)
    offset = len(result.rows)
    for name in ("logprobs", "top_logprobs"):
        a, b = getattr(result, name), getattr(new, name)
        if a is not None or b is not None:
            setattr(result, name, (a if a is not None else [[] for _ in result.rows])
                    + (b if b is not None else [[] for _ in new.rows]))
    result.rows = result.rows + new.rows
    result.tokens = result.tokens + new.tokens
    result.errors.update({offset + i: e for i, e in new.errors.items()})
    return result


def _collect(step: InFlight) -> StepResult:
    """Wait for a step and bring its outputs to the host, as per-row lists."""
    if step.counts is None:  # a plain step: one token per row
        tokens = cast(list[int], step.tokens.tolist())
        result = StepResult(step.rows, [[t] for t in tokens], errors=step.errors)
        if step.logprobs is not None:
            result.logprobs = [[x] for x in cast(list[float], step.logprobs.tolist())]
        if step.top_ids is not None and step.top_logprobs is not None:
            ids = cast(list[list[int]], step.top_ids.tolist())
            lps = cast(list[list[float]], step.top_logprobs.tolist())
            pairs = zip(ids, lps, strict=True)
            result.top_logprobs = [[list(zip(a, b, strict=True))] for a, b in pairs]
        return result
    counts = step.counts.tolist()
    arr = np.array(step.tokens)
    result = StepResult(step.rows, [arr[b, :n].tolist() for b, n in enumerate(counts)],
                        errors=step.errors)
    if step.logprobs is not None:
        lp = np.array(step.logprobs)
        result.logprobs = [lp[b, :n].tolist() for b, n in enumerate(counts)]
    if step.top_ids is not None and step.top_logprobs is not None:
        top_ids, top_lps = np.array(step.top_ids), np.array(step.top_logprobs)
        result.top_logprobs = [
            [list(zip(top_ids[b, j].tolist(), top_lps[b, j].tolist(), strict=True))
             for j in range(n)]
            for b, n in enumerate(counts)
        ]
    return result


def _arrays_of(state: Any) -> list[mx.array]:
    return [v for v in (getattr(state, f) for f in state.__slots__) if isinstance(v, mx.array)]
