"""Forward passes: one prefill chunk for the group being prefilled, one batched decode step.

The runner holds no per-request state; it reads the plan and the running batch and returns host
values (token ids, logprobs) for the scheduler to turn into events.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from engine import constrain, cuda_guard, kvcache
from engine.batch import RowMeta, RunningBatch
from engine.models import prepare_model
from engine.sampling import SampleOutput, sample
from engine.scheduler import Plan, StepResult
from engine.spec.widekv import wide, wide_enabled

MIN_BUCKET = 16


def bucket_width(width: int, cap: int) -> int:
    """The forward width a last prefill chunk of `width` columns is padded to: the next power of
    two (at least MIN_BUCKET), never more than `cap` (the scheduler's chunk) nor less than width."""
    b = MIN_BUCKET
    while b < width:
        b *= 2
    return max(width, min(b, cap))


def bucket_widths(cap: int) -> list[int]:
    """Every width `bucket_width` can return below `cap`, and `cap`: the shapes a warm-up builds."""
    widths, w = [], MIN_BUCKET
    while w < cap:
        widths.append(w)
        w *= 2
    return [*widths, cap]


class Runner:
    """Runs prefill chunks and decode steps.

    Stable shapes (`stable_shapes`; opt-in with MLXD_STABLE_SHAPES=1, CUDA only — where MLX runs
    attention over several queries through cuDNN): a cuDNN graph is built per (rows, queries, keys) shape, tens of ms
    each, so a prompt of a new length would pay that on its time to first token. The last chunk
    of a prefill is right-padded to a power-of-two width (the layouts are told each row's real
    length, so the pad columns are never kept) and the keys are widened to the layout's
    allocated capacity (engine/spec/widekv.py), so prompts of any length reuse a few shapes;
    `warmup()` builds those shapes at start-up. Off by default: on the H200 it cut the median
    TTFT of one-row prompts of new lengths from 142 to 26 ms, but one benchmark run with groups of
    4 rows and the prefix cache on aborted inside MLX-CUDA (cudaStreamEndCapture failed), which a
    run with it off did not (bench/results/h200-session2/); not yet explained.
    """

    def __init__(
        self,
        model: Any,
        kv: kvcache.KVConfig | None = None,
        stable_shapes: bool | None = None,
        prefill_chunk: int = 512,
    ):
        self.model = model
        self.kv = kv or kvcache.KVConfig()
        cuda_guard.install()  # MLX-CUDA: RoPE over many rows (engine/cuda_guard.py); no-op elsewhere
        prepare_model(model)  # once: recurrent mixers step through padding / rollback
        kvcache.check_supported(model, self.kv)  # quantized KV: fail at start, not per request
        if stable_shapes is None:  # opt-in: MLXD_STABLE_SHAPES=1 (CUDA only; see below)
            stable_shapes = os.environ.get("MLXD_STABLE_SHAPES", "") == "1" and wide_enabled()
        self.stable_shapes = stable_shapes
        self.prefill_chunk = prefill_chunk
        self.warmup_seconds = self.warmup()

    def warmup(self) -> float:
        """Build the stable prefill shapes and a decode step once (CUDA's per-shape setup) before
        the first request; returns the seconds it took (0 when shapes are not stabilised)."""
        if not self.stable_shapes:
            return 0.0
        import time

        t0 = time.perf_counter()
        for width in bucket_widths(self.prefill_chunk):
            caches = self.new_caches(1)
            kvcache.prepare_right_padded(caches, [width - 1], force=True)
            self.model(mx.zeros((1, width), dtype=mx.int32), cache=wide(caches, force=True))
            kvcache.finalize(caches)
            logits = self.model(mx.zeros((1, 1), dtype=mx.int32), cache=caches)
            mx.eval(logits)
        return time.perf_counter() - t0

    def new_caches(self, num_rows: int) -> kvcache.Caches:
        return kvcache.new_batch(self.model, num_rows, self.kv)

    def prefill(self, plan: Plan) -> None:
        group = plan.prefill
        if group is None or plan.prefill_end <= group.done:
            return
        start, end = group.done, plan.prefill_end
        stable = self.stable_shapes
        if start == 0:  # with stable shapes every group is announced: its last chunk is padded
            lengths = [len(t) for t in group.token_lists]
            kvcache.prepare_right_padded(group.caches, lengths, force=stable)
        width = end - start
        if stable and end >= group.width:  # only the last chunk: pad columns lie past every row
            width = bucket_width(width, plan.chunk or self.prefill_chunk)
        rows = [t[start:end] + [0] * (width - len(t[start:end])) for t in group.token_lists]
        caches = wide(group.caches, force=True) if stable else group.caches
        self.model(mx.array(rows, dtype=mx.int32), cache=caches)
        if end >= group.width:  # the lengths announced at start == 0 hold across chunks
            kvcache.finalize(group.caches)
        kvcache.eval_state(group.caches)

    def launch_decode(self, batch: RunningBatch) -> InFlight:
        """Queue one decode step for every running row without waiting for it (async_eval).

        The step's inputs may themselves still be in flight: the host reads step t's tokens
        while step t+1 computes, so Python bookkeeping overlaps the forward pass.
        """
        assert batch.next_tokens is not None and batch.sampler is not None
        logits = self.model(batch.next_tokens[:, None], cache=batch.caches)[:, -1, :]
        constrained = batch.constrained_rows()
        if constrained:  # the caller made sure every row's previous token is consumed
            logits = _mask_logits(logits, constrained)
        out = sample(logits.astype(mx.float32), batch.sampler)
        batch.sampler = batch.sampler.record(out.tokens)
        batch.next_tokens = out.tokens
        extra = [a for a in (out.logprobs, out.top_ids, out.top_logprobs) if a is not None]
        mx.async_eval(out.tokens, *extra, *batch.arrays(), *_arrays_of(batch.sampler))
        return InFlight(rows=list(batch.rows), out=out)

    @staticmethod
    def collect(inflight: InFlight) -> StepResult:
        """Wait for a launched step and bring its outputs to the host."""
        out = inflight.out
        result = StepResult(tokens=out.tokens.tolist())
        if out.logprobs is not None:
            result.logprobs = out.logprobs.tolist()
        if out.top_ids is not None and out.top_logprobs is not None:
            ids, lps = out.top_ids.tolist(), out.top_logprobs.tolist()
            result.top_logprobs = [list(zip(a, b, strict=True)) for a, b in zip(ids, lps, strict=True)]
        return result


@dataclass(slots=True)
class InFlight:
    """A launched decode step: the rows it covers (at launch) and its lazy outputs."""

    rows: list[RowMeta]
    out: SampleOutput


def _mask_logits(logits: mx.array, constrained: list[tuple[Any, int]]) -> mx.array:
    """-inf on every token a row's grammar forbids; free rows pass through bit for bit.

    The forward pass runs (async_eval) while the grammar engine fills the bitmasks on the CPU.
    """
    mx.async_eval(logits)
    batch, vocab = logits.shape
    bitmask = constrain.new_bitmask(batch, vocab)
    constrain.fill_masks(constrained, bitmask)
    allowed = constrain.allowed_from_bitmask(bitmask, vocab)
    return mx.where(allowed, logits, mx.array(float("-inf"), dtype=logits.dtype))


def _arrays_of(state: Any) -> list[mx.array]:
    return [v for v in (getattr(state, f) for f in state.__slots__) if isinstance(v, mx.array)]
