"""The engine's public contract: plain dataclasses and the `EngineClient` protocol.

The server talks to the engine only through this module. It never imports `mlx` (importing this
module does not import `mlx` either), so the server can be tested against a fake engine.

Flow:  server builds `Request(req_id, prompt_ids, SamplingParams)` → `await client.submit(req)`
returns an async iterator of `TokenEvent`s (one per engine step that produced tokens for the
row; the last one carries `finish_reason`). Closing the iterator early (client disconnect) or
calling `client.abort(req_id)` frees the row within one engine step.

Embeddings: `await client.embed(EmbeddingRequest(req_id, inputs))` returns one unit-length
float32 vector per input (`EmbeddingResult`); cancelling the await drops the request's rows that
have not run yet. Prompt logprobs: `await client.score(ScoreRequest(req_id, token_ids, k))` returns
the log-probability of every token after the first given the ones before it, with the k best
alternatives (`ScoreResult`).

Several models: `Request.model` names one of `client.list_models()` (None: the default model);
`await client.model_info(name)` gives its tokenizer without loading its weights, and `submit`
waits while the model loads (engine.pool).
"""

from __future__ import annotations

import math
import re
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

# finish reasons, as OpenAI names them where a name exists
FINISH_STOP = "stop"  # eos / stop token id (the server also uses it for stop strings)
FINISH_LENGTH = "length"  # max_tokens or the context limit
FINISH_ABORT = "abort"  # aborted by the client (disconnect) or by the server
FINISH_ERROR = "error"  # the engine failed this request; see TokenEvent.error

# the highest ceiling of the draft length (`--num-draft-tokens`): a verify forward has at most
# this many columns plus one, and on MLX-CUDA every such width takes plain-op attention
# (engine/cuda_guard.py, FEW_QUERIES)
MAX_DRAFT_TOKENS = 32


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling settings. Neutral defaults mean "off".

    Processing order (engine.sampling): penalties → logit_bias → temperature → top-k → top-p →
    min-p → draw. temperature == 0 means greedy (argmax after penalties and bias).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF-style, applied to prompt+generated tokens
    presence_penalty: float = 0.0  # OpenAI-style, on generated tokens
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None  # a seeded row's draws do not depend on its batch mates
    max_tokens: int | None = None  # None = up to the room the prompt leaves in the context
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False  # return the chosen token's logprob
    top_logprobs: int = 0  # and this many alternatives (0..20)
    # Extensions used by later features (structured output, speculation); None = off.
    constraint: Any = None
    allowed_token_ids: tuple[int, ...] | None = None


@dataclass(slots=True)
class Request:
    req_id: str
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0  # lower runs first among waiting requests
    arrival_time: float = 0.0
    adapter: str | None = None  # a LoRA adapter served with the model, by name (None: the base)
    model: str | None = None  # the served model, by name (None: the default model)
    # seconds the model stays loaded once idle after this request (None: the server's
    # --keep-alive; 0: unload when idle; negative: never unload for idleness)
    keep_alive: float | None = None
    # a predicted output (OpenAI's `prediction`): a lookup drafter copies drafts from it
    prediction_ids: list[int] | None = None


@dataclass(slots=True)
class TokenEvent:
    """Tokens one engine step produced for one request (several when drafts were accepted)."""

    req_id: str
    token_ids: list[int]
    logprobs: list[float] | None = None  # one per token, when requested
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token: (id, logprob) best first
    finish_reason: str | None = None  # set on the last event of the stream
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None  # with finish_reason == FINISH_ERROR
    # on a request's first event with tokens: seconds it waited in the engine's queue (admitted
    # -> its prefill began) and from its prefill's start to this first token
    queue_s: float | None = None
    prefill_s: float | None = None
    # on the last event: tokens of the request's prediction that speculation accepted
    accepted_prediction: int = 0


@dataclass(slots=True)
class EmbeddingRequest:
    """Token ids to embed: one vector per input, in order (engine.embed)."""

    req_id: str
    inputs: list[list[int]]
    dimensions: int | None = None  # truncate (Matryoshka) to this size and renormalise
    arrival_time: float = 0.0
    model: str | None = None  # the served model, by name (None: the default model)


@dataclass(slots=True)
class EmbeddingResult:
    req_id: str
    vectors: np.ndarray  # [len(inputs), dim] float32, each row of unit L2 norm
    num_prompt_tokens: int  # tokens of all inputs together


@dataclass(slots=True)
class ScoreRequest:
    """A prompt to score (engine.score): each token's log-probability after the ones before it."""

    req_id: str
    token_ids: list[int]
    top_logprobs: int = 0  # this many best alternatives per position (0..20)
    arrival_time: float = 0.0
    model: str | None = None  # the served model, by name (None: the default model)


@dataclass(slots=True)
class ScoreResult:
    req_id: str
    # positions 1 .. len(token_ids) - 1: log p(token_ids[i] | token_ids[:i]) of the model's raw
    # logits (before any sampling setting), and the best alternatives (id, logprob), best first
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    ranks: list[int]  # each token's rank in its distribution (1: the most likely)


@dataclass(slots=True)
class SpecStats:
    """Speculative decoding since the engine started (`EngineStats.spec`; None: speculation off)."""

    method: str  # the drafter: "ngram", "draft", or a registered one
    num_draft_tokens: int  # the ceiling of the adaptive draft length (--num-draft-tokens)
    spec_steps: int = 0  # engine steps that verified drafts
    plain_steps: int = 0  # engine steps that decoded one token per row
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    acceptance_rate: float | None = None  # accepted / drafted
    mean_verify_width: float | None = None  # columns per verify forward
    tokens_per_row_round: float | None = None  # tokens a row gained per round it drafted in
    # the controller's estimates: tokens a row gains in a round at the ceiling, and the
    # acceptance at each draft position given the earlier ones accepted
    expected_tokens_per_round: float = 1.0
    acceptance_by_position: list[float] = field(default_factory=list)
    overhead_ms_per_spec_step: float = 0.0  # drafter work outside the measured steps
    switch_ms_per_spec_step: float = 0.0  # what switching modes costs, charged to speculating
    explore_ms: float = 0.0  # time spent trying widths that did not pay
    busy_s: float = 0.0
    speculating_by_bucket: dict[str, bool] = field(default_factory=dict)  # batch-size bucket
    step_ms: dict[str, float] = field(default_factory=dict)  # "BxW" -> mean step ms
    drafter: dict[str, float] = field(default_factory=dict)  # the drafter's own figures
    warmup_s: float = 0.0  # start-up rounds, one per verify width (GPU)
    warmup_ms_by_width: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class PrefixCacheStats:
    """The prefix cache (`EngineStats.prefix_cache`; None: the cache is off)."""

    bytes: int = 0
    max_bytes: int = 0
    queries: int = 0
    hits: int = 0
    hit_tokens: int = 0  # prompt tokens served from the cache
    blocks: int = 0
    evicted_blocks: int = 0


@dataclass(slots=True)
class MemoryStats:
    """Process memory by owner, and the engine's memory settings (bytes unless named)."""

    budget_bytes: int = 0  # --memory-budget
    weights_bytes: int = 0
    mlx_cache_limit: int = 0
    rss: int = 0
    mlx_active: int = 0
    mlx_cache: int = 0
    mlx_peak: int = 0
    malloc_in_use: int = 0
    malloc_free: int = 0
    malloc_mmapped: int = 0
    python_blocks: int = 0  # objects alive in Python's allocator (a count)
    num_releases: int = 0  # times idle memory was given back
    release_seconds: float = 0.0


@dataclass(slots=True)
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    num_prefilling: int = 0
    num_queued: int = 0  # what --max-queue bounds (aborted requests excluded)
    active_requests: int = 0  # requests with a stream open
    kv_bytes: int = 0
    kv_bytes_by_layout: dict[str, int] = field(default_factory=dict)
    num_steps: int = 0
    num_generated_tokens: int = 0
    num_prompt_tokens: int = 0
    memory: MemoryStats = field(default_factory=MemoryStats)
    prefix_cache: PrefixCacheStats | None = None
    spec: SpecStats | None = None
    last_error: str | None = None  # the last engine step that failed, if any

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class EngineError(Exception):
    """A request the engine refuses (bad prompt, over budget). `status` is the HTTP status."""

    def __init__(self, message: str, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code


def check_token_ids(ids: Sequence[int], vocab_size: int, where: str = "") -> None:
    """EngineError (400) for the first id outside the vocabulary; `where` names the input
    (" in input[2]")."""
    for t in ids:
        if not 0 <= t < vocab_size:
            raise EngineError(f"token id {t}{where} is outside the vocabulary (0..{vocab_size - 1})")


class EngineOverloaded(EngineError):
    """The waiting queue is full: retry later (HTTP 429 / 503 with Retry-After)."""

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message, status=429, code="overloaded")
        self.retry_after = retry_after


@dataclass(slots=True)
class ModelInfo:
    """What the server needs to know about the loaded model (no MLX objects)."""

    model_id: str
    path: str
    tokenizer: Any  # a Hugging Face tokenizer (transformers.PreTrainedTokenizerBase)
    eos_token_ids: tuple[int, ...]
    context_length: int
    chat_template: str | None
    created: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def keep_alive_seconds(value: float | int | str) -> float:
    """A keep-alive as Ollama takes it → seconds: a number of seconds (300, "300"), or a
    duration ("90s", "5m", "1h30m"); negative → -1.0 (never unloaded for idleness).
    ValueError for anything else."""
    if isinstance(value, bool):
        raise ValueError(value)
    if isinstance(value, str):
        text = value.strip()
        sign, body = (-1.0, text[1:]) if text.startswith("-") else (1.0, text.lstrip("+"))
        try:
            seconds = sign * float(body)
        except ValueError:
            parts = _DURATION.findall(body)
            if not body or "".join(n + u for n, u in parts) != body:
                raise ValueError(value) from None
            seconds = sign * sum(float(n) * _UNIT_S[u] for n, u in parts)
    else:
        seconds = float(value)
    if not math.isfinite(seconds):
        raise ValueError(value)
    return -1.0 if seconds < 0 else seconds


MODEL_LOADED = "loaded"
MODEL_LOADING = "loading"
MODEL_UNLOADED = "unloaded"


@dataclass(slots=True)
class ModelStatus:
    """One configured model as `EngineClient.list_models` reports it."""

    name: str
    state: str  # MODEL_LOADED, MODEL_LOADING or MODEL_UNLOADED
    progress: float | None = None  # 0..1 of the weights read while loading
    weights_bytes: int = 0  # while loaded (or loading: what it will hold)
    load_seconds: float | None = None  # the last load's duration
    idle_seconds: float | None = None  # loaded and idle for this long
    keep_alive: float | None = None  # seconds idle before it is unloaded (None: never)
    error: str | None = None  # why the last load failed, if it did
    default: bool = False  # requests without `model` (or with the default's aliases) run here


@runtime_checkable
class EngineClient(Protocol):
    model: ModelInfo

    async def submit(self, request: Request) -> AsyncIterator[TokenEvent]:
        """Queue `request`; iterate the returned stream for its tokens.

        Raises EngineError (e.g. prompt longer than the context) or EngineOverloaded before
        anything is queued. Closing the stream (aclose / garbage collection) aborts the request.
        """
        ...

    def abort(self, req_id: str) -> None: ...

    def stats(self) -> EngineStats: ...

    def list_models(self) -> list[ModelStatus]:
        """Every configured model, the default first (thread-safe, no file access)."""
        ...

    async def model_info(self, name: str) -> ModelInfo:
        """A configured model's tokenizer, template and limits (read on first use, without its
        weights). Raises EngineError: 404 for a name not configured (no file is touched for
        it), 503 `model_load_failed` for a model whose files cannot be read."""
        ...

    async def embed(self, request: EmbeddingRequest) -> EmbeddingResult:
        """The inputs' embeddings. Raises EngineError (an empty input or one longer than the
        context: 400 context_length_exceeded; `dimensions` the model does not declare: 400; a
        model with no backbone to pool: 501; more than the memory budget: 413) or
        EngineOverloaded before anything is queued."""
        ...

    async def score(self, request: ScoreRequest) -> ScoreResult:
        """The prompt's logprobs. Raises EngineError (an empty prompt or one longer than the
        context: 400; more than the memory budget: 413; an engine that cannot: 501) or
        EngineOverloaded before anything is queued."""
        ...
