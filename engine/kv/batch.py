"""Whole-model helpers: a model's cache is a list of per-layer layouts moved together.

rows   = new_batch(model, 1, KVConfig(...))     # empty layouts (engine.models picks each kind)
model(tokens, cache=rows)                       # prefill (chunks) alone, no padding
batch  = merge_rows(batch, [rows_a, rows_b])    # admit rows (None batch = start one)
model(next_tokens[:, None], cache=batch)        # decode step, every row at its own length
filter_rows(batch, keep)                        # drop finished rows (their slots stay free)
row    = extract_row(batch, i)                  # one row out, copied (the draft model's rows)
checkpoint(batch); model(k+1 columns); rollback(batch, accepted)   # speculation

Rows are not aligned with each other: each keeps its own length, so admitting a short row next
to a long one costs no padding columns (docs/kv-layouts.md). Worked example: running rows A (300
tokens) and B (20 tokens) on a sliding-window layer of window 256 hold min(n, ring) columns
each; a new row C (7 tokens) is appended as a third row whose next RoPE position (`offset`) is 7
while A's is 300: one decode step then writes A's column (300 mod ring), B's column 20 and C's 7.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from engine.kv.attention import KVLayout, RowMove, apply_moves
from engine.kv.recurrent import RecurrentLayout

Layout = KVLayout | RecurrentLayout
Layouts = list[Any]


@dataclass(slots=True)
class KVConfig:
    kv_bits: int = 16  # 16 = model dtype; 8 / 4 = MLX affine quantized KV
    kv_group_size: int = 64
    max_kv_size: int | None = None  # cap full-attention layers to a ring of this many tokens


def new_batch(model: Any, num_rows: int, cfg: KVConfig | None = None) -> Layouts:
    """Empty layouts for `num_rows` rows (which layer gets which layout: engine.models)."""
    from engine.models import make_batch_layouts

    cfg = cfg or KVConfig()
    return make_batch_layouts(
        model, num_rows, kv_bits=cfg.kv_bits, kv_group_size=cfg.kv_group_size,
        max_kv_size=cfg.max_kv_size,
    )


class UnsupportedKV(ValueError):
    """The KV configuration cannot run on this device (raised once, at engine start-up)."""


def check_supported(model: Any, cfg: KVConfig) -> None:
    """Quantized KV (`kv_bits` 8 / 4) attends through `mx.quantized_matmul`, which MLX-CUDA
    0.32.4 does not implement for attention's shapes ("No implementation for problem shape").
    Without this check the server would start and then fail every request at its first
    prefill; so one throwaway row runs a 32-token prefill, a 5-column forward (a speculative
    verify) and a decode step, and a failure becomes one clear start-up error. A no-op at 16
    bits."""
    if cfg.kv_bits >= 16:
        return
    try:
        caches = new_batch(model, 1, cfg)
        for width in (32, 5, 1):
            mx.eval(model(mx.zeros((1, width), dtype=mx.int32), cache=caches))
    except Exception as exc:  # noqa: BLE001 - any failure here is the configuration's
        raise UnsupportedKV(
            f"--kv-bits {cfg.kv_bits} (group size {cfg.kv_group_size}) cannot run on "
            f"{mx.default_device()} with MLX {getattr(mx, '__version__', '?')}: {exc}. "
            "Use --kv-bits 16."
        ) from exc


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
    moves: list[RowMove] = []
    for layer in batch:
        layer.filter(keep, moves)
    if moves:
        apply_moves(moves)


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


def prepare_right_padded(batch: Layouts, lengths: Sequence[int]) -> bool:
    """Announce a right-padded forward when the rows have different lengths (each keeps only
    its own columns). Returns True if announced (then `finalize` after the last chunk)."""
    if min(lengths) == max(lengths):
        return False
    prepare(batch, lengths=list(lengths))
    return True


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


def spare_bytes(batch: Layouts | None) -> int:
    """Bytes held by free slots (rows that left, kept for rows that join: `KVLayout.filter`)."""
    return sum(layer.spare_bytes() for layer in batch or [] if isinstance(layer, KVLayout))


def nbytes(batch: Layouts | None) -> int:
    return sum(int(layer.nbytes) for layer in batch or [])


def state_arrays(batch: Layouts | None) -> list[Any]:
    return [layer.state for layer in batch or []]


def eval_state(batch: Layouts) -> None:
    mx.eval([layer.state for layer in batch])
