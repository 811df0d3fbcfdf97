"""Calibration inputs for BlockLDLQ: token windows from a jsonl file, and per-layer E[x x^T].

Records are ``{"text": ...}`` (code) or ``{"messages": [...]}`` (chat; a list, or its Python
repr as in tinycoder-dev.jsonl), rendered with the tokenizer's chat template. The stream is the
records' tokens joined by the tokenizer's end-of-text id.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten


def read_records(path: Path | str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def record_tokens(tokenizer: Any, record: dict[str, Any]) -> list[int]:
    if "messages" in record:
        messages = record["messages"]
        if isinstance(messages, str):
            messages = ast.literal_eval(messages)
        return list(tokenizer.apply_chat_template(messages, tokenize=True))
    return list(tokenizer.encode(record["text"]))


def token_stream(tokenizer: Any, records: Iterable[dict[str, Any]], separator: int = 0) -> list[int]:
    stream: list[int] = []
    for rec in records:
        stream.extend(record_tokens(tokenizer, rec))
        stream.append(separator)
    return stream


def even_windows(stream: Sequence[int], num: int, length: int) -> mx.array:
    """``num`` windows of ``length`` tokens at evenly spaced starts over the stream."""
    if len(stream) < length:
        raise ValueError(f"stream of {len(stream)} tokens is shorter than one window ({length})")
    last = len(stream) - length
    starts = [round(i * last / max(1, num - 1)) for i in range(num)] if num > 1 else [0]
    return mx.array([list(stream[s : s + length]) for s in starts], dtype=mx.int32)


class _HessianTap(nn.Module):
    """Wraps a Linear: accumulates sum x x^T (float32) of its inputs, then calls it."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        n = int(inner.weight.shape[1]) if "weight" in inner else int(inner.input_dims)  # Linear or TrellisLinear
        object.__setattr__(self, "acc", [mx.zeros((n, n), dtype=mx.float32), 0])

    def __call__(self, x: mx.array) -> mx.array:
        x2 = x.reshape(-1, x.shape[-1]).astype(mx.float32)
        self.acc[0] = self.acc[0] + x2.T @ x2
        self.acc[1] += x2.shape[0]
        return self.inner(x)


def collect_hessians(model: nn.Module, windows: mx.array, paths: Sequence[str]) -> dict[str, mx.array]:
    """E[x x^T] of the inputs of the Linear layers at ``paths``, over the token ``windows``."""
    modules = dict(model.named_modules())
    taps = {p: _HessianTap(modules[p]) for p in paths}
    model.update_modules(tree_unflatten(list(taps.items())))
    try:
        for i in range(windows.shape[0]):
            model(windows[i : i + 1])
            mx.eval([t.acc[0] for t in taps.values()])
    finally:
        model.update_modules(tree_unflatten([(p, t.inner) for p, t in taps.items()]))
    return {p: t.acc[0] / max(1, t.acc[1]) for p, t in taps.items()}


def _text(record: dict[str, Any]) -> str:
    return str(record["messages"]) if "messages" in record else str(record.get("text", ""))


def disjoint_records(
    records: Sequence[dict[str, Any]], held_out: Sequence[dict[str, Any]], k: int = 128
) -> list[dict[str, Any]]:
    """``records`` minus any that shares a k-character substring with a ``held_out`` record.

    For calibration data that must not overlap the evaluation text: a data file can hold the same
    record (or the same licence header, the same function) more than once.
    """
    seen: set[int] = set()
    for rec in held_out:
        t = _text(rec)
        seen.update(hash(t[i : i + k]) for i in range(max(1, len(t) - k + 1)))
    keep = []
    for rec in records:
        t = _text(rec)
        if not any(hash(t[i : i + k]) in seen for i in range(0, max(1, len(t) - k + 1), max(1, k // 4))):
            keep.append(rec)
    return keep
