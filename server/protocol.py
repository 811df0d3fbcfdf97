"""Request models for the OpenAI endpoints (pydantic 2, strict JSON types).

Parse a body with `ChatCompletionRequest.parse(body_bytes)`: malformed JSON, wrong types and
out-of-range values all raise `APIError(400)` with the offending `param`. Unknown fields are
ignored; fields we know but cannot honour are rejected by `check_supported()` with a reason.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, ValidationError
from pydantic_core import PydanticCustomError

from server.errors import APIError, bad_request, from_validation_error, unsupported

MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 512
MAX_N = 16
INT64 = 2**63


def _stop(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise PydanticCustomError("stop_type", "must be a string or a list of strings")
    if len(value) > MAX_STOP_STRINGS:
        raise PydanticCustomError("stop_count", f"at most {MAX_STOP_STRINGS} stop strings")
    for s in value:
        if not s:
            raise PydanticCustomError("stop_empty", "stop strings must not be empty")
        if len(s) > MAX_STOP_LENGTH:
            raise PydanticCustomError(
                "stop_long", f"stop strings are at most {MAX_STOP_LENGTH} characters"
            )
    return list(dict.fromkeys(value))


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def texts_or_id_lists(value: Any, name: str = "prompt",
                      empty_rows: bool = False) -> list[str] | list[list[int]]:
    """str | list[str] | list[int] | list[list[int]] → a list of texts or of id lists (what
    completions' `prompt` and embeddings' `input` accept; `name` words the errors). With
    `empty_rows`, an id list may be empty (the caller refuses it with its own message)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value):
            return list(value)
        if all(_is_int(t) for t in value):
            return [list(value)]
        if all(isinstance(p, list) and (p or empty_rows) and all(_is_int(t) for t in p)
               for p in value):
            return [list(p) for p in value]
    if isinstance(value, list) and not value:
        raise PydanticCustomError(f"{name}_empty", f"the {name} must not be empty")
    raise PydanticCustomError(
        f"{name}_type",
        "must be a string, a list of strings, a list of token ids, or a list of lists of token ids",
    )


def _prompt(value: Any) -> list[str] | list[list[int]]:
    return texts_or_id_lists(value, "prompt")


def _content(value: Any) -> str | list[dict[str, Any]] | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) for p in value):
        for part in value:
            if not isinstance(part.get("type"), str):
                raise PydanticCustomError("part_type", "each content part needs a string 'type'")
        return value
    raise PydanticCustomError("content_type", "must be a string or a list of content parts")


StopField = Annotated[list[str], PlainValidator(_stop)]
PromptField = Annotated[list[Any], PlainValidator(_prompt)]
ContentField = Annotated[Any, PlainValidator(_content)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Model):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM: usage on every chunk too


class ChatMessage(BaseModel):
    # extra="allow": keys such as `tool_calls`, `name`, `reasoning_content` reach the template
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: ContentField = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


def check_message_fields(messages: list[ChatMessage], param: str = "messages") -> None:
    """What OpenAI requires of each message: `content` (an assistant message may carry
    `tool_calls` or `function_call` instead), and a tool message's `tool_call_id`."""
    for i, m in enumerate(messages):
        where = f"{param}[{i}]"
        if m.content is None and not (m.role == "assistant" and _calls_something(m)):
            raise _missing(f"{where}.content")
        if m.role == "tool" and m.tool_call_id is None:
            raise _missing(f"{where}.tool_call_id")


def _calls_something(m: ChatMessage) -> bool:
    return bool(m.tool_calls) or bool((m.model_extra or {}).get("function_call"))


def _missing(param: str) -> APIError:
    return bad_request(
        f"Missing required parameter: '{param}'.", param, code="missing_required_parameter"
    )


class _SamplingRequest(_Model):
    """Fields /v1/chat/completions and /v1/completions share."""

    model: str | None = None
    keep_alive: float | str | None = None  # Ollama's: seconds or "5m"; 0 unload, -1 never
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # 0 or -1 = off
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    stop: StopField = Field(default_factory=list)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False
    n: int | None = Field(1, ge=1, le=MAX_N)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    skip_special_tokens: bool | None = True  # vLLM extension
    include_stop_str_in_output: bool | None = False  # vLLM extension

    @classmethod
    def parse(cls, body: bytes) -> Any:
        if not body.strip():
            raise bad_request("The request body is empty; send a JSON object.", code="invalid_json")
        try:
            return cls.model_validate_json(body)
        except ValidationError as exc:
            raise from_validation_error(exc) from None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's stream_options.continuous_usage_stats: running usage on every chunk."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)  # type: ignore[union-attr]


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # templating (vLLM extensions)
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    # tools / response_format: server/agent_chat.py; the rest rejected unless neutral
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    # vLLM's extension: the prompt's logprobs (the chat template's tokens), non-streamed only
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    # accepted and ignored: they change nothing about the tokens
    parallel_tool_calls: bool | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    def check_supported(self, agent: bool = False) -> None:
        """`agent`: tools and response_format are handled (server/agent_chat.py)."""
        if not agent:
            self._check_agent_fields()
        check_message_fields(self.messages)
        if self.audio or (self.modalities and any(m != "text" for m in self.modalities)):
            raise unsupported("modalities", "only text output")
        self.prediction_text()  # a malformed prediction is a 400
        if self.web_search_options is not None:
            raise unsupported("web_search_options")
        if self.prompt_logprobs is not None and self.stream:
            raise bad_request("'prompt_logprobs' is not available when 'stream' is true",
                              "prompt_logprobs")
        if self.top_logprobs and not self.logprobs:
            raise bad_request("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
        if self.continue_final_message and self.add_generation_prompt:
            if "add_generation_prompt" in self.model_fields_set:
                raise bad_request(
                    "'continue_final_message' and 'add_generation_prompt' cannot both be true",
                    "continue_final_message",
                )
            self.add_generation_prompt = False
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise bad_request(
                "'continue_final_message' needs an assistant message last", "continue_final_message"
            )

    def prediction_text(self) -> str | None:
        """The predicted output's text (`prediction: {"type": "content", "content": text or
        [{"type": "text", "text": ...}, ...]}`), None without one; 400 when malformed."""
        pred = self.prediction
        if pred is None:
            return None
        content = pred.get("content")
        if pred.get("type") != "content" or content is None:
            raise bad_request("'prediction' must be {\"type\": \"content\", \"content\": ...}",
                              "prediction")
        if isinstance(content, str):
            return content
        if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content
        ):
            return "".join(p["text"] for p in content)
        raise bad_request("'prediction.content' must be a string or a list of text parts",
                          "prediction.content")

    def _check_agent_fields(self) -> None:
        """On the plain path (no tools given): a tool choice that needs tools is a 400."""
        if self.tool_choice not in (None, "none", "auto"):
            raise bad_request("'tool_choice' requires 'tools'", "tool_choice")
        if self.function_call not in (None, "none", "auto"):
            raise bad_request("'function_call' requires 'functions'", "function_call")

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


class CompletionRequest(_SamplingRequest):
    prompt: PromptField
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=5)
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: str | None = None
    # vLLM's extension: each prompt token's logprob, rank and this many alternatives (per choice)
    prompt_logprobs: int | None = Field(None, ge=0, le=20)

    def check_supported(self) -> None:
        if self.suffix:
            raise unsupported("suffix", "fill-in-the-middle is not implemented")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise unsupported("best_of", "only best_of == n")
