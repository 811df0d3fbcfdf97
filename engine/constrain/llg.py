"""The llguidance backend: one `LLMatcher` per row, masks for the whole batch in one call.

`LLTokenizer`s are built once per (tokenizer, vocab size, eos ids) and cached: building one
walks the whole vocabulary (~0.2 s for 8k tokens).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from engine.constrain.base import ConstraintError
from engine.constrain.grammars import CALL_CAPTURE, grammar_of, tool_error

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


_specials: dict[int, dict[str, int]] = {}  # by id(tokenizer), like _tokenizers


def special_tokens(tokenizer: Any) -> dict[str, int]:
    """The tokenizer's special tokens, text → id (what grammars write markup in)."""
    key = id(tokenizer)
    with _lock:
        found = _specials.get(key)
        if found is None:
            added = getattr(tokenizer, "added_tokens_decoder", None) or {}
            found = {str(t): int(i) for i, t in added.items() if getattr(t, "special", False)}
            _specials[key] = found
        return found


def _get_executor() -> Any:
    global _executor
    import llguidance

    with _lock:
        if _executor is None:
            _executor = llguidance.LLExecutor()
        return _executor


_SLOT = CALL_CAPTURE + "_"


class LLGConstraint:
    """A row's llguidance matcher.

    Under a tool-call grammar it also ends the output at the first call that repeats an earlier
    one exactly (name and arguments): a model that is not trained to stop after its calls (it
    hardly ever samples end-of-sequence there) otherwise copies its call into every slot the
    grammar allows. The repeat is dropped by the server's call parser."""

    __slots__ = ("matcher", "num_consumed", "_calls", "_repeated")

    def __init__(self, matcher: Any, tool_calls: bool = False):
        self.matcher = matcher
        self.num_consumed = 0
        self._calls = 0 if tool_calls else -1  # completed calls seen; -1: not a tool-call grammar
        self._repeated = False

    def consume(self, token: int) -> bool:
        self.num_consumed += 1
        ok = bool(self.matcher.consume_token(token))
        if ok and self._calls >= 0:
            self._note_calls()
        return ok

    def _note_calls(self) -> None:
        slots = {name: text for name, text in self.matcher.get_captures() if name.startswith(_SLOT)}
        if len(slots) > self._calls:
            self._calls = len(slots)
            last = slots.pop(f"{_SLOT}{self._calls - 1}", None)
            self._repeated = last is not None and last in slots.values()

    def is_done(self) -> bool:
        if self.matcher.is_stopped():
            return True
        # a repeat is seen once the rest of it is forced: the output ends when that rest is written
        return self._repeated and (self.matcher.is_accepting() or not self.matcher.compute_ff_bytes())

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

    grammar = grammar_of(spec, special_tokens(tokenizer) if tokenizer is not None else None)
    lltok = _ll_tokenizer(tokenizer, vocab_size, eos_ids)
    # an invalid grammar leaves the matcher in its error state, with the message
    # LLMatcher.validate_grammar would give (compiling it only once)
    matcher = llguidance.LLMatcher(lltok, grammar, log_level=0, limits=_limits())
    try:
        _probe(matcher, vocab_size, eos_ids)
    except ConstraintError as exc:
        raise ConstraintError(tool_error(spec, str(exc))) from None
    return LLGConstraint(matcher, tool_calls=spec.get("type") == "tool_calls")


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
_LARK_CONTEXT = re.compile(r"^\s*\d+ \| ")  # "   2 | tool_0: %json {...}": a grammar line quoted


def reason(message: str) -> str:
    """A grammar-engine error as a short message for the client: never the parser state or the
    compiled grammar, a plain explanation for the resource limits, at most MAX_REASON
    characters (a regex or Lark syntax error keeps its few lines pointing at the mistake)."""
    for marker in _DUMPS:
        message = message.split(marker, 1)[0]
    message = "\n".join(_without_grammar_lines(message.strip().splitlines())).strip()
    low = message.lower()
    for key, text in _KNOWN:
        if key in low:
            return text
    return message if len(message) <= MAX_REASON else message[: MAX_REASON - 3] + "..."


def _without_grammar_lines(lines: list[str]) -> list[str]:
    """Drop the grammar lines a Lark error quotes, and the caret line under each."""
    out: list[str] = []
    quoted = False
    for line in lines:
        if _LARK_CONTEXT.match(line):
            quoted = True
        elif not (quoted and line.strip() == "^"):
            quoted = False
            out.append(line)
    return out


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


def fill_draft_masks(rows: Sequence[tuple[LLGConstraint, int, list[int]]],
                     bitmask: np.ndarray) -> None:
    """For each (constraint, row index i, drafts): the allowed tokens of its current state into
    `bitmask[i]`, and after each draft the grammar takes, those of the state it leads to into
    `bitmask[i + 1]`, `bitmask[i + 2]`, ... (rows past the first draft it refuses are left as
    they are); each grammar ends where it was. The rows with drafts in one parallel call, those
    without in another (llguidance's draft call refuses an empty list)."""
    fill_masks([(c, i) for c, i, drafts in rows if not drafts], bitmask)
    drafted = [(c.matcher, i, drafts) for c, i, drafts in rows if drafts]
    if drafted:
        assert bitmask.dtype == np.int32 and bitmask.flags["C_CONTIGUOUS"]
        batch, width = bitmask.shape
        _get_executor().unsafe_compute_mask_ptr_with_draft_token(
            drafted, bitmask.ctypes.data, width * 4, batch
        )
