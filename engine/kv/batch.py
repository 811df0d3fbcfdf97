"""Whole-model helpers: a model's cache is a list of per-layer layouts moved together.

rows   = make_batch_layouts(model, 1, ...)      # engine.models: one-row layouts for prefill
model(tokens, cache=rows)                       # prefill (chunks) alone, no padding
batch  = merge_rows(batch, [rows_a, rows_b])    # admit rows (None batch = start one)
model(next_tokens[:, None], cache=batch)        # decode step, every row at its own length
filter_rows(batch, keep)                        # drop finished rows
row    = extract_row(batch, i)                  # one row out (prefix cache, preemption)
checkpoint(batch); model(k+1 columns); rollback(batch, accepted)   # speculation
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from engine.kv.attention import KVLayout
from engine.kv.recurrent import RecurrentLayout

Layout = KVLayout | RecurrentLayout
Layouts = list[Any]


def empty_like(template: Layouts, num_rows: int = 0) -> Layouts:
    return [layer.empty_like(num_rows) for layer in template]


def merge_rows(batch: Layouts | None, rows: Sequence[Layouts]) -> Layouts:
    """Append each entry of `rows` (a per-layer list for one or more rows) to `batch`.

    Entries may be our layouts or mlx-lm single-row caches (converted on the way in). With
    `batch=None` the first entry's kinds define the batch.
    """
    if not rows:
        if batch is None:
            raise ValueError("nothing to merge")
        return batch
    if batch is None:
        first = rows[0]
        if not all(isinstance(c, KVLayout | RecurrentLayout) for c in first):
            raise ValueError("start a batch from our layouts (engine.models.make_batch_layouts)")
        batch = empty_like(first, 0)
    for li, layer in enumerate(batch):
        layer.merge([r[li] for r in rows])
    return batch


def extend(batch: Layouts | None, other: Layouts) -> Layouts:
    if batch is None:
        return other
    for a, b in zip(batch, other, strict=True):
        a.extend(b)
    return batch


def filter_rows(batch: Layouts, keep: Sequence[int]) -> None:
    for layer in batch:
        layer.filter(keep)


def extract_row(batch: Layouts, i: int) -> Layouts:
    return [layer.extract(i) for layer in batch]


def prepare(
    batch: Layouts,
    *,
    left_padding: Sequence[int] | None = None,
    lengths: Sequence[int] | None = None,
) -> None:
    for layer in batch:
        layer.prepare(left_padding=left_padding, lengths=lengths)


def finalize(batch: Layouts) -> None:
    for layer in batch:
        layer.finalize()


def checkpoint(batch: Layouts) -> None:
    for layer in batch:
        layer.checkpoint()


def rollback(batch: Layouts, accepted: Sequence[int] | np.ndarray | mx.array) -> None:
    acc = np.asarray(accepted, dtype=np.int64)
    for layer in batch:
        layer.rollback(acc)


def commit(batch: Layouts) -> None:
    for layer in batch:
        layer.commit()


def num_tokens(batch: Layouts) -> list[int]:
    return batch[0].num_tokens if batch else []


def bytes_by_layout(batch: Layouts | None) -> dict[str, int]:
    out: dict[str, int] = {}
    for layer in batch or []:
        out[layer.kind] = out.get(layer.kind, 0) + int(layer.nbytes)
    return out


def nbytes(batch: Layouts | None) -> int:
    return sum(int(layer.nbytes) for layer in batch or [])


def eval_state(batch: Layouts) -> None:
    mx.eval([layer.state for layer in batch])
