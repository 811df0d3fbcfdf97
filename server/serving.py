"""The uvicorn settings `mlxd serve` runs with: `uvicorn_config(app, host=..., port=...)`.

- HTTP/1.1 through h11 (chosen explicitly, not uvicorn's "auto", which picks httptools when it is
  installed: httptools has no limit on the request head, so a client could send a header of any
  size and the server would hold all of it in memory). h11 buffers at most `max_header_bytes` of
  an unfinished request line + headers; a larger head gets 431 with an OpenAI-shaped JSON body and
  the connection is closed. The request body is not counted: it streams through in chunks and
  `RequestContextMiddleware` limits it (413).
- The listening socket is bound first (`listen_socket`), before the model loads, so a port in use
  is reported at once.
- No uvicorn access log: `ObservabilityMiddleware` writes one access line per request (with its
  request id).
"""

from __future__ import annotations

import json
import logging
import socket
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from server.errors import headers_too_large
from server.middleware import MAX_HEADER_BYTES

log = logging.getLogger("mlxd.server")
access_log = logging.getLogger("mlxd.access")

# After a 431 the rest of the oversized head is read and dropped (bounded) before the socket is
# closed: closing with unread data makes the kernel send a reset, and the client would then see
# "connection reset" instead of the 431.
DRAIN_BYTES = 4 * 1024 * 1024
DRAIN_SECONDS = 2.0


class HeadLimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, answering a request head over the limit with 431 + JSON."""

    _refused = False
    _dropped = 0

    def data_received(self, data: bytes) -> None:
        if self._refused:
            self._dropped += len(data)
            if self._dropped > DRAIN_BYTES:
                self.transport.close()
            return
        super().data_received(data)

    def send_400_response(self, msg: str) -> None:
        limit = self.config.h11_max_incomplete_event_size or MAX_HEADER_BYTES
        if len(self.conn.trailing_data[0]) <= limit:
            super().send_400_response(msg)  # some other malformed request: uvicorn's own 400
            return
        self._refused = True
        body = json.dumps(headers_too_large(limit).body()).encode()
        head = (
            b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
            b"content-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n"
            b"connection: close\r\n\r\n"
        )
        self.transport.write(head + body)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(DRAIN_SECONDS, self.transport.close)
        who = f"{self.client[0]}:{self.client[1]}" if self.client else "-"
        access_log.info('%s "-" 431 request line and headers over %d bytes', who, limit)


def uvicorn_config(
    app: Any,
    *,
    host: str,
    port: int,
    log_level: str = "info",
    max_header_bytes: int = MAX_HEADER_BYTES,
    **extra: Any,
) -> uvicorn.Config:
    """The uvicorn configuration of `mlxd serve` (tests build their servers with it too)."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level.lower(),
        http=HeadLimitedH11Protocol,
        h11_max_incomplete_event_size=max_header_bytes,
        access_log=False,
        timeout_graceful_shutdown=5,
        **extra,
    )


class Server(uvicorn.Server):
    """uvicorn's server, saying where it listens once it does (uvicorn is silent about that
    when it is handed a bound socket)."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and sockets:
            host, port = sockets[0].getsockname()[:2]
            shown = f"[{host}]" if ":" in host else host
            log.info("serving on http://%s:%d (Ctrl-C stops)", shown, port)


def listen_socket(host: str, port: int) -> socket.socket:
    """A bound TCP socket for uvicorn (`Server.run(sockets=[...])`); OSError when it cannot be."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock
