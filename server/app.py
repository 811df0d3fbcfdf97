"""`create_app(client, config)`: the FastAPI app in front of any `engine.api.EngineClient`.

    from server.app import create_app
    from server.config import ServerConfig
    app = create_app(client, ServerConfig(port=8080, allowed_origins=["*"]))
    uvicorn.run(app, host=..., port=...)

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /v1/models/{id},
GET /health, GET /openapi.json, /docs, /redoc. With `config.api_key` every route needs the key
except `/health` (which then answers only `{"status": ...}` without it) and the static chat page.
The app's shared state is `app.state.mlxd` (`server.openai_api.AppState`); later
routers (Anthropic, Responses) include themselves with `app.include_router(router,
dependencies=[Depends(require_api_key)])` and reuse `server.generation`.
"""

from __future__ import annotations

import json
import logging
import secrets
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import HTMLResponse, JSONResponse

from engine.api import MODEL_LOADED, EngineClient, ModelStatus
from server.agents import install as install_agents
from server.config import ServerConfig
from server.errors import APIError, install_error_handlers
from server.middleware import RequestContextMiddleware
from server.openai_api import SYSTEM_FINGERPRINT, AppState, app_state
from server.openai_api import router as openai_router
from server.prompts import ServedModel

log = logging.getLogger("mlxd.server")


MISSING_KEY = (
    "Missing API key: send it as 'Authorization: Bearer <key>' or as 'x-api-key: <key>'."
)
INVALID_KEY = "Invalid API key: the key sent is not this server's key."


def _key_problem(request: Request) -> str | None:
    """None when the request may pass (no server key, or the right one); else why not."""
    key = app_state(request).config.api_key
    if not key:
        return None
    auth = request.headers.get("authorization", "")
    given = (
        auth[7:].strip() if auth[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
    )
    if not given:
        return "missing"
    return None if secrets.compare_digest(given.encode(), key.encode()) else "invalid"


async def require_api_key(request: Request) -> None:
    """`Authorization: Bearer <key>` or `x-api-key: <key>` when the server has a key."""
    problem = _key_problem(request)
    if problem is None:
        return
    raise APIError(
        401,
        MISSING_KEY if problem == "missing" else INVALID_KEY,
        code="missing_api_key" if problem == "missing" else "invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def _json_safe(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def _model_card(model: ServedModel, status: ModelStatus | None = None,
                parent: str | None = None) -> dict[str, Any]:
    """A model's card in OpenAI's shape, plus `max_model_len`, `loaded` (its weights are in
    memory now; a request to an unloaded model loads it) and, for an adapter, `parent` (the
    base model it runs on)."""
    card: dict[str, Any] = {
        "id": model.name,
        "object": "model",
        "created": model.info.created,
        "owned_by": "mlxd",
        "root": model.info.model_id,
        "max_model_len": model.context_length,
        "loaded": status is not None and status.state == MODEL_LOADED,
    }
    if parent is not None:
        card["parent"] = parent
    return card


def _unopened_card(status: ModelStatus) -> dict[str, Any]:
    """The card of a configured model no request has used yet (its files are not read before)."""
    return {"id": status.name, "object": "model", "created": 0, "owned_by": "mlxd",
            "root": status.name, "loaded": status.state == MODEL_LOADED}


def _status_dict(status: ModelStatus) -> dict[str, Any]:
    out = {"state": status.state, "default": status.default,
           "weights_bytes": status.weights_bytes, "keep_alive": status.keep_alive}
    for key in ("progress", "load_seconds", "idle_seconds", "error"):
        value = getattr(status, key)
        if value is not None:
            out[key] = value
    return out


def _install_api_docs(app: FastAPI, auth: list[Any]) -> None:
    """/openapi.json, /docs (Swagger UI) and /redoc, under the same key as the API: with
    --api-key, fetch the schema with the key (`curl -H 'Authorization: Bearer KEY'
    .../openapi.json`); the two pages are for servers without a key (a browser cannot attach one
    to the schema request the page makes)."""

    @app.get("/openapi.json", include_in_schema=False, dependencies=auth)
    async def openapi_schema() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False, dependencies=auth)
    async def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="mlxd API")

    @app.get("/redoc", include_in_schema=False, dependencies=auth)
    async def redoc() -> HTMLResponse:
        return get_redoc_html(openapi_url="/openapi.json", title="mlxd API")


def _cards(st: AppState) -> list[dict[str, Any]]:
    """Every model a request may name: the default, its adapters, then the other configured
    models (with the details of those already opened)."""
    statuses = {s.name: s for s in st.client.list_models()}
    default = next((s for s in statuses.values() if s.default), None)
    router = st.models
    cards = []
    for name in router.names():
        if router.is_default(name):
            if name == st.model.name:
                cards.append(_model_card(st.model, default))
            else:
                cards.append(_model_card(router.adapter_view(name), default, st.model.name))
        else:
            opened = router.opened(name)
            status = statuses.get(name)
            if opened is not None:
                cards.append(_model_card(opened, status))
            elif status is not None:
                cards.append(_unopened_card(status))
    return cards


def app_state_of(app: FastAPI) -> AppState:
    return app.state.mlxd


def create_app(client: EngineClient, config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    model = ServedModel.from_info(client.model, config.model_alias)
    app = FastAPI(
        title="mlxd",
        version=SYSTEM_FINGERPRINT.removeprefix("mlxd-"),
        openapi_url=None,  # served by _install_api_docs, behind the key like the API
        docs_url=None,
        redoc_url=None,
    )
    app.state.mlxd = AppState(client=client, config=config, model=model)
    install_error_handlers(app)
    auth = [Depends(require_api_key)]
    app.include_router(openai_router, dependencies=auth)
    install_agents(app, auth)  # Anthropic, Responses, /metrics, /tokenize, chat page (server/agents.py)

    @app.get("/v1/models", dependencies=auth)
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": _cards(app_state_of(app))}

    @app.get("/v1/models/{model_id:path}", dependencies=auth)
    async def get_model(model_id: str) -> dict[str, Any]:
        for card in _cards(app_state_of(app)):
            if card["id"] == model_id:
                return card
        st = app_state_of(app)
        if model_id in st.model.aliases:  # the default model's other names (id, directory)
            return _cards(st)[0]
        raise APIError(
            404,
            f"The model '{model_id}' does not exist.",
            param="model",
            code="model_not_found",
        )

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        """`{"status": "ok"}` for anyone (a liveness/readiness probe needs no key); the details
        (engine statistics, memory, device, BLAS, versions) only where the caller may use the
        API: always without --api-key, with the key otherwise."""
        try:
            stats = client.stats().as_dict()
            status = "ok"
        except Exception as exc:  # report, don't fail the probe's JSON
            log.exception("engine stats failed")
            stats, status = {"error": f"{type(exc).__name__}: {exc}"}, "degraded"
        if _key_problem(request) is not None:
            return JSONResponse({"status": status})
        return JSONResponse(
            _json_safe(
                {
                    "status": status,
                    "model": model.name,
                    "model_id": model.info.model_id,
                    "models": {m.name: _status_dict(m) for m in client.list_models()},
                    "context_length": model.context_length,
                    "version": SYSTEM_FINGERPRINT,
                    "engine": stats,
                    "model_extra": model.info.extra,
                }
            )
        )

    _install_api_docs(app, auth)
    app.add_middleware(RequestContextMiddleware, max_body_bytes=config.max_request_bytes)
    if config.allowed_origins:  # outermost, so errors (even 413/500) carry CORS headers too
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.allowed_origins),
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["X-Request-ID", "Retry-After"],
        )
    return app
