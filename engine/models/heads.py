"""The logits of one position per row, without running the head over every position.

A prompt's last prefill chunk needs the logits of one position per row (its last prompt token:
the row's first token is sampled from them). mlx-lm's models compute `head(decoder(inputs))`
over every position, and MLX does not push a slice through a matmul: over a 4,096-token chunk
with a 128k vocabulary the head alone would be a [4096, 128k] product and a 1 GB result.

`logits_at(model, forward, rows, cols)` runs `forward()` (the model's call) with the model's
decoder stack (`model.model`, or `model.language_model.model`) swapped, for that one call, for
a view that returns only the hidden states at (rows[i], cols[i]); whatever the model does after
the stack (the head, a tied embedding, soft-capping, a logit scale) then runs on those alone.
The swap replaces the dict entry in place (an `nn.Module` is a dict), so the module tree and its
order are the same after the call. A model without such a stack gets the whole logits, sliced.
`tests/test_first_token.py` checks every registered architecture against the full logits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn


class _AtPositions:
    """Stands in for a decoder stack for one call: its hidden states at the given positions,
    [B, 1, H]. Attribute reads go to the stack (a tied head reads `embed_tokens` through it)."""

    def __init__(self, stack: nn.Module, rows: mx.array, cols: mx.array) -> None:
        self._stack, self._rows, self._cols = stack, rows, cols

    def __call__(self, *args: Any, **kwargs: Any) -> mx.array:
        hidden = self._stack(*args, **kwargs)
        return hidden[self._rows, self._cols][:, None]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stack, name)


def decoder_owner(model: nn.Module) -> nn.Module | None:
    """The module whose `model` entry is the decoder stack the head reads (the model itself, or
    its `language_model`); None when there is none."""
    for owner in (model, model.get("language_model")):
        if isinstance(owner, nn.Module) and isinstance(owner.get("model"), nn.Module):
            return owner
    return None


def logits_at(
    model: nn.Module, forward: Callable[[], mx.array], rows: mx.array, cols: mx.array
) -> mx.array:
    """[B, V]: row i's logits at position cols[i] of row rows[i] of what `forward()` (a call of
    `model`) computes, with the head run on those positions only (module docstring)."""
    owner = decoder_owner(model)
    if owner is None:
        return forward()[rows, cols]
    stack = owner["model"]
    owner["model"] = _AtPositions(stack, rows, cols)
    try:
        return forward()[:, 0]
    finally:
        owner["model"] = stack
