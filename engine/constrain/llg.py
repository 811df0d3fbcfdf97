"""The llguidance backend: one `LLMatcher` per row, masks for the whole batch in one call.

`LLTokenizer`s are built once per (tokenizer, vocab size, eos ids) and cached: building one
walks the whole vocabulary (~0.2 s for 8k tokens).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from engine.constrain.base import ConstraintError
from engine.constrain.grammars import grammar_of

_lock = threading.Lock()
_tokenizers: dict[tuple[int, int, tuple[int, ...]], Any] = {}
_executor: Any = None


def _ll_tokenizer(tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]) -> Any:
    import llguidance.hf

    key = (id(tokenizer), vocab_size, tuple(eos_ids))
    with _lock:
        lltok = _tokenizers.get(key)
        if lltok is None:
            if tokenizer is None:
                raise ConstraintError("this model has no tokenizer, so constraints cannot be compiled")
            eos = list(eos_ids) or None
            try:
                lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
            except Exception as exc:  # e.g. a slow (non-Rust) tokenizer
                raise ConstraintError(f"constrained decoding is unavailable for this tokenizer: {exc}") from None
            _tokenizers[key] = lltok
        return lltok


def _get_executor() -> Any:
    global _executor
    import llguidance

    with _lock:
        if _executor is None:
            _executor = llguidance.LLExecutor()
        return _executor


class LLGConstraint:
    """A row's llguidance matcher."""

    __slots__ = ("matcher", "num_consumed")

    def __init__(self, matcher: Any):
        self.matcher = matcher
        self.num_consumed = 0

    def consume(self, token: int) -> bool:
        self.num_consumed += 1
        return bool(self.matcher.consume_token(token))

    def is_done(self) -> bool:
        return bool(self.matcher.is_stopped())

    @property
    def error(self) -> str:
        return self.matcher.get_error() if self.matcher.is_error() else ""


def compile_constraint(
    spec: Any, tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]
) -> LLGConstraint:
    """A fresh matcher for one row. Raises ConstraintError with the reason on a bad spec."""
    import llguidance

    grammar = grammar_of(spec)
    lltok = _ll_tokenizer(tokenizer, vocab_size, eos_ids)
    problem = llguidance.LLMatcher.validate_grammar(grammar, lltok)
    if problem and not problem.startswith("WARNING"):
        raise ConstraintError(_reason(problem))
    matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
    if matcher.is_error():
        raise ConstraintError(_reason(matcher.get_error()))
    return LLGConstraint(matcher)


def _reason(message: str) -> str:
    message = message.strip()
    return message if len(message) <= 500 else message[:497] + "..."


def fill_masks(rows: Sequence[tuple[LLGConstraint, int]], bitmask: np.ndarray) -> None:
    """Write each (constraint, row index)'s allowed tokens into `bitmask[row]`, all rows in one
    parallel call (llguidance releases the GIL while it works)."""
    if not rows:
        return
    assert bitmask.dtype == np.int32 and bitmask.flags["C_CONTIGUOUS"]
    if len(rows) == 1:
        c, i = rows[0]
        row = bitmask[i]
        c.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        return
    batch, width = bitmask.shape
    _get_executor().unsafe_compute_mask_ptr(
        [(c.matcher, i) for c, i in rows], bitmask.ctypes.data, width * 4, batch
    )
