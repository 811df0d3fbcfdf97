"""Pure-ASGI middleware (no BaseHTTPMiddleware, so streaming and disconnects pass through intact):
request ids, the header- and body-size limits, and the last-resort JSON 500. A client that leaves before its
body is complete is not a server error: no 500, no traceback (the access line says 499)."""

from __future__ import annotations

import json
import logging
import re
import uuid

from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import APIError, error_body, headers_too_large

log = logging.getLogger("mlxd.server")

_SAFE_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
# Request line + headers. The HTTP server (server/serving.py) refuses a longer head while it
# arrives; a whole head that came in one read reaches the app and is refused here.
MAX_HEADER_BYTES = 64 * 1024


def _json_message(
    status: int, body: dict, request_id: str, extra: list | None = None
) -> tuple[Message, Message]:
    data = json.dumps(body).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(data)).encode()),
        (b"x-request-id", request_id.encode()),
        *(extra or []),
    ]
    return (
        {"type": "http.response.start", "status": status, "headers": headers},
        {"type": "http.response.body", "body": data, "more_body": False},
    )


class RequestContextMiddleware:
    """X-Request-ID in and out (request.state.request_id); a request head over the limit gets
    431 and a body over the limit 413; an exception nobody handled becomes an OpenAI-shaped 500
    and the server keeps serving."""

    def __init__(
        self,
        app: ASGIApp,
        max_body_bytes: int = 8 * 1024 * 1024,
        max_header_bytes: int = MAX_HEADER_BYTES,
    ):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_header_bytes = max_header_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"x-request-id", b"").decode("latin-1")
        request_id = given if _SAFE_ID.match(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        rid_header = (b"x-request-id", request_id.encode())
        if _head_bytes(scope) > self.max_header_bytes:
            await _refuse(receive, send, headers_too_large(self.max_header_bytes), request_id)
            return

        limit = self.max_body_bytes
        too_large = APIError(
            413, f"The request body is larger than {limit} bytes.", code="request_too_large"
        )
        try:
            declared = int(headers.get(b"content-length", b"0") or 0)
        except ValueError:
            declared = 0
        if declared > limit:
            await _refuse(receive, send, too_large, request_id, drain_bytes=8 * limit)
            return

        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise too_large
            return message

        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = dict(message)
                message["headers"] = [*message.get("headers", []), rid_header]
            await send(message)

        try:
            await self.app(scope, limited_receive, send_with_id)
        except ClientDisconnect:
            log.debug("client left before the request body was complete (id %s)", request_id)
        except Exception:
            log.exception(
                "request %s %s failed (id %s)", scope.get("method"), scope.get("path"), request_id
            )
            if not started:
                body = error_body(
                    "The server had an error while processing your request.",
                    "server_error",
                    None,
                    "internal_error",
                )
                try:
                    for msg in _json_message(500, body, request_id):
                        await send(msg)
                except Exception:
                    pass


def _head_bytes(scope: Scope) -> int:
    """Bytes of the request line and headers, as they came on the wire (about)."""
    line = len(scope.get("method", "")) + len(scope.get("raw_path") or b"") + len(
        scope.get("query_string") or b""
    ) + 12
    return line + sum(len(k) + len(v) + 4 for k, v in scope.get("headers") or [])


async def _refuse(
    receive: Receive, send: Send, err: APIError, request_id: str, drain_bytes: int = 1 << 20
) -> None:
    """Answer `err` and close. The body is read (and dropped) first, bounded: closing a socket
    with unread data makes the kernel send a reset, and async clients then never see the
    answer."""
    await _drain(receive, max_bytes=drain_bytes, max_seconds=10.0)
    for msg in _json_message(err.status, err.body(), request_id, [(b"connection", b"close")]):
        await send(msg)


async def _drain(receive: Receive, max_bytes: int, max_seconds: float) -> None:
    """Consume the request body up to `max_bytes` / `max_seconds`, discarding it."""
    import asyncio

    async def loop() -> None:
        seen = 0
        while seen <= max_bytes:
            message = await receive()
            if message["type"] != "http.request":
                return
            seen += len(message.get("body", b""))
            if not message.get("more_body", False):
                return

    try:
        await asyncio.wait_for(loop(), max_seconds)
    except Exception:  # TimeoutError, or the client left
        pass
