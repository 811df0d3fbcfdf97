"""The agent-facing routes and the app-wide plumbing, installed by `create_app` with one call:

    install(app, auth)   # auth: the key-check dependencies of the protected routes

Routes: POST /v1/messages, /v1/messages/count_tokens (Anthropic); POST /v1/responses, GET/DELETE
/v1/responses/{id}, POST /v1/responses/{id}/cancel; POST /tokenize, /detokenize; GET /metrics;
POST /v1/embeddings (server/embeddings.py);
GET / and /static/* (the chat page, public). Also: the engine client is wrapped for Prometheus
metrics, log records get request ids, and each HTTP request is counted and logged with its id.
Tools and structured output on /v1/chat/completions live in server/agent_chat.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI

from server import anthropic_api, embeddings, ops, responses_api, ui
from server.metrics import (
    InstrumentedClient,
    Metrics,
    ObservabilityMiddleware,
    install_log_request_ids,
)


def install(app: FastAPI, auth: Sequence[Any]) -> None:
    st = app.state.mlxd
    metrics = Metrics(st.client)
    app.state.metrics = metrics
    st.client = InstrumentedClient(st.client, metrics)
    install_log_request_ids()
    app.include_router(anthropic_api.router, dependencies=list(auth))
    app.include_router(responses_api.router, dependencies=list(auth))
    app.include_router(ops.router, dependencies=list(auth))
    app.include_router(embeddings.router, dependencies=list(auth))  # POST /v1/embeddings
    app.include_router(ui.router)
    app.mount("/static", ui.static_files(), name="static")
    # inside RequestContextMiddleware (added later, so outer): it sees the request id
    app.add_middleware(ObservabilityMiddleware, metrics=metrics)
