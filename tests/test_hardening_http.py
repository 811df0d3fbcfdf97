"""Hostile and careless HTTP clients against the server as `mlxd serve` runs it (the uvicorn
settings of `server.serving.uvicorn_config`, over real sockets), on the fake engine:

- a request head over the limit gets 431 + JSON at once, without the server buffering it;
- with --api-key, /health tells anonymous callers only whether it is up, the API docs need the
  key, and a missing key and a wrong key get different messages;
- a client that leaves mid-body is a 499 in the access log and the metrics, not a 500;
- the 404 names every route family.
"""

from __future__ import annotations

import json
import logging
import select
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.routing import Mount, Route

from server.app import create_app
from server.config import ServerConfig
from server.errors import ROUTE_FAMILIES
from server.middleware import MAX_HEADER_BYTES
from server.serving import uvicorn_config
from tests.fake_engine import FakeEngine

KEY = "sk-test-key"


class LiveServer:
    """uvicorn with mlxd serve's settings on a free loopback port, in a thread."""

    def __init__(self, app: Any):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        # log_config=None: leave the test process's logging alone (the HTTP settings are the same)
        config = uvicorn_config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                log_config=None, lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(5)
        self.sock.close()


@pytest.fixture(scope="module")
def fake() -> FakeEngine:
    return FakeEngine()


@pytest.fixture(scope="module")
def open_server(fake: FakeEngine) -> Iterator[LiveServer]:
    with LiveServer(create_app(fake, ServerConfig())) as s:
        yield s


@pytest.fixture(scope="module")
def keyed_server(fake: FakeEngine) -> Iterator[LiveServer]:
    with LiveServer(create_app(fake, ServerConfig(api_key=KEY))) as s:
        yield s


@pytest.fixture(autouse=True)
def _fresh(fake: FakeEngine) -> None:
    fake.reset()


def _send_big_head(port: int, header_bytes: int) -> tuple[int, bytes]:
    """Send a GET whose one header is `header_bytes` long, 64 KiB at a time, stopping as soon
    as the server answers; return (bytes sent, the response)."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(10)
    sent = 0
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
        chunk = b"a" * 65536
        while sent < header_bytes and not select.select([sock], [], [], 0)[0]:
            sock.sendall(chunk)
            sent += len(chunk)
    except OSError:  # the server closed after answering: fine, read what it sent
        pass
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except OSError:
        pass
    sock.close()
    return sent, data


def _status_and_json(raw: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)


# -- 1. request-head size ---------------------------------------------------------------------


@pytest.mark.parametrize("size", [1 << 20, 64 << 20])
def test_oversized_header_is_431_at_once(open_server, size):
    t0 = time.monotonic()
    sent, raw = _send_big_head(open_server.port, size)
    status, body = _status_and_json(raw)
    assert status == 431, raw[:200]
    assert body["error"]["code"] == "request_header_fields_too_large"
    assert str(MAX_HEADER_BYTES) in body["error"]["message"]
    # answered while the client was still sending: the server did not wait for (or keep) the rest
    assert sent < 8 << 20 and time.monotonic() - t0 < 5
    assert httpx.get(open_server.url + "/health").status_code == 200  # and it keeps serving


@pytest.mark.parametrize("size", [MAX_HEADER_BYTES + 1000, 200_000, 1 << 20])
def test_oversized_header_from_an_ordinary_client(open_server, size):
    # a head that arrives in one read is complete before the HTTP server can count it: the app
    # refuses it; a longer one the HTTP server refuses while it arrives; the client sees 431 both
    r = httpx.get(open_server.url + "/health", headers={"X-Big": "a" * size}, timeout=10)
    assert r.status_code == 431 and r.headers["content-type"] == "application/json"
    assert r.json()["error"]["code"] == "request_header_fields_too_large"


def test_headers_under_the_limit_pass(open_server):
    r = httpx.get(open_server.url + "/health", headers={"X-Big": "a" * (MAX_HEADER_BYTES // 2)})
    assert r.status_code == 200


# -- 5. /health and the API docs with --api-key -------------------------------------------------


def test_public_health_says_only_status(keyed_server):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.get(keyed_server.url + "/health", headers=headers)
        assert r.status_code == 200 and r.json() == {"status": "ok"}, r.text
        assert "blas" not in r.text and "engine" not in r.text


def test_health_details_with_the_key(keyed_server):
    for headers in ({"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}):
        body = httpx.get(keyed_server.url + "/health", headers=headers).json()
        assert body["status"] == "ok" and body["engine"]["num_running"] == 0
        assert body["model_extra"]["device"] == "fake"


def test_health_details_without_a_server_key(open_server):
    body = httpx.get(open_server.url + "/health").json()
    assert body["status"] == "ok" and "engine" in body and "model_extra" in body


@pytest.mark.parametrize("path", ["/openapi.json", "/docs", "/redoc"])
def test_api_docs_need_the_key(keyed_server, open_server, path):
    assert httpx.get(keyed_server.url + path).status_code == 401
    assert httpx.get(keyed_server.url + path, headers={"x-api-key": "nope"}).status_code == 401
    ok = httpx.get(keyed_server.url + path, headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200
    assert httpx.get(open_server.url + path).status_code == 200
    if path == "/openapi.json":
        assert "/v1/chat/completions" in ok.json()["paths"]


# -- 19. missing vs wrong key ------------------------------------------------------------------


def test_missing_and_wrong_key_say_which(keyed_server):
    url = keyed_server.url + "/v1/models"
    missing = [httpx.get(url), httpx.get(url, headers={"Authorization": f"Basic {KEY}"})]
    wrong = [httpx.get(url, headers={"Authorization": "Bearer nope"}),
             httpx.get(url, headers={"x-api-key": "nope"})]
    for r in missing + wrong:
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["type"] == "authentication_error"
    for r in missing:
        err = r.json()["error"]
        assert err["code"] == "missing_api_key"
        assert "Missing API key" in err["message"] and "Authorization: Bearer" in err["message"]
        assert "x-api-key" in err["message"]
    for r in wrong:
        err = r.json()["error"]
        assert err["code"] == "invalid_api_key" and err["message"].startswith("Invalid API key")


# -- 19. the 404 lists every route family ---------------------------------------------------------


def _public_paths(app: Any) -> set[str]:
    paths = set()
    for route in app.routes:
        if isinstance(route, (Route, Mount)) and route.path not in ("", "/", "/static"):
            paths.add(route.path)
    return paths


def test_unknown_route_lists_every_family(open_server, fake):
    r = httpx.get(open_server.url + "/v1/nothing")
    assert r.status_code == 404
    message = r.json()["error"]["message"]
    assert "GET /v1/nothing" in message
    for family in ROUTE_FAMILIES:
        assert family in message, family
    app = create_app(fake, ServerConfig())
    for path in _public_paths(app):  # a route added later must be added to ROUTE_FAMILIES too
        assert any(path == f or path.startswith(f + "/") for f in ROUTE_FAMILIES), path


# -- 6. a client that leaves mid-body ------------------------------------------------------------


def _metric(url: str, status: str, route: str) -> float:
    text = httpx.get(url + "/metrics").text
    for line in text.splitlines():
        if line.startswith("mlxd_http_requests_total{") and f'status="{status}"' in line \
                and f'route="{route}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/messages"])
def test_client_leaving_mid_body_is_499_not_500(open_server, fake, caplog, path):
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="mlxd.access")  # whatever an earlier test configured
    before = _metric(open_server.url, "499", path)
    with socket.create_connection(("127.0.0.1", open_server.port)) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  "Content-Length: 1000\r\n\r\n".encode() + b'{"prompt": "ab')
    deadline = time.monotonic() + 5
    while _metric(open_server.url, "499", path) == before:
        assert time.monotonic() < deadline, "no 499 counted"
        time.sleep(0.05)
    assert _metric(open_server.url, "500", path) == 0
    mine = [r for r in caplog.records if path in r.getMessage() and r.name != "httpx"]
    access = [r for r in mine if r.name == "mlxd.access"]
    assert len(access) == 1 and " 499 " in access[0].getMessage(), [r.getMessage() for r in mine]
    assert access[0].levelno == logging.INFO
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert "Traceback" not in caplog.text and "ClientDisconnect" not in caplog.text
    assert not fake.submits
    assert httpx.post(open_server.url + "/v1/completions",
                      json={"prompt": "x", "max_tokens": 2}).status_code == 200


# -- 19. one access line per request; scrapes quiet at INFO -------------------------------------


def _wait_for_record(caplog, match, timeout: float = 10.0) -> None:
    """The server thread writes its access line after the response is sent: wait for it."""
    deadline = time.monotonic() + timeout
    while not any(match(r) for r in caplog.records):
        assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
        time.sleep(0.02)


def test_one_access_line_per_request_and_quiet_scrapes(open_server, caplog):
    caplog.set_level(logging.INFO)
    caplog.set_level(logging.INFO, logger="mlxd.access")
    r = httpx.post(open_server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                   headers={"X-Request-ID": "req-one-line"})
    assert r.status_code == 200
    httpx.get(open_server.url + "/metrics")
    httpx.get(open_server.url + "/health")
    _wait_for_record(caplog, lambda r: r.name == "mlxd.access" and "/v1/completions" in r.getMessage())
    # a scrape's line (if one were written at INFO) comes after the completion's
    httpx.post(open_server.url + "/v1/completions", json={"prompt": "y", "max_tokens": 1},
               headers={"X-Request-ID": "req-after"})
    _wait_for_record(caplog, lambda r: getattr(r, "request_id", "") == "req-after"
                     and r.name == "mlxd.access")
    server_side = [rec for rec in caplog.records if rec.name != "httpx"]  # not the client's log
    lines = [rec for rec in server_side if "/v1/completions" in rec.getMessage()]
    # one line per request (two requests), each mlxd's own with its request id
    assert [x.name for x in lines] == ["mlxd.access"] * 2, [x.getMessage() for x in lines]
    assert [x.request_id for x in lines] == ["req-one-line", "req-after"]
    assert " 200 " in lines[0].getMessage()
    scrapes = [rec for rec in server_side
               if rec.name.endswith("access") and ("/metrics" in rec.getMessage()
                                                   or "/health" in rec.getMessage())]
    assert not scrapes, [x.getMessage() for x in scrapes]


def test_failed_scrape_is_logged_at_info(keyed_server, caplog):
    caplog.set_level(logging.INFO)
    caplog.set_level(logging.INFO, logger="mlxd.access")
    assert httpx.get(keyed_server.url + "/metrics").status_code == 401
    _wait_for_record(caplog, lambda r: r.name == "mlxd.access" and "/metrics" in r.getMessage())
    assert [rec for rec in caplog.records if rec.name == "mlxd.access"
            and "/metrics" in rec.getMessage() and " 401 " in rec.getMessage()]
