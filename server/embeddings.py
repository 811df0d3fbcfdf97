"""POST /v1/embeddings in OpenAI's shape (the engine pools and normalises: engine.embed).

    {"model": "...", "input": "text" | ["text", ...] | [ids] | [[ids], ...],
     "encoding_format": "float" | "base64", "dimensions": 256}
    -> {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": ...}],
        "model": "...", "usage": {"prompt_tokens": N, "total_tokens": N}}

Texts are tokenized with the tokenizer's special tokens (its post-processor: an embedding
model's tokenizer appends the token it is pooled on); token ids are used as sent. `base64` is
the vector's little-endian float32 bytes, as OpenAI's SDK decodes them. The router is included
by `server.agents.install`, behind the API key like the other routes.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import numpy as np
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, PlainValidator, ValidationError
from starlette.responses import JSONResponse, Response

from engine.api import EmbeddingRequest
from server.errors import APIError, bad_request, from_validation_error
from server.openai_api import app_state, new_id
from server.prepare import off_loop
from server.prompts import ServedModel, check_vocab
from server.protocol import texts_or_id_lists
from server.sse import run_until_disconnect

router = APIRouter()


def _input(value: Any) -> list[str] | list[list[int]]:
    return texts_or_id_lists(value, "input", empty_rows=True)


InputField = Annotated[list[Any], PlainValidator(_input)]


class EmbeddingsBody(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str
    input: InputField
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None


def _param(body: EmbeddingsBody, i: int) -> str:
    return "input" if len(body.input) == 1 else f"input[{i}]"


def _check(model: ServedModel, ids: list[int], param: str) -> None:
    ctx = model.context_length
    if not ids:
        raise bad_request("The input is empty: it has no tokens to embed.", param, code="empty_input")
    if len(ids) > ctx:
        raise bad_request(
            f"This model's maximum context length is {ctx} tokens, however you requested "
            f"{len(ids)} tokens in the input. Please reduce your input.",
            param, code="context_length_exceeded",
        )
    check_vocab(model, ids, param)


def input_ids(model: ServedModel, body: EmbeddingsBody) -> list[list[int]]:
    """Each input as token ids, checked (a worker thread: long texts take a while)."""
    out: list[list[int]] = []
    bound = model.max_token_chars * model.context_length
    for i, item in enumerate(body.input):
        param = _param(body, i)
        if isinstance(item, str):
            if not item:
                raise bad_request("The input is empty: send non-empty strings.", param,
                                  code="empty_input")
            if bound and len(item) > bound:  # cannot fit in any tokenization: no tokenizing
                raise bad_request(
                    f"This model's maximum context length is {model.context_length} tokens; "
                    f"the input is {len(item)} characters long, more than that can hold.",
                    param, code="context_length_exceeded")
            item = list(model.tokenizer.encode(item, add_special_tokens=True, verbose=False))
        _check(model, item, param)
        out.append(item)
    return out


def encode_vector(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    floats: list[float] = vector.astype(np.float32).tolist()  # each value exact
    return floats


def response_body(model: ServedModel, vectors: Sequence[np.ndarray], num_tokens: int,
                  encoding_format: str) -> dict[str, Any]:
    data = [{"object": "embedding", "index": i, "embedding": encode_vector(v, encoding_format)}
            for i, v in enumerate(vectors)]
    return {"object": "list", "data": data, "model": model.name,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}


def _parse(raw: bytes) -> EmbeddingsBody:
    if not raw.strip():
        raise bad_request("The request body is empty; send a JSON object.")
    try:
        return EmbeddingsBody.model_validate_json(raw)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


@router.post("/v1/embeddings")
async def embeddings(request: Request) -> Response:
    st = app_state(request)
    body = _parse(await request.body())
    model = await st.models.select(body.model)
    if model.adapter is not None:  # adapters change generation, not this
        raise APIError(400, f"'{body.model}' is a LoRA adapter; embeddings come from the base "
                            f"model '{st.model.name}'.", param="model", code="unsupported_model")
    ids = await off_loop(request, input_ids, model, body)
    req = EmbeddingRequest(new_id("embd"), ids, body.dimensions, model=model.engine_name)
    result = await run_until_disconnect(request, lambda: st.client.embed(req))
    if result is None:  # the client left; its rows not yet run were dropped
        return Response(status_code=499)
    return JSONResponse(response_body(model, list(result.vectors), result.num_prompt_tokens,
                                      body.encoding_format))
