"""The runner's view of batched KV: a list of per-layer layouts (engine/kv) behind a few calls.

    caches = new_batch(model, num_rows, cfg)   # empty layouts for a prefill group
    prepare_right_padded(caches, lengths)      # rows of different lengths in one prefill forward
    extend(running, group)                     # admit the group's rows
    filter_rows(running, keep)                 # drop finished rows
    nbytes(running) / bytes_by_layout(running)

Which layer gets which layout (plain, rotating, quantized, recurrent) is decided by the
architecture registry in engine/models. Rows are not aligned with each other: each keeps its own
length, so admitting a short row next to a long one costs no padding columns (docs/kv-layouts.md).

Worked example: running rows A (300 tokens) and B (20 tokens) on a sliding-window layer of
window 256 hold min(n, ring) columns each; a new row C (7 tokens) is appended as a third row
whose next RoPE position (`offset`) is 7 while A's is 300 — one decode step then writes A's
column (300 mod ring), B's column 20 and C's column 7.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from engine.kv import batch as kvb
from engine.models import make_batch_layouts

Caches = list[Any]


@dataclass(slots=True)
class KVConfig:
    kv_bits: int = 16  # 16 = model dtype; 8 / 4 = MLX affine quantized KV
    kv_group_size: int = 64
    max_kv_size: int | None = None  # cap full-attention layers to a ring of this many tokens


def new_batch(model: Any, num_rows: int, cfg: KVConfig | None = None) -> Caches:
    cfg = cfg or KVConfig()
    return make_batch_layouts(
        model,
        num_rows,
        kv_bits=cfg.kv_bits,
        kv_group_size=cfg.kv_group_size,
        max_kv_size=cfg.max_kv_size,
    )


class UnsupportedKV(ValueError):
    """The KV configuration cannot run on this device (raised once, at engine start-up)."""


def check_supported(model: Any, cfg: KVConfig) -> None:
    """Quantized KV (`kv_bits` 8 / 4) attends through `mx.quantized_matmul`, which MLX-CUDA
    0.32.4 does not implement for attention's shapes ("No implementation for problem shape",
    bench/results/h200-session4/probe.log). Without this check the server would start and then
    fail every request at its first prefill; so one throwaway row runs a 32-token prefill, a
    5-column forward (a speculative verify) and a decode step, and a failure becomes one clear
    start-up error. A no-op at 16 bits."""
    if cfg.kv_bits >= 16:
        return
    try:
        caches = new_batch(model, 1, cfg)
        for width in (32, 5, 1):
            mx.eval(model(mx.zeros((1, width), dtype=mx.int32), cache=caches))
    except Exception as exc:  # noqa: BLE001 - any failure here is the configuration's
        raise UnsupportedKV(
            f"--kv-bits {cfg.kv_bits} (group size {cfg.kv_group_size}) cannot run on "
            f"{mx.default_device()} with MLX {mx.__version__}: {exc}. Use --kv-bits 16."
        ) from exc


def prepare_right_padded(caches: Caches, lengths: Sequence[int], force: bool = False) -> bool:
    """Announce a right-padded prefill (rows of different lengths, or `force`: the forward may
    carry more columns than the longest row). Returns True if announced."""
    if not force and min(lengths) == max(lengths):
        return False
    kvb.prepare(caches, lengths=list(lengths))
    return True


def finalize(caches: Caches) -> None:
    kvb.finalize(caches)


def extend(running: Caches | None, group: Caches) -> Caches:
    return kvb.extend(running, group)


def filter_rows(caches: Caches, keep: list[int]) -> None:
    kvb.filter_rows(caches, keep)


def extract_row(caches: Caches, i: int) -> Caches:
    return kvb.extract_row(caches, i)


def state_arrays(caches: Caches) -> list[Any]:
    return [c.state for c in caches]


def bytes_by_layout(caches: Caches | None) -> dict[str, int]:
    return kvb.bytes_by_layout(caches)


def nbytes(caches: Caches | None) -> int:
    return kvb.nbytes(caches)


def eval_state(caches: Caches) -> None:
    kvb.eval_state(caches)
