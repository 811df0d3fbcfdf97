"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right status.

Everything the client got wrong is a 4xx with a reason; a 500 means a bug in mlxd, and the server
keeps serving after it (see `server.middleware.RequestContextMiddleware`).
"""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from engine.api import EngineError, EngineOverloaded

log = logging.getLogger("mlxd.server")

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


# Every public route family, for the 404 message (tests check that no route is left out).
ROUTE_FAMILIES = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/messages",
    "/v1/models",
    "/tokenize",
    "/detokenize",
    "/health",
    "/metrics",
    "/docs",
    "/redoc",
    "/openapi.json",
)
ROUTES_HINT = "This server has " + ", ".join(ROUTE_FAMILIES) + " and the chat page at /."


def error_type(status: int) -> str:
    return _TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")


class APIError(Exception):
    """An error the client should see as-is."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or error_type(status)
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(
    message: str,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unsupported(field: str, why: str = "") -> APIError:
    msg = f"'{field}' is not supported by this server"
    return APIError(
        400, msg + (f": {why}" if why else ""), param=field, code="unsupported_parameter"
    )


def headers_too_large(limit: int) -> APIError:
    return APIError(
        431,
        f"The request line and headers are larger than {limit} bytes.",
        code="request_header_fields_too_large",
    )


def from_engine_error(exc: EngineError) -> APIError:
    """EngineOverloaded → 429 with Retry-After; any other EngineError → its own status."""
    if isinstance(exc, EngineOverloaded):
        retry = max(1, math.ceil(exc.retry_after))
        return APIError(429, exc.message, code=exc.code, headers={"Retry-After": str(retry)})
    status = exc.status if 400 <= exc.status <= 599 else 500
    return APIError(status, exc.message, code=exc.code)


def _loc_to_param(loc: tuple[Any, ...]) -> str | None:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif item in ("body",) and not parts:
            continue
        else:
            parts.append(("." if parts else "") + str(item))
    return "".join(parts) or None


def from_validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    """Pydantic's first complaint, phrased for a person; malformed JSON included (400 both)."""
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request body")
    err = errors[0]
    kind = err.get("type", "")
    param = _loc_to_param(tuple(err.get("loc", ())))
    msg = str(err.get("msg", "invalid value"))
    if kind == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", msg)
        return bad_request(
            f"We could not parse the JSON body of your request ({detail}).", code="invalid_json"
        )
    if param is None:
        if kind in ("model_type", "dict_type", "model_attributes_type"):
            return bad_request("The request body must be a JSON object.", code="invalid_json")
        return bad_request(f"Invalid request body: {msg}")
    if kind == "missing":
        return bad_request(
            f"Missing required parameter: '{param}'.",
            param=param,
            code="missing_required_parameter",
        )
    if "input" in err and kind not in ("extra_forbidden",):
        shown = repr(err["input"])
        if len(shown) > 80:
            shown = shown[:77] + "..."
        msg = f"{msg} (got {shown})"
    return bad_request(f"Invalid value for '{param}': {msg}", param=param, code="invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    async def api_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return exc.response()

    async def engine_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, EngineError)
        return from_engine_error(exc).response()

    async def validation_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, (ValidationError, RequestValidationError))
        return from_validation_error(exc).response()

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        status = exc.status_code
        if status == 404:
            msg = f"Unknown endpoint {request.method} {request.url.path[:200]}. {ROUTES_HINT}"
        elif status == 405:
            msg = "Method not allowed for this endpoint."
        else:
            msg = str(exc.detail)
        err = APIError(
            status, msg, code="not_found" if status == 404 else None, headers=dict(exc.headers or {})
        )
        return err.response()

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(EngineError, engine_error)
    app.add_exception_handler(ValidationError, validation_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
