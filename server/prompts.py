"""The served model as the HTTP layer sees it, and prompts → token ids (chat templates).

`ServedModel` wraps `engine.api.ModelInfo` once per app: names it answers to, vocabulary size,
token byte table. `chat_prompt_ids` renders messages with the chat template (ModelInfo's override
first, then the tokenizer's, then ChatML) and tokenizes without adding special tokens again.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.api import ModelInfo
from server.detokenize import TokenVocab
from server.errors import APIError, bad_request
from server.tokencache import PromptTokenCache

log = logging.getLogger("mlxd.server")

CHATML_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_IMAGE_PARTS = {"image_url", "input_image", "image", "image_file"}
_AUDIO_PARTS = {"input_audio", "audio"}


@dataclass(slots=True)
class ServedModel:
    info: ModelInfo
    name: str  # the id the API reports
    aliases: set[str] = field(default_factory=set)  # names a request may use
    vocab: TokenVocab | None = None
    vocab_size: int = 0
    max_token_chars: int = 0  # the most characters of text one token can stand for; 0 = unknown
    adapters: tuple[str, ...] = ()  # LoRA adapters served on this model: each a model name too
    adapter: str | None = None  # this view runs with that adapter (server.models)
    engine_name: str | None = None  # Request.model for it (None: the engine's default model)
    # chat prompts' ids, reused from the previous turn's (server.tokencache)
    token_cache: PromptTokenCache | None = None

    @classmethod
    def from_info(cls, info: ModelInfo, alias: str | None = None) -> ServedModel:
        name = alias or info.model_id
        tok = info.tokenizer
        vocab_size = max(int(info.extra.get("vocab_size") or 0), len(tok))
        aliases = {name, info.model_id, info.path}
        adapters = tuple(str(a) for a in info.extra.get("adapters") or ())
        aliases.update(adapters)
        return cls(info, name, aliases, TokenVocab(tok), vocab_size, max_token_chars(tok),
                   adapters, token_cache=PromptTokenCache(tok))

    def adapter_for(self, requested: str | None) -> str | None:
        """The adapter a request's `model` names (None: the base model)."""
        return requested if requested in self.adapters else None

    @property
    def tokenizer(self) -> Any:
        return self.info.tokenizer

    @property
    def context_length(self) -> int:
        return self.info.context_length


def message_text(content: Any, where: str) -> str | None:
    """OpenAI content (a string or a list of parts) → one string; non-text parts → 400."""
    if content is None or isinstance(content, str):
        return content
    texts: list[str] = []
    for j, part in enumerate(content):
        kind = part.get("type")
        param = f"{where}.content[{j}]"
        if kind in ("text", "input_text", "output_text"):
            text = part.get("text")
            if not isinstance(text, str):
                raise bad_request("a text content part needs a string 'text'", param)
            texts.append(text)
        elif kind == "refusal":
            texts.append(str(part.get("refusal") or ""))
        elif kind in _IMAGE_PARTS:
            raise APIError(
                400,
                "Image input is not supported: this model has no vision.",
                param=param,
                code="unsupported_content",
            )
        elif kind in _AUDIO_PARTS or kind == "file":
            raise APIError(
                400,
                f"'{kind}' content is not supported: text only.",
                param=param,
                code="unsupported_content",
            )
        else:
            raise bad_request(f"unknown content part type {kind!r}", param)
    return "".join(texts)


def template_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """Pydantic ChatMessages → plain dicts for the Jinja template (developer → system)."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        d = m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m)
        d["content"] = message_text(d.get("content"), f"messages[{i}]") or ""
        if d["role"] == "developer":
            d["role"] = "system"
        out.append(d)
    return out


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")  # OpenAI's values


def effort_template_kwargs(effort: Any, template_kwargs: dict[str, Any] | None,
                           param: str = "reasoning_effort") -> dict[str, Any] | None:
    """The chat template variables OpenAI's reasoning effort sets: `reasoning_effort` itself
    (gpt-oss's template reads it, "medium" when unset) and, for "none", `enable_thinking: false`
    (Qwen3's switch). The request's own `chat_template_kwargs` win; templates without these
    variables ignore them."""
    if effort is None:
        return template_kwargs
    if effort not in REASONING_EFFORTS:
        raise bad_request(f"{param} must be one of {', '.join(REASONING_EFFORTS)}, not {effort!r}", param)
    kwargs: dict[str, Any] = {"reasoning_effort": effort}
    if effort == "none":
        kwargs["enable_thinking"] = False
    kwargs.update(template_kwargs or {})
    return kwargs


def render_chat(
    model: ServedModel,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    tok = model.tokenizer
    template = model.info.chat_template or getattr(tok, "chat_template", None)
    if not template:
        template = CHATML_TEMPLATE
    kwargs = dict(template_kwargs or {})
    for reserved in ("conversation", "messages", "tokenize", "chat_template"):
        kwargs.pop(reserved, None)
    try:
        text = tok.apply_chat_template(
            messages,
            tools=tools,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **kwargs,
        )
    except Exception as exc:  # jinja TemplateError, raise_exception(...), bad kwargs
        raise bad_request(
            f"The chat template could not render these messages: {exc}", "messages"
        ) from None
    if not isinstance(text, str):  # some tokenizers return a list for batched input
        text = text[0]
    return text


# Normalizers can merge characters (NFC: "e" + U+0301 → "é"), so with one a token may cover a
# few more characters of the original text than its own string has.
_NORMALIZER_SLACK = 4


def max_token_chars(tokenizer: Any) -> int:
    """An upper bound on the characters of input text one token covers; 0 when unknown.

    Vocabulary strings are at least as long as the text they stand for (byte-level BPE writes
    one character per byte, SentencePiece one "▁" per space, byte fallback "<0x41>" for one
    byte). Tokenizers that drop input (whitespace splitting) have no such bound: 0.
    """
    try:
        vocab = tokenizer.get_vocab()
        added = getattr(tokenizer, "added_tokens_decoder", {}).values()
        longest = max([len(t) for t in vocab] + [len(str(t)) for t in added])
    except Exception:  # a tokenizer without a readable vocabulary: no early check
        return 0
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return 0
    pre = type(backend.pre_tokenizer).__name__ if backend.pre_tokenizer is not None else ""
    if pre in ("Whitespace", "WhitespaceSplit", "BertPreTokenizer"):
        return 0
    return longest * (1 if backend.normalizer is None else _NORMALIZER_SLACK)


def context_error(model: ServedModel, num_tokens: int | None, param: str, num_chars: int = 0) -> APIError:
    """OpenAI's context-length 400; `num_tokens` None: the text was too long to tokenize."""
    ctx = model.context_length
    has = (f"has {num_tokens} tokens" if num_tokens is not None
           else f"is {num_chars} characters long, more than {ctx} tokens can hold")
    return bad_request(
        f"This model's maximum context length is {ctx} tokens. However, your prompt {has}, "
        "which leaves no room for a completion. Please shorten the prompt.",
        param,
        code="context_length_exceeded",
    )


def encode(
    model: ServedModel, text: str, *, add_special_tokens: bool, param: str = "prompt"
) -> list[int]:
    """Text → token ids. A text too long to fit the context in any tokenization is refused
    (400 context_length_exceeded) before the tokenizer sees it."""
    bound = model.max_token_chars * model.context_length
    if bound and len(text) > bound:
        raise context_error(model, None, param, len(text))
    if not add_special_tokens and model.token_cache is not None:  # a chat template's text
        return model.token_cache.encode(text)
    # verbose=False: the context check reports long prompts, not a tokenizer warning
    return list(model.tokenizer.encode(text, add_special_tokens=add_special_tokens, verbose=False))


def prediction_ids(model: ServedModel, text: str) -> list[int]:
    """A predicted output's ids (no special tokens), at most the context length of them: text
    past what the context could hold in any tokenization is not tokenized (the engine keeps
    what fits after the prompt)."""
    bound = model.max_token_chars * model.context_length
    if bound:
        text = text[:bound]
    ids = model.tokenizer.encode(text, add_special_tokens=False, verbose=False)
    return list(ids[: model.context_length])


def check_prompt_ids(model: ServedModel, ids: Sequence[int], param: str = "prompt") -> None:
    """A prompt the engine can run: not empty, shorter than the context, ids in the vocabulary."""
    if not ids:
        raise bad_request("The prompt is empty.", param, code="empty_prompt")
    if len(ids) >= model.context_length:
        raise context_error(model, len(ids), param)
    check_vocab(model, ids, param)


def check_vocab(model: ServedModel, ids: Sequence[int], param: str) -> None:
    """Every id inside the model's vocabulary (a 400 naming the first that is not)."""
    for t in ids:
        if not 0 <= t < model.vocab_size:
            raise bad_request(
                f"token id {t} is outside the vocabulary (0..{model.vocab_size - 1})", param
            )
