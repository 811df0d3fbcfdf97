"""Request → the engine's `SamplingParams`, one conversion for every API.

Each API maps its own field names onto `SamplingRequest` (None = the request left it out):

    OpenAI chat / completions   max_completion_tokens | max_tokens, temperature, top_p, seed, ...
    Anthropic Messages          max_tokens (required), temperature, top_p, top_k
    Responses                   max_output_tokens, temperature, top_p

then `build_params` does the rest, the same way for all of them:

- checks the prompt ids once (not empty, inside the vocabulary, shorter than the context), so a
  bad prompt is a 400 before the engine sees it;
- fills what the request left out from the server's defaults (`ServerConfig`, i.e. the CLI's
  `--max-tokens`, `--temp`, `--top-p`);
- sets the output limit: the request's, else `--max-tokens`, else the whole room the prompt
  leaves in the context; never more than that room (OpenAI refuses a limit larger than the whole
  context, `refuse_over_context`; Anthropic and Responses clients send limits sized for other
  models, which are capped instead);
- checks `logit_bias` and `stop_token_ids` against the vocabulary.

Example: context 4096, a 96-token prompt, no `--max-tokens`, a request without a limit →
`max_tokens=4000`; with `--max-tokens 512` → 512; a request asking for 5000 on Anthropic → 4000.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine.api import SamplingParams
from server.config import ServerConfig
from server.errors import bad_request
from server.prompts import ServedModel, check_prompt_ids


@dataclass(slots=True)
class SamplingRequest:
    """What one request asks of the sampler, in the engine's terms; None = not given."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # 0 or -1 = off
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: Mapping[str, float] | None = None  # JSON object: token id (as text) → bias
    seed: int | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    constraint: Any = None  # grammar for constrained decoding (server.structured, server.turn)
    max_tokens_param: str = "max_tokens"  # the request field errors about the limit name
    refuse_over_context: bool = False  # a limit above the whole context is a 400, not capped


def build_params(
    req: SamplingRequest,
    config: ServerConfig,
    model: ServedModel,
    prompt_ids: Sequence[int],
    prompt_param: str = "prompt",
) -> SamplingParams:
    """The engine's SamplingParams for `req` on this prompt; APIError(400) for bad input."""
    check_prompt_ids(model, prompt_ids, prompt_param)
    temperature = req.temperature if req.temperature is not None else config.temperature
    top_p = req.top_p if req.top_p is not None else config.top_p
    if top_p == 0.0:  # OpenAI accepts top_p=0: only the most likely token survives
        temperature, top_p = 0.0, 1.0
    return SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=max(0, req.top_k or 0),
        min_p=req.min_p or 0.0,
        repetition_penalty=req.repetition_penalty if req.repetition_penalty is not None else 1.0,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        logit_bias=logit_bias_ids(req.logit_bias, model.vocab_size),
        seed=req.seed,
        max_tokens=output_limit(req, config, model.context_length, len(prompt_ids)),
        stop_token_ids=stop_token_ids(req.stop_token_ids, model.vocab_size),
        ignore_eos=req.ignore_eos,
        logprobs=req.logprobs,
        top_logprobs=req.top_logprobs,
        constraint=req.constraint,
    )


def output_limit(
    req: SamplingRequest, config: ServerConfig, context_length: int, num_prompt_tokens: int
) -> int:
    """Tokens this request may generate: its own limit, else the server's default, else all the
    room the prompt leaves, and never more than that room (>= 1: the prompt was checked)."""
    room = max(1, context_length - num_prompt_tokens)
    requested, param = req.max_tokens, req.max_tokens_param
    if requested is None:
        default = config.default_max_tokens
        return room if default is None else min(default, room)
    if requested < 1:
        raise bad_request(f"{param} must be at least 1", param)
    if requested > context_length and req.refuse_over_context:
        raise bad_request(
            f"{param} is too large: {requested}. This model's maximum context length is "
            f"{context_length} tokens.",
            param,
        )
    return min(requested, room)


def logit_bias_ids(bias: Mapping[str, float] | None, vocab_size: int) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
        if not 0 <= token < vocab_size:
            raise bad_request(
                f"logit_bias token {token} is outside the vocabulary (0..{vocab_size - 1})",
                "logit_bias",
            )
        if not -100.0 <= value <= 100.0:
            raise bad_request(f"logit_bias values must be in [-100, 100], got {value}", "logit_bias")
        out[token] = float(value)
    return out


def stop_token_ids(ids: Sequence[int] | None, vocab_size: int) -> tuple[int, ...]:
    out = tuple(ids or ())
    for t in out:
        if not 0 <= t < vocab_size:
            raise bad_request(
                f"stop_token_ids: {t} is outside the vocabulary (0..{vocab_size - 1})",
                "stop_token_ids",
            )
    return out
