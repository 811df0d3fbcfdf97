"""Prompt logprobs: the model's log-probability of each prompt token given the tokens before it.

    scorer.check(request)                      # any thread: EngineError before anything is queued
    scorer.add(ScoreJob(request, done))
    scorer.step(reserved_bytes, decoding)      # engine thread: one chunk of the oldest job

What a value is: for positions i = 1 .. L-1 of a prompt of L tokens, ``log_softmax(z_i)[t_i]``
where z_i are the model's raw logits after tokens t_0 .. t_{i-1} (float32, before penalties,
bias or temperature: the model's distribution, as the generated tokens' logprobs are), and the
k best tokens of that distribution (ties: the lower id first is not promised). Position 0 has no
value (nothing precedes it), which OpenAI's completions `echo` shows as null.

How: the prompt runs through the model in chunks of at most `chunk` tokens over a fresh one-row
KV of mlxd's layouts (the runner's forward, so the kernels and attention are the serving ones),
one chunk per engine turn, so decoding rows keep stepping between chunks. The head runs over a
chunk's positions only ([chunk, V] logits at a time, never [L, V]). Jobs run one at a time in
arrival order; while one runs, its KV at its longest and a chunk's activations are held in
`MemoryBudget.side`, which the scheduler's admission counts, and freed when it ends or is
cancelled. Each chunk's complete blocks go into the prefix cache (`store`) with their tokens'
scores, so a generation from the same prompt (completions' `echo` with `logprobs` and
`max_tokens` > 0: lm-eval's loglikelihood requests) restores the KV instead of prefilling the
prompt again, and a later pass over the same prefix (a multiple-choice question's context,
scored again with each answer) starts from the longest scored prefix (`resume`): its KV
restored, its scores copied, the model run from one block before the first new token (whose
score needs the logits of the token before it). Chunks end on the prefix cache's block
boundaries and are no longer than its prefill chunk (a ring must still hold every block of a
chunk when it is stored).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from engine.api import EngineError, ScoreRequest, ScoreResult, check_token_ids
from engine.kv.memory import MemoryBudget
from engine.sampling import token_logprobs

log = logging.getLogger("mlxd.engine")

MAX_TOP = 20  # alternatives per position (OpenAI's chat limit; completions asks for at most 5)
CHUNK = 256  # positions a forward scores at most (the [CHUNK, V] float32 logits live at once)

ScoreDone = Callable[[ScoreResult | None, EngineError | None], None]
# (ids the one-row KV holds, the KV, what the job's previous call returned, the job's scores
# so far: (logprobs, ranks, top, k)) -> the next `after`
StoreBlocks = Callable[[list[int], Any, Any, Any], Any]
# (prompt ids, k) -> (one-row KV of a scored cached prefix or None, the prefix's scores)
ScoredPrefix = Callable[[list[int], int], tuple[Any, Any]]


@dataclass(slots=True)
class ScoreJob:
    request: ScoreRequest
    done: ScoreDone
    cancelled: bool = False  # set from any thread; the job stops before its next chunk
    pos: int = 0  # prompt tokens run so far
    caches: Any = None
    stored: Any = None  # where the prefix cache's walk for this prompt resumes
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)


class Scorer:
    """The queue of scoring jobs and their chunked forwards (engine thread, except `check`)."""

    def __init__(self, forward: Callable[[mx.array, Any], mx.array], new_caches: Callable[[], Any],
                 state_arrays: Callable[[Any], list[Any]], context_length: int, vocab_size: int,
                 budget: MemoryBudget, chunk: int = CHUNK, store: StoreBlocks | None = None,
                 resume: ScoredPrefix | None = None):
        self.forward = forward  # (inputs [1, C], caches) -> logits [1, C, V]
        self.new_caches = new_caches  # a fresh one-row KV
        self.state_arrays = state_arrays  # the arrays of the KV a forward wrote
        self.context_length = context_length
        self.vocab_size = vocab_size
        self.budget = budget
        self.chunk = max(1, chunk)
        self.store = store  # the prefix cache's insert of a chunk's complete blocks
        self.resume = resume  # the prefix cache's longest scored prefix of a prompt
        self.num_positions = 0  # positions run through the model (cached ones are not)
        self.jobs: deque[ScoreJob] = deque()
        self.num_jobs = 0

    # -- any thread ------------------------------------------------------------------------
    def check(self, request: ScoreRequest) -> None:
        """Refuse what can never run: EngineError with the HTTP status and an OpenAI code."""
        ids = request.token_ids
        if not ids:
            raise EngineError("the prompt is empty", code="empty_input")
        if len(ids) > self.context_length:
            raise EngineError(f"this model's maximum context length is {self.context_length} "
                              f"tokens; the prompt has {len(ids)} tokens",
                              code="context_length_exceeded")
        if not 0 <= request.top_logprobs <= MAX_TOP:
            raise EngineError(f"top logprobs must be from 0 to {MAX_TOP}")
        check_token_ids(ids, self.vocab_size)
        need = self.budget.weights + self.job_bytes(len(ids))
        if need > self.budget.budget:
            raise EngineError(
                f"scoring a prompt of {len(ids)} tokens needs about {need / 2**20:.0f} MiB "
                f"(weights + KV + activations), more than the memory budget of "
                f"{self.budget.budget / 2**20:.0f} MiB", status=413, code="memory_budget_exceeded")

    def job_bytes(self, num_tokens: int) -> int:
        """A job's KV at its longest, a chunk's activations and its float32 logits (x3: the
        logits, the float32 copy and the partition of the alternatives)."""
        cols = min(num_tokens, self.chunk)
        return (self.budget.kv_bytes([num_tokens]) + self.budget.transient(cols, num_tokens)
                + 3 * 4 * cols * self.vocab_size)

    # -- engine thread ---------------------------------------------------------------------
    def add(self, job: ScoreJob) -> None:
        self.jobs.append(job)

    def has_work(self) -> bool:
        """Whether a job waits; cancelled jobs are dropped here (their KV with them)."""
        if any(job.cancelled for job in self.jobs):
            for job in self.jobs:
                if job.cancelled:
                    self._release(job)
            self.jobs = deque(job for job in self.jobs if not job.cancelled)
        return bool(self.jobs)

    def _release(self, job: ScoreJob) -> None:
        if job.caches is not None:
            job.caches = None
            self.budget.side = 0

    def fail_all(self, message: str) -> None:
        while self.jobs:
            job = self.jobs.popleft()
            self._release(job)
            if not job.cancelled:
                job.done(None, EngineError(message, status=500, code="scoring_failed"))

    def step(self, reserved_bytes: int, decoding: bool) -> bool:
        """One chunk of the oldest job; True when a chunk ran. With `decoding` (running rows
        hold `reserved_bytes` of KV) a job that does not fit next to them waits to start;
        alone it always runs (`check` made sure it fits the budget)."""
        if not self.has_work():
            return False
        job = self.jobs[0]
        ids = job.request.token_ids
        if job.caches is None:
            room = self.budget.budget - self.budget.weights - reserved_bytes
            if decoding and self.job_bytes(len(ids)) > room:
                return False  # wait for running rows to give their KV back
            self.budget.side = self.job_bytes(len(ids))  # admission counts it while the job runs
            self._start(job)
        try:
            self._chunk(job)
        except Exception as exc:  # this request fails; decoding rows go on
            self.jobs.popleft()
            self._release(job)
            if not isinstance(exc, EngineError):
                log.exception("scoring forward failed")
                exc = EngineError(f"the scoring forward failed: {type(exc).__name__}",
                                  status=500, code="scoring_failed")
            job.done(None, exc)
            return True
        if job.pos >= len(ids) - 1:
            self.jobs.popleft()
            self.num_jobs += 1
            self._release(job)
            job.done(ScoreResult(job.request.req_id, job.logprobs, job.top, job.ranks), None)
        return True

    def _start(self, job: ScoreJob) -> None:
        """The job's KV: a cached prefix whose scores earlier passes stored (restored, with
        them), else a fresh one-row KV."""
        caches = None
        if self.resume is not None:
            caches, (logprobs, ranks, top, _) = self.resume(job.request.token_ids,
                                                            job.request.top_logprobs)
        if caches is None:
            job.caches = self.new_caches()
            return
        job.caches, job.pos = caches, len(logprobs)
        job.logprobs, job.ranks, job.top = list(logprobs), list(ranks), [list(t) for t in top]

    def _chunk(self, job: ScoreJob) -> None:
        """Run positions pos .. pos + chunk - 1 (of the first L - 1: the last token predicts
        nothing); position j's logits score token j + 1."""
        ids = job.request.token_ids
        start = job.pos
        end = min(len(ids) - 1, start + self.chunk)
        job.pos = end
        if end <= start:  # a one-token prompt: nothing to score
            return
        self.num_positions += end - start
        z = self.forward(mx.array([ids[start:end]], dtype=mx.int32), job.caches)[0]
        target = mx.array(ids[start + 1 : end + 1], dtype=mx.int32)
        # the generated tokens' logprobs come from the same function (engine.sampling)
        chosen, best, best_lp = token_logprobs(z, target, job.request.top_logprobs)
        raw = z.astype(mx.float32)
        rank = (raw > mx.take_along_axis(raw, target[:, None], axis=-1)).sum(axis=-1) + 1
        outs = [a for a in (chosen, rank, best, best_lp) if a is not None]
        mx.eval(*outs, *self.state_arrays(job.caches))  # the chunk's KV with its scores
        if best is not None and best_lp is not None:
            ids_k, lps_k = np.array(best).tolist(), np.array(best_lp).tolist()
            job.top.extend([list(zip(i, v, strict=True)) for i, v in zip(ids_k, lps_k, strict=True)])
        else:
            job.top.extend([] for _ in range(end - start))
        job.logprobs.extend(np.array(chosen).tolist())
        job.ranks.extend(np.array(rank).tolist())
        if self.store is not None:
            scores = (job.logprobs, job.ranks, job.top, job.request.top_logprobs)
            job.stored = self.store(ids[:end], job.caches, job.stored, scores)
