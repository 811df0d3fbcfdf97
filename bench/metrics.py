"""Per-request records and the numbers a benchmark level reports (pure Python, no I/O).

Definitions (the same for every server, so that ratios compare like with like):

- TTFT: request sent → first SSE chunk that carries generated text.
- ITL (inter-token latency): the gap between consecutive content chunks, divided by the number
  of tokens the later chunk carried (a chunk carrying k tokens contributes k equal gaps), so
  that a server that batches tokens into chunks is not rewarded for it.
- TPOT: (end-to-end − TTFT) / (output tokens − 1) per request.
- Aggregate output tok/s: total output tokens of completed requests / wall time of the level
  (first request sent → last response finished).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it. Times are seconds on the client's monotonic clock."""

    start: float
    end: float = 0.0
    ttft: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # arrival of each content chunk
    chunk_tokens: list[int] = field(default_factory=list)  # tokens carried by each chunk
    output_tokens: int = 0  # from usage when the server reports it, else counted chunks
    prompt_tokens: int | None = None  # from usage
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, if reported
    ok: bool = False
    error: str | None = None  # short kind, e.g. "http_429", "connection_reset", "timeout"
    status: int | None = None
    finish_reason: str | None = None

    @property
    def e2e(self) -> float:
        return self.end - self.start

    def itl_gaps(self) -> list[float]:
        """Per-token gaps between content chunks (see module docstring)."""
        gaps: list[float] = []
        for i in range(1, len(self.chunk_times)):
            k = max(1, self.chunk_tokens[i] if i < len(self.chunk_tokens) else 1)
            gap = (self.chunk_times[i] - self.chunk_times[i - 1]) / k
            gaps.extend([gap] * k)
        return gaps

    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default method); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    if len(xs) == 1:
        return float(xs[0])
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    frac = pos - lo
    return float(xs[lo] + (xs[hi] - xs[lo]) * frac)


def _dist(values: Sequence[float], qs: Sequence[int] = (50, 90, 99)) -> dict[str, float | None]:
    out: dict[str, float | None] = {f"p{q}": percentile(values, q) for q in qs}
    out["mean"] = (sum(values) / len(values)) if values else None
    return out


def summarize(records: Sequence[RequestRecord], wall_s: float) -> dict[str, Any]:
    """The numbers one concurrency level reports."""
    done = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    gaps = [g for r in done for g in r.itl_gaps()]
    tpots = [t for r in done if (t := r.tpot()) is not None]
    ttfts = [r.ttft for r in done if r.ttft is not None]
    prompt_tokens = [r.prompt_tokens for r in done if r.prompt_tokens is not None]
    wall = max(wall_s, 1e-9)
    return {
        "num_requests": len(records),
        "num_completed": len(done),
        "num_failed": len(failed),
        "failures": dict(Counter(r.error or "unknown" for r in failed)),
        "wall_s": wall_s,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / wall,
        "request_per_s": len(done) / wall,
        "output_tokens_per_request": _dist([r.output_tokens for r in done], (50,)) | {
            "min": min((r.output_tokens for r in done), default=None),
            "max": max((r.output_tokens for r in done), default=None),
        },
        "prompt_tokens_per_request": {
            "min": min(prompt_tokens, default=None),
            "max": max(prompt_tokens, default=None),
        },
        "ttft_s": _dist(ttfts),
        "itl_s": _dist(gaps),
        "tpot_s": _dist(tpots),
        "e2e_s": _dist([r.e2e for r in done]),
        "finish_reasons": dict(Counter(r.finish_reason or "none" for r in done)),
    }


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is zero."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def level_ratios(mine: dict[str, Any], peer: dict[str, Any]) -> dict[str, float | None]:
    """mlxd / peer for throughput (higher is better) and latencies (lower is better)."""
    return {
        "output_tok_s": ratio(mine["output_tok_s"], peer["output_tok_s"]),
        "ttft_p50": ratio(mine["ttft_s"]["p50"], peer["ttft_s"]["p50"]),
        "ttft_p99": ratio(mine["ttft_s"]["p99"], peer["ttft_s"]["p99"]),
        "itl_p50": ratio(mine["itl_s"]["p50"], peer["itl_s"]["p50"]),
        "itl_p99": ratio(mine["itl_s"]["p99"], peer["itl_s"]["p99"]),
    }


def record_dict(r: RequestRecord) -> dict[str, Any]:
    """A compact JSON form of one record (chunk times relative to the request start)."""
    d = asdict(r)
    d["chunk_times"] = [round(t - r.start, 5) for t in r.chunk_times]
    return d
