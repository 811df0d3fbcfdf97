"""Embeddings from a decoder served through mlx-lm: last-token pooling of the final hidden state.

    embedder = Embedder.for_model(loaded, budget, max_batch_tokens=4096)
    embedder.check(request)           # any thread: EngineError before anything is queued
    embedder.add(EmbedJob(request, done))
    embedder.step(reserved_bytes, decoding=True)   # engine thread: one batch, between decode steps

What a vector is: the model's backbone (mlx-lm's inner model, `model.model` in most
architectures, without the lm_head) runs over the input; its output (after the final norm) at
the input's last token is the embedding, L2-normalised in float32. This is how decoder embedding
models such as the Qwen3-Embedding family are meant to be pooled; their instruction format
("Instruct: ...\\nQuery: ...") is the client's to write, and their tokenizer appends the end
token they pool on. A chat model gives its last-token vectors the same way.

Batching: rows (the inputs of one or several requests) are right-padded to the longest row of
the batch. Decoders attend causally, so a real token never sees the padding that follows it and
each row's last real token is exactly what it is alone; the row's vector is read there. A batch
holds at most `max_batch_tokens` padded tokens (one input longer than that runs alone), and its
activations must fit the memory budget next to the weights and the KV the running rows reserve.

Matryoshka truncation (`dimensions`): a model declares the sizes it was trained to be cut to in
its config.json, `"matryoshka_dimensions": [64, 128, 256]`; the vector is cut to the first
`dimensions` values and renormalised. Other sizes (and models that declare none) are refused.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, cast

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from engine.api import EmbeddingRequest, EmbeddingResult, EngineError, check_token_ids
from engine.kv.memory import MemoryBudget
from engine.loader import LoadedModel

log = logging.getLogger("mlxd.engine")

MAX_INPUTS = 2048  # inputs per request (OpenAI's limit)
MAX_REQUEST_TOKENS = 300_000  # tokens of all inputs of one request (OpenAI's limit)
BACKBONE_PATHS = (("model",), ("transformer",), ("backbone",), ("language_model", "model"),
                  ("language_model", "transformer"), ("language_model", "backbone"))

Done = Callable[[EmbeddingResult | None, EngineError | None], None]


def find_backbone(model: Any) -> Any | None:
    """mlx-lm's inner model (token ids -> final hidden states), or None when the architecture
    keeps it under a name not in BACKBONE_PATHS."""
    for path in BACKBONE_PATHS:
        module = model
        for name in path:
            module = getattr(module, name, None)
            if module is None:
                break
        if module is not None and callable(module) and hasattr(module, "parameters"):
            return module
    return None


def matryoshka_dimensions(config: dict[str, Any]) -> tuple[int, ...]:
    """The sizes config.json's `matryoshka_dimensions` declares (empty: truncation refused)."""
    sizes = config.get("matryoshka_dimensions") or ()
    if not isinstance(sizes, list | tuple):
        return ()
    return tuple(sorted({int(s) for s in sizes if isinstance(s, int) and s > 0}))


def _args(model: Any, name: str, default: int) -> int:
    value = getattr(getattr(model, "args", None), name, None)
    return int(value) if isinstance(value, int) and value > 0 else default


def normalise(vectors: np.ndarray, dimensions: int | None = None) -> np.ndarray:
    """Rows cut to `dimensions` values (None: all), each scaled to unit L2 norm (float32)."""
    cut = vectors if dimensions is None else vectors[:, :dimensions]
    norms = np.linalg.norm(cut.astype(np.float64), axis=1, keepdims=True)
    return (cut / np.maximum(norms, 1e-12)).astype(np.float32)


@dataclass(slots=True)
class EmbedJob:
    """One request: its inputs run shortest first (they batch with neighbours of like length)."""

    request: EmbeddingRequest
    done: Done  # called once, on the engine thread, with the result or the error
    order: list[int] = field(init=False)
    next: int = 0  # the next position in `order` to run
    vectors: list[np.ndarray | None] = field(init=False)
    cancelled: bool = False  # set from any thread; the job's rows not yet run are dropped

    def __post_init__(self) -> None:
        inputs = self.request.inputs
        self.order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
        self.vectors = [None] * len(inputs)

    @property
    def num_tokens(self) -> int:
        return sum(len(ids) for ids in self.request.inputs)

    def pending(self) -> bool:
        return self.next < len(self.order)


class Embedder:
    """The queue of embedding jobs and the batched forward (engine thread, except `check`)."""

    def __init__(self, model: Any, config: dict[str, Any], context_length: int, vocab_size: int,
                 budget: MemoryBudget, max_batch_tokens: int = 4096, pad_id: int = 0):
        self.backbone = find_backbone(model)
        self.context_length = context_length
        self.vocab_size = vocab_size
        self.budget = budget
        self.max_batch_tokens = max(1, max_batch_tokens)
        self.pad_id = pad_id if 0 <= pad_id < vocab_size else 0
        self.dimension = _args(model, "hidden_size", 0)
        self.matryoshka = matryoshka_dimensions(config)
        self.jobs: deque[EmbedJob] = deque()
        # activations of a batch: hidden states and MLP intermediates per token, plus the
        # float32 attention scores of a layer per row (a generous bound, as for prefill)
        hidden = self.dimension or 4096
        inter = _args(model, "intermediate_size", 4 * hidden)
        self.heads = _args(model, "num_attention_heads", 32)
        self.bytes_per_token = _weight_itemsize(model) * (8 * hidden + 3 * inter)
        self.num_batches = 0
        self.num_rows = 0

    @classmethod
    def for_model(cls, loaded: LoadedModel, budget: MemoryBudget,
                  max_batch_tokens: int = 4096) -> Embedder:
        pad = loaded.config.get("pad_token_id")
        return cls(loaded.model, loaded.config, loaded.context_length, loaded.vocab_size, budget,
                   max_batch_tokens, pad if isinstance(pad, int) else 0)

    # -- any thread ------------------------------------------------------------------------
    def check(self, request: EmbeddingRequest) -> None:
        """Refuse what can never run: EngineError with the HTTP status and an OpenAI code."""
        if self.backbone is None:
            raise EngineError("this model's architecture keeps its hidden states where mlxd "
                              "does not look; it cannot serve embeddings", status=501,
                              code="embeddings_unsupported")
        inputs = request.inputs
        if not inputs:
            raise EngineError("the input is empty", status=400, code="empty_input")
        if len(inputs) > MAX_INPUTS:
            raise EngineError(f"at most {MAX_INPUTS} inputs per request; got {len(inputs)}")
        total = sum(len(ids) for ids in inputs)
        if total > MAX_REQUEST_TOKENS:
            raise EngineError(f"at most {MAX_REQUEST_TOKENS} tokens per request (all inputs "
                              f"together); got {total}", code="request_too_large")
        for i, ids in enumerate(inputs):
            self._check_input(i, ids)
        self._check_dimensions(request.dimensions)
        longest = max(len(ids) for ids in inputs)
        need = self.budget.weights + self.batch_bytes(1, longest)
        if need > self.budget.budget:
            raise EngineError(
                f"embedding an input of {longest} tokens needs about {need / 2**20:.0f} MiB "
                f"(weights + activations), more than the memory budget of "
                f"{self.budget.budget / 2**20:.0f} MiB", status=413, code="memory_budget_exceeded")

    def _check_input(self, i: int, ids: list[int]) -> None:
        if not ids:
            raise EngineError(f"input[{i}] is empty", code="empty_input")
        if len(ids) > self.context_length:
            raise EngineError(f"this model's maximum context length is {self.context_length} "
                              f"tokens; input[{i}] has {len(ids)} tokens",
                              code="context_length_exceeded")
        check_token_ids(ids, self.vocab_size, f" in input[{i}]")

    def _check_dimensions(self, dimensions: int | None) -> None:
        if dimensions is None or dimensions == self.dimension:
            return
        if not self.matryoshka:
            raise EngineError(
                "'dimensions' is not supported by this model: it declares no Matryoshka sizes "
                "(config.json 'matryoshka_dimensions'); its vectors have "
                f"{self.dimension} dimensions", code="unsupported_parameter")
        if dimensions not in self.matryoshka:
            sizes = ", ".join(str(s) for s in self.matryoshka)
            raise EngineError(f"'dimensions' must be one of {sizes} or {self.dimension} for "
                              f"this model; got {dimensions}", code="invalid_value")

    def batch_bytes(self, num_rows: int, longest: int) -> int:
        """Transient bytes of a batch of `num_rows` rows padded to `longest` tokens."""
        return num_rows * longest * (self.bytes_per_token + 4 * self.heads * longest)

    # -- engine thread ---------------------------------------------------------------------
    def add(self, job: EmbedJob) -> None:
        self.jobs.append(job)

    def has_work(self) -> bool:
        return any(not job.cancelled for job in self.jobs)

    def fail_all(self, message: str) -> None:
        while self.jobs:
            job = self.jobs.popleft()
            if not job.cancelled:
                job.done(None, EngineError(message, status=500, code="embedding_failed"))

    def step(self, reserved_bytes: int, decoding: bool) -> int:
        """Run one batch (rows taken in queue order); returns how many rows ran. With
        `decoding` (running rows hold `reserved_bytes` of KV) a batch that does not fit next to
        them waits; alone, a row always runs (`check` made sure it fits the budget)."""
        self._drop_cancelled()
        picks = self._pick(self.budget.budget - self.budget.weights - reserved_bytes, decoding)
        if not picks:
            return 0
        rows = [job.request.inputs[i] for job, i in picks]
        try:
            vectors = self.forward(rows)
        except Exception as exc:  # this batch's requests fail; decoding rows go on
            if not isinstance(exc, EngineError):
                log.exception("embedding batch failed")
                exc = EngineError(f"the embedding forward failed: {type(exc).__name__}",
                                  status=500, code="embedding_failed")
            self._fail({id(job): job for job, _ in picks}.values(), exc)
            return len(picks)
        self.num_batches += 1
        self.num_rows += len(picks)
        for (job, i), vec in zip(picks, vectors, strict=True):
            job.vectors[i] = vec
        self._finish_ready()
        return len(picks)

    def _drop_cancelled(self) -> None:
        self.jobs = deque(job for job in self.jobs if not job.cancelled)

    def _pick(self, room: int, decoding: bool) -> list[tuple[EmbedJob, int]]:
        picks: list[tuple[EmbedJob, int]] = []
        longest = 0
        for job in self.jobs:
            while job.pending():
                i = job.order[job.next]
                width = max(longest, len(job.request.inputs[i]))
                n = len(picks) + 1
                fits = self.batch_bytes(n, width) <= room
                if picks and (n * width > self.max_batch_tokens or not fits):
                    return picks
                if not picks and decoding and not fits:
                    return picks  # wait for running rows to give their KV back
                picks.append((job, i))
                job.next += 1
                longest = width
        return picks

    def _finish_ready(self) -> None:
        """Jobs whose rows have all run (rows are taken in queue order, so they lead)."""
        while self.jobs and not self.jobs[0].pending():
            job = self.jobs.popleft()
            if job.cancelled:
                continue
            stacked = np.stack([v for v in job.vectors if v is not None])
            req = job.request
            result = EmbeddingResult(req.req_id, normalise(stacked, req.dimensions), job.num_tokens)
            job.done(result, None)

    @staticmethod
    def _fail(jobs: Iterable[EmbedJob], exc: EngineError) -> None:
        for job in list(jobs):
            if not job.cancelled:
                job.cancelled = True
                job.done(None, exc)

    def forward(self, rows: list[list[int]]) -> np.ndarray:
        """The rows' last-token hidden states, [len(rows), hidden] float32 (not normalised)."""
        longest = max(len(r) for r in rows)
        ids = np.full((len(rows), longest), self.pad_id, dtype=np.int32)
        for j, r in enumerate(rows):
            ids[j, : len(r)] = r
        try:
            hidden = self.backbone(mx.array(ids))  # type: ignore[misc]
        except (TypeError, ValueError) as exc:
            log.warning("embedding forward failed: %s", exc)
            raise EngineError("this model's backbone cannot be called on token ids alone; it "
                              "cannot serve embeddings", status=501,
                              code="embeddings_unsupported") from None
        if not isinstance(hidden, mx.array) or hidden.ndim != 3 or hidden.shape[:2] != ids.shape:
            raise EngineError("this model's backbone does not return per-token hidden states; "
                              "it cannot serve embeddings", status=501,
                              code="embeddings_unsupported")
        last = mx.array([len(r) - 1 for r in rows], dtype=mx.int32)
        pooled = hidden[mx.arange(len(rows)), last].astype(mx.float32)
        mx.eval(pooled)
        return np.array(pooled, copy=True)


def _weight_itemsize(model: Any) -> int:
    params = cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
    for _, p in params:
        if mx.issubdtype(p.dtype, mx.floating):
            return int(p.dtype.size)
    return 4
