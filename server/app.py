"""`create_app(client, config)`: the FastAPI app in front of any `engine.api.EngineClient`.

    from server.app import create_app
    from server.config import ServerConfig
    app = create_app(client, ServerConfig(port=8080, allowed_origins=["*"]))
    uvicorn.run(app, host=..., port=...)

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /v1/models/{id},
GET /health. The app's shared state is `app.state.mlxd` (`server.openai_api.AppState`); later
routers (Anthropic, Responses) include themselves with `app.include_router(router,
dependencies=[Depends(require_api_key)])` and reuse `server.generation`.
"""

from __future__ import annotations

import json
import logging
import secrets
from typing import Any

from fastapi import Depends, FastAPI, Request
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse

from engine.api import EngineClient
from server.agents import install as install_agents
from server.config import ServerConfig
from server.errors import APIError, install_error_handlers
from server.middleware import RequestContextMiddleware
from server.openai_api import SYSTEM_FINGERPRINT, AppState, app_state
from server.openai_api import router as openai_router
from server.prompts import ServedModel

log = logging.getLogger("mlxd.server")


async def require_api_key(request: Request) -> None:
    """`Authorization: Bearer <key>` or `x-api-key: <key>` when the server has a key."""
    key = app_state(request).config.api_key
    if not key:
        return
    auth = request.headers.get("authorization", "")
    given = (
        auth[7:].strip() if auth[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
    )
    if not given or not secrets.compare_digest(given.encode(), key.encode()):
        raise APIError(
            401,
            "Incorrect API key provided.",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )


def _json_safe(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def _model_card(model: ServedModel) -> dict[str, Any]:
    return {
        "id": model.name,
        "object": "model",
        "created": model.info.created,
        "owned_by": "mlxd",
        "root": model.info.model_id,
        "max_model_len": model.context_length,
    }


def create_app(client: EngineClient, config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    model = ServedModel.from_info(client.model, config.model_alias)
    app = FastAPI(title="mlxd", version=SYSTEM_FINGERPRINT.removeprefix("mlxd-"))
    app.state.mlxd = AppState(client=client, config=config, model=model)
    install_error_handlers(app)
    auth = [Depends(require_api_key)]
    app.include_router(openai_router, dependencies=auth)
    install_agents(app, auth)  # Anthropic, Responses, /metrics, /tokenize, chat page (server/agents.py)

    @app.get("/v1/models", dependencies=auth)
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(model)]}

    @app.get("/v1/models/{model_id:path}", dependencies=auth)
    async def get_model(model_id: str) -> dict[str, Any]:
        if model_id not in model.aliases:
            raise APIError(
                404,
                f"The model '{model_id}' does not exist.",
                param="model",
                code="model_not_found",
            )
        return _model_card(model)

    @app.get("/health")
    async def health() -> JSONResponse:
        try:
            stats = client.stats().as_dict()
            status = "ok"
        except Exception as exc:  # report, don't fail the probe's JSON
            log.exception("engine stats failed")
            stats, status = {"error": f"{type(exc).__name__}: {exc}"}, "degraded"
        return JSONResponse(
            _json_safe(
                {
                    "status": status,
                    "model": model.name,
                    "model_id": model.info.model_id,
                    "context_length": model.context_length,
                    "version": SYSTEM_FINGERPRINT,
                    "engine": stats,
                    "model_extra": model.info.extra,
                }
            )
        )

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
