"""Operations routes: POST /tokenize, POST /detokenize (vLLM's shapes), GET /metrics."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.responses import JSONResponse, Response

from server.errors import bad_request, from_validation_error
from server.openai_api import app_state
from server.prepare import off_loop
from server.prompts import ServedModel, encode, render_chat, template_messages
from server.protocol import ChatMessage, check_message_fields

router = APIRouter()


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int] = Field(min_length=0)


def _parse(cls: type[BaseModel], raw: bytes) -> Any:
    if not raw.strip():
        raise bad_request("The request body is empty; send a JSON object.")
    try:
        return cls.model_validate_json(raw)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def _token_ids(model: ServedModel, body: TokenizeRequest) -> list[int]:
    """The request's prompt or messages (through the chat template) as ids, in a worker thread."""
    if body.messages is not None:
        text = render_chat(model, template_messages(body.messages),
                           add_generation_prompt=body.add_generation_prompt)
        return encode(model, text, add_special_tokens=bool(body.add_special_tokens), param="messages")
    add = True if body.add_special_tokens is None else body.add_special_tokens
    return encode(model, body.prompt or "", add_special_tokens=add)


@router.post("/tokenize")
async def tokenize(request: Request) -> JSONResponse:
    body: TokenizeRequest = _parse(TokenizeRequest, await request.body())
    model = await app_state(request).models.select(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("send exactly one of 'prompt' or 'messages'")
    if body.messages is not None:
        check_message_fields(body.messages)
    ids = await off_loop(request, _token_ids, model, body)
    out: dict[str, Any] = {"count": len(ids), "max_model_len": model.context_length, "tokens": ids}
    if body.return_token_strs and model.vocab is not None:
        out["token_strs"] = [model.vocab.token_str(t) for t in ids]
    return JSONResponse(out)


@router.post("/detokenize")
async def detokenize(request: Request) -> JSONResponse:
    body: DetokenizeRequest = _parse(DetokenizeRequest, await request.body())
    model = await app_state(request).models.select(body.model)
    return JSONResponse({"prompt": await off_loop(request, _text, model, body.tokens)})


def _text(model: ServedModel, tokens: list[int]) -> str:
    """Ids → text, in a worker thread (a body may hold millions of ids)."""
    for t in tokens:
        if not 0 <= t < model.vocab_size:
            raise bad_request(f"token id {t} is outside the vocabulary (0..{model.vocab_size - 1})", "tokens")
    return str(model.tokenizer.decode(tokens))


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    registry = request.app.state.metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
