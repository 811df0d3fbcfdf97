"""The `Constraint` protocol and the bitmask → [B, V] mask unpacking (one MLX op chain)."""

from __future__ import annotations

from typing import Protocol

import mlx.core as mx
import numpy as np


class ConstraintError(ValueError):
    """The spec cannot be compiled (bad schema, unsupported keyword, bad regex); the message says
    why and is meant for the client (HTTP 400)."""


class Constraint(Protocol):
    """One row's grammar state. Used from the engine thread only."""

    def consume(self, token: int) -> bool:
        """Advance by the sampled token; False if the grammar rejects it (the row then fails)."""
        ...

    def is_done(self) -> bool:
        """The output is complete: the grammar allows nothing more (except end of sequence), or
        the constraint ends it early (a tool call that repeats an earlier one)."""
        ...

    @property
    def error(self) -> str:
        """Why the matcher failed ("" when it has not)."""
        ...


def words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def new_bitmask(batch: int, vocab_size: int) -> np.ndarray:
    """[B, ceil(V/32)] int32, all bits set (every token allowed): free rows stay like this."""
    return np.full((batch, words(vocab_size)), -1, dtype=np.int32)


_BIT_INDEX = None


def allowed_from_bitmask(bitmask: np.ndarray, vocab_size: int) -> mx.array:
    """[B, W] int32 bitmask (bit j of word w = token 32*w + j) → [B, V] bool, as MLX ops.

    Worked example: word 0 = 0b101 → tokens 0 and 2 allowed, token 1 not.
    """
    global _BIT_INDEX
    if _BIT_INDEX is None:
        _BIT_INDEX = mx.arange(32, dtype=mx.uint32)
    packed = mx.array(bitmask.view(np.uint32))
    bits = (packed[:, :, None] >> _BIT_INDEX) & 1
    return bits.reshape(packed.shape[0], -1)[:, :vocab_size].astype(mx.bool_)
