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
        return reason(self.matcher.get_error()) if self.matcher.is_error() else ""


def compile_constraint(
    spec: Any, tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]
) -> LLGConstraint:
    """A fresh matcher for one row. Raises ConstraintError with the reason on a bad spec.

    The grammar is also run one step here (first mask, then one token on a copy): limits the
    grammar engine only meets while parsing (a regex that expands to too many states, a schema
    whose required properties recurse forever) then fail this request now, as a 400, instead of
    failing the row on the engine thread."""
    import llguidance

    grammar = grammar_of(spec)
    lltok = _ll_tokenizer(tokenizer, vocab_size, eos_ids)
    limits = _limits()
    problem = llguidance.LLMatcher.validate_grammar(grammar, lltok, limits=limits)
    if problem and not problem.startswith("WARNING"):
        raise ConstraintError(reason(problem))
    matcher = llguidance.LLMatcher(lltok, grammar, log_level=0, limits=limits)
    _probe(matcher, vocab_size, eos_ids)
    return LLGConstraint(matcher)


def _limits() -> Any:
    """The grammar engine's default resource limits, with errors that carry no parser state or
    grammar text (they go back to the client)."""
    import llguidance

    return llguidance.LLParserLimits(verbose_errors=False)


def _probe(matcher: Any, vocab_size: int, eos_ids: Sequence[int]) -> None:
    """Compute the first mask (the matcher keeps it for the first decode step) and consume one
    allowed token on a copy; ConstraintError if the grammar engine fails on either."""
    if matcher.is_error():
        raise ConstraintError(reason(matcher.get_error()))
    mask = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
    if matcher.is_error():
        raise ConstraintError(reason(matcher.get_error()))
    allowed = np.flatnonzero(np.unpackbits(mask, bitorder="little")[:vocab_size])
    if allowed.size == 0:
        raise ConstraintError("the constraint allows no output at all")
    eos = set(eos_ids)
    token = next((int(t) for t in allowed if int(t) not in eos), None)
    if token is None:  # only the end of sequence is allowed: nothing to try
        return
    trial = matcher.deep_copy()
    if not trial.consume_token(token) and trial.is_error():
        raise ConstraintError(reason(trial.get_error()))


# the grammar engine's own wording → what the client can do about it
_KNOWN = (
    ("too many items", "the constraint is too complex for the grammar engine (it ran out of "
     "parser items); a common cause is a required property that refers back to its own object, "
     "so no finite JSON value matches"),
    ("too many expressions constructed", "a regular expression in the constraint is too complex "
     "for the grammar engine (it expands to too many states); use smaller repetition counts"),
    ("too many states", "a regular expression in the constraint is too complex for the grammar "
     "engine (too many lexer states); use smaller repetition counts"),
)
MAX_REASON = 400
_DUMPS = ("<state>", "<grammar>", "<non-verbose/>")  # where the grammar engine's debug dump begins


def reason(message: str) -> str:
    """A grammar-engine error as a short message for the client: never the parser state or the
    compiled grammar, a plain explanation for the resource limits, at most MAX_REASON
    characters (a regex or Lark syntax error keeps its few lines pointing at the mistake)."""
    for marker in _DUMPS:
        message = message.split(marker, 1)[0]
    message = message.strip()
    low = message.lower()
    for key, text in _KNOWN:
        if key in low:
            return text
    return message if len(message) <= MAX_REASON else message[: MAX_REASON - 3] + "..."


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
