"""The runner's view of batched KV: a list of per-layer batch caches behind four operations.

    caches = new_batch(model, num_rows)        # empty caches for a prefill group
    extend(running, group)                     # admit the group's rows (left padding aligns them)
    filter_rows(running, keep)                 # drop finished rows
    nbytes(running) / bytes_by_layout(running)

Each per-layer cache implements the model-side interface mlx-lm models call (`offset`,
`update_and_fetch`, `make_mask`, `state`) and the batch side (`prepare`/`finalize` for
right-padded prefill, `extend`, `filter`, `extract`). Today these are mlx-lm's batch caches;
`engine/kv/` layouts plug in behind the same functions.

Worked example (full-attention layer): running rows A (5 tokens) and B (3 tokens) are stored
left-padded as [A A A A A] / [. . A B B B]-style columns with left_padding [0, 2]; a new row C
with 7 tokens is extended in: the narrower side is padded on the left so every row ends at the
same column, giving left_padding [2, 4, 0] and 7 columns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as mlc

Caches = list[Any]


def _batch_layer(layer_cache: Any, num_rows: int) -> Any:
    pad = [0] * num_rows
    if isinstance(layer_cache, mlc.RotatingKVCache):
        if layer_cache.keep:
            raise NotImplementedError("rotating caches with keep > 0 are not batched yet")
        return mlc.BatchRotatingKVCache(layer_cache.max_size, pad)
    if isinstance(layer_cache, mlc.KVCache):
        return mlc.BatchKVCache(pad)
    if isinstance(layer_cache, mlc.ArraysCache):
        return mlc.ArraysCache(len(layer_cache.cache), left_padding=pad)
    if isinstance(layer_cache, mlc.CacheList):
        return mlc.CacheList(*(_batch_layer(c, num_rows) for c in layer_cache.caches))
    raise NotImplementedError(f"no batched layout for {type(layer_cache).__name__}")


def new_batch(model: Any, num_rows: int) -> Caches:
    """Empty batch caches for `num_rows` rows, one per layer, following the model's own layout."""
    return [_batch_layer(c, num_rows) for c in mlc.make_prompt_cache(model)]


def prepare_right_padded(caches: Caches, lengths: Sequence[int]) -> bool:
    """Announce a right-padded prefill (rows of different lengths). Returns True if padded."""
    width = max(lengths)
    right = [width - n for n in lengths]
    if max(right) == 0:
        return False
    for c in caches:
        c.prepare(lengths=list(lengths), right_padding=right)
    return True


def finalize(caches: Caches) -> None:
    for c in caches:
        c.finalize()


def extend(running: Caches | None, group: Caches) -> Caches:
    if running is None:
        return group
    for a, b in zip(running, group, strict=True):
        a.extend(b)
    return running


def filter_rows(caches: Caches, keep: list[int]) -> None:
    for c in caches:
        c.filter(keep)


def state_arrays(caches: Caches) -> list[Any]:
    return [c.state for c in caches]


def _layout_name(c: Any) -> str:
    if isinstance(c, mlc.BatchRotatingKVCache):
        return "rotating"
    if isinstance(c, mlc.BatchKVCache):
        return "plain"
    if isinstance(c, mlc.ArraysCache):
        return "recurrent"
    return type(c).__name__


def bytes_by_layout(caches: Caches | None) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in caches or []:
        name = _layout_name(c)
        out[name] = out.get(name, 0) + int(c.nbytes)
    return out


def nbytes(caches: Caches | None) -> int:
    return sum(bytes_by_layout(caches).values())


def eval_state(caches: Caches) -> None:
    mx.eval([c.state for c in caches])
