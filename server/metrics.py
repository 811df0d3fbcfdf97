"""Prometheus metrics (prometheus-client) and request-scoped logging.

`Metrics` owns a registry per app. Request-level numbers come from `InstrumentedClient`, a thin
`EngineClient` wrapper every endpoint goes through (so every endpoint is measured the same way,
with no code in the endpoints); engine-level numbers are read from `client.stats()` at scrape time.

    mlxd_requests_total{finish_reason}                  engine requests finished
    mlxd_prompt_tokens_total, mlxd_generation_tokens_total
    mlxd_time_to_first_token_seconds                    histogram: submit → first token
    mlxd_inter_token_latency_seconds                    histogram: between tokens of a request
    mlxd_e2e_request_latency_seconds                    histogram: submit → finish
    mlxd_request_preprocess_seconds                     histogram: HTTP request in → submit
                                                        (body, chat template, tokenizing)
    mlxd_request_queue_seconds                          histogram: admitted → prefill starts
    mlxd_request_prefill_seconds                        histogram: prefill starts → first token
                                                        (TTFT ≈ the three, plus the stream's
                                                        hand-over)
    mlxd_http_requests_total{method, route, status}
    mlxd_num_requests_running / _waiting / _prefilling  gauges (engine)
    mlxd_kv_cache_bytes{layout}, mlxd_prefix_cache_bytes, mlxd_prefix_cache_hits_total,
    mlxd_prefix_cache_queries_total, mlxd_engine_steps_total
    mlxd_memory_bytes{owner}                            rss, MLX arrays / buffer cache / its limit,
                                                        malloc in use / free (engine.host_memory)
    mlxd_spec_decode_<key>                              every number in stats.spec (when present),
    mlxd_spec_decode_acceptance_rate                    accepted / draft tokens

Every log record carries `request_id` (the X-Request-ID of the HTTP request it belongs to, "-"
outside one); use `%(request_id)s` in a log format.
"""

from __future__ import annotations

import contextvars
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.api import FINISH_ABORT, Request, TokenEvent

log = logging.getLogger("mlxd.server")
access_log = logging.getLogger("mlxd.access")
request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("mlxd_request_id", default="-")
# perf_counter when the HTTP request being served came in (None outside one)
request_start_var: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "mlxd_request_start", default=None)

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)
# queue waits and prefills: milliseconds for a short prompt, a minute behind a long queue
_WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self, client: Any):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("mlxd_requests", "Engine requests finished, by finish reason",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("mlxd_prompt_tokens", "Prompt tokens submitted", registry=r)
        self.generation_tokens = Counter("mlxd_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("mlxd_time_to_first_token_seconds", "Submit to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("mlxd_inter_token_latency_seconds", "Time between tokens of a request",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("mlxd_e2e_request_latency_seconds", "Submit to finish",
                             buckets=_E2E_BUCKETS, registry=r)
        self.preprocess = Histogram("mlxd_request_preprocess_seconds",
                                    "HTTP request received to submitted to the engine",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("mlxd_request_queue_seconds",
                               "Admitted by the engine to its prefill starting",
                               buckets=_WAIT_BUCKETS, registry=r)
        self.prefill = Histogram("mlxd_request_prefill_seconds",
                                 "Prefill start to the first token", buckets=_WAIT_BUCKETS,
                                 registry=r)
        self.http = Counter("mlxd_http_requests", "HTTP requests by route and status",
                            ["method", "route", "status"], registry=r)
        r.register(_EngineCollector(client))


class _EngineCollector:
    """Engine figures read from `client.stats()` at scrape time (engine.api.EngineStats)."""

    def __init__(self, client: Any):
        self.client = client

    def collect(self) -> Any:
        try:
            s = self.client.stats()
        except Exception:  # a scrape must not fail because stats did
            log.exception("engine stats failed")
            return
        prefix = s.prefix_cache
        for name, value, doc in (
            ("mlxd_num_requests_running", s.num_running, "Requests decoding"),
            ("mlxd_num_requests_waiting", s.num_waiting, "Requests waiting for admission"),
            ("mlxd_num_requests_prefilling", s.num_prefilling, "Requests being prefilled"),
            ("mlxd_prefix_cache_bytes", prefix.bytes if prefix else 0, "Bytes held by the prefix cache"),
        ):
            yield GaugeMetricFamily(name, doc, value=float(value))
        kv = GaugeMetricFamily("mlxd_kv_cache_bytes", "KV cache bytes in use, by layout", labels=["layout"])
        for layout, n in sorted(s.kv_bytes_by_layout.items()):
            kv.add_metric([str(layout)], float(n))
        if not s.kv_bytes_by_layout:
            kv.add_metric(["all"], float(s.kv_bytes))
        yield kv
        yield _memory_family(s.memory)
        yield CounterMetricFamily("mlxd_engine_steps", "Engine steps", value=float(s.num_steps))
        if prefix is not None:
            yield from _prefix_families(prefix)
        if s.spec is not None:
            yield from _spec_families(s.spec)


_MEMORY_OWNERS = ("rss", "mlx_active", "mlx_cache", "mlx_peak", "mlx_cache_limit", "malloc_in_use",
                  "malloc_free", "malloc_mmapped", "budget_bytes", "weights_bytes")


def _memory_family(mem: Any) -> GaugeMetricFamily:
    g = GaugeMetricFamily("mlxd_memory_bytes", "Process memory by owner (rss, mlx_active, "
                          "mlx_cache, mlx_cache_limit, malloc_in_use, malloc_free, ...)",
                          labels=["owner"])
    for owner in _MEMORY_OWNERS:
        g.add_metric([owner.removesuffix("_bytes")], float(getattr(mem, owner)))
    return g


def _prefix_families(p: Any) -> Any:
    for name, value, doc in (
        ("mlxd_prefix_cache_hits", p.hits, "Prefix cache hits"),
        ("mlxd_prefix_cache_queries", p.queries, "Prefix cache lookups"),
        ("mlxd_prefix_cache_hit_tokens", p.hit_tokens, "Prompt tokens served from the prefix cache"),
        ("mlxd_prefix_cache_evicted_blocks", p.evicted_blocks, "Prefix cache blocks evicted"),
    ):
        yield CounterMetricFamily(name, doc, value=float(value))
    yield GaugeMetricFamily("mlxd_prefix_cache_max_bytes", "Prefix cache budget", value=float(p.max_bytes))
    yield GaugeMetricFamily("mlxd_prefix_cache_blocks", "Prefix cache blocks held", value=float(p.blocks))


_SPEC_DOCS = {
    "num_draft_tokens": "Ceiling of the adaptive draft length",
    "spec_steps": "Engine steps that verified drafts",
    "plain_steps": "Engine steps that decoded one token per row",
    "drafted_tokens": "Draft tokens proposed",
    "accepted_tokens": "Draft tokens accepted",
    "acceptance_rate": "Accepted / drafted tokens",
    "mean_verify_width": "Columns per verify forward",
    "tokens_per_row_round": "Tokens a row gained per round it drafted in",
    "expected_tokens_per_round": "The controller's estimate of tokens_per_row_round at the ceiling",
    "overhead_ms_per_spec_step": "Drafter milliseconds outside the measured steps, per step",
    "switch_ms_per_spec_step": "Milliseconds that switching modes costs, per speculative step",
    "explore_ms": "Milliseconds spent trying widths that did not pay",
}


def _spec_families(spec: Any) -> Any:
    """`mlxd_spec_decode_<figure>{method}` for the speculation's figures (a figure not known
    yet, such as the acceptance rate before any draft, is left out), and
    `mlxd_spec_decode_drafter_<figure>{method}` for the drafter's own."""
    for key, doc in _SPEC_DOCS.items():
        value = getattr(spec, key)
        if value is not None:
            g = GaugeMetricFamily(f"mlxd_spec_decode_{key}", f"Speculative decoding: {doc}",
                                  labels=["method"])
            g.add_metric([spec.method], float(value))
            yield g
    if spec.acceptance_by_position:
        g = GaugeMetricFamily("mlxd_spec_decode_acceptance_by_position", "Speculative decoding: "
                              "the controller's acceptance estimate of a draft at this position "
                              "of its round, given the earlier ones accepted",
                              labels=["method", "position"])
        for j, value in enumerate(spec.acceptance_by_position, start=1):
            g.add_metric([spec.method, str(j)], float(value))
        yield g
    for key, value in sorted(spec.drafter.items()):
        safe = "".join(c if c.isalnum() else "_" for c in key)
        g = GaugeMetricFamily(f"mlxd_spec_decode_drafter_{safe}", f"Speculative decoding, the "
                              f"drafter's {key}", labels=["method"])
        g.add_metric([spec.method], float(value))
        yield g


class InstrumentedClient:
    """An EngineClient that measures every request passing through it."""

    def __init__(self, inner: Any, metrics: Metrics):
        self.inner = inner
        self.metrics = metrics
        self.model = inner.model

    async def submit(self, request: Request) -> AsyncIterator[TokenEvent]:
        t0 = time.perf_counter()
        start = request_start_var.get()
        if start is not None:
            self.metrics.preprocess.observe(max(0.0, t0 - start))
        stream = await self.inner.submit(request)
        self.metrics.prompt_tokens.inc(len(request.prompt_ids))
        return self._watch(stream, t0)

    async def _watch(self, stream: AsyncIterator[TokenEvent], t0: float) -> AsyncIterator[TokenEvent]:
        m = self.metrics
        last: float | None = None
        finish: str | None = None
        try:
            async for ev in stream:
                n = len(ev.token_ids)
                if n:
                    now = time.perf_counter()
                    if last is None:
                        m.ttft.observe(now - t0)
                        if ev.queue_s is not None:
                            m.queue.observe(ev.queue_s)
                        if ev.prefill_s is not None:
                            m.prefill.observe(ev.prefill_s)
                    else:
                        for _ in range(n):
                            m.itl.observe((now - last) / n)
                    last = now
                    m.generation_tokens.inc(n)
                if ev.finish_reason is not None:
                    finish = ev.finish_reason
                yield ev
        finally:
            m.requests.labels(finish or FINISH_ABORT).inc()
            m.e2e.observe(time.perf_counter() - t0)
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()  # closing an unfinished stream aborts the row

    def abort(self, req_id: str) -> None:
        self.inner.abort(req_id)

    def stats(self) -> Any:
        return self.inner.stats()

    def __getattr__(self, name: str) -> Any:  # start/stop and anything else of the real client
        return getattr(self.inner, name)


QUIET_PATHS = frozenset({"/health", "/metrics"})  # probes and scrapes: access lines at DEBUG
STATUS_CLIENT_LEFT = 499  # nginx's "client closed request": not a server error


class ObservabilityMiddleware:
    """Per HTTP request: the request id in a context variable (for log records), the
    mlxd_http_requests_total counter, and one access line with the id (`mlxd.access`):

        127.0.0.1:50312 "POST /v1/chat/completions" 200 41.3ms

    A client that leaves before its request body is complete is counted and logged as 499.
    Successful /health and /metrics requests are logged at DEBUG, so scrapes do not fill the log.
    """

    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = (scope.get("state") or {}).get("request_id", "-")
        token = request_id_var.set(rid)
        status = 500
        note = ""
        t0 = time.perf_counter()
        start_token = request_start_var.set(t0)

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        except ClientDisconnect:
            status, note = STATUS_CLIENT_LEFT, " (client left before sending the whole body)"
            raise
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            # the access line first: a request that is counted has its line written
            _log_access(scope, status, (time.perf_counter() - t0) * 1e3, note)
            self.metrics.http.labels(scope.get("method", ""), path, str(status)).inc()
            request_id_var.reset(token)
            request_start_var.reset(start_token)


def _log_access(scope: Scope, status: int, ms: float, note: str) -> None:
    path = scope.get("path", "")
    level = logging.DEBUG if path in QUIET_PATHS and status < 400 else logging.INFO
    if not access_log.isEnabledFor(level):
        return
    client = scope.get("client")
    who = f"{client[0]}:{client[1]}" if client else "-"
    access_log.log(level, '%s "%s %s" %d %.1fms%s', who, scope.get("method"), path, status, ms, note)


_factory_installed = False


def install_log_request_ids() -> None:
    """Give every log record a `request_id` attribute (idempotent)."""
    global _factory_installed
    if _factory_installed:
        return
    previous = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        record.request_id = request_id_var.get()
        return record

    logging.setLogRecordFactory(factory)
    _factory_installed = True
