"""Forward passes: one prefill chunk for the group being prefilled, one batched decode step.

The runner holds no per-request state; it reads the plan and the running batch and returns host
values (token ids, logprobs) for the scheduler to turn into events.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from engine import constrain, kvcache
from engine.batch import RowMeta, RunningBatch
from engine.models import prepare_model
from engine.sampling import SampleOutput, sample
from engine.scheduler import Plan, StepResult


class Runner:
    def __init__(self, model: Any, kv: kvcache.KVConfig | None = None):
        self.model = model
        self.kv = kv or kvcache.KVConfig()
        prepare_model(model)  # once: recurrent mixers step through padding / rollback

    def new_caches(self, num_rows: int) -> kvcache.Caches:
        return kvcache.new_batch(self.model, num_rows, self.kv)

    def prefill(self, plan: Plan) -> None:
        group = plan.prefill
        if group is None or plan.prefill_end <= group.done:
            return
        start, end = group.done, plan.prefill_end
        padded = False
        if start == 0:
            padded = kvcache.prepare_right_padded(group.caches, [len(t) for t in group.token_lists])
        width = end - start
        rows = [t[start:end] + [0] * (width - len(t[start:end])) for t in group.token_lists]
        self.model(mx.array(rows, dtype=mx.int32), cache=group.caches)
        if padded or end >= group.width:
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
