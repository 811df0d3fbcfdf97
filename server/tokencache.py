"""Token ids of recent chat prompts, reused for the next turn's.

A conversation re-sends its whole history every turn, so the text the chat template renders
for turn n + 1 starts with turn n's. Tokenizing a 32k-token prompt takes ~40-55 ms; this keeps
the ids of recent prompts and tokenizes only what follows the longest cached prefix.

Why the ids are exactly those of a full tokenization: a fast (Rust) Hugging Face tokenizer
splits the text at its special tokens first and tokenizes the pieces between them on their
own. So the ids up to and including a special token depend only on the text up to there, and
the rest is tokenized as the same text preceded by that special token (`S + rest`, its first
id dropped): the piece after `S` sees what it sees in the whole text (an `rstrip` token's
whitespace, a "first piece only" prefix space). Reuse therefore happens only at the end of a
special token (an entry's `bounds`), and only when the re-tokenized anchor gives back that
token's id.
Until `VERIFY` reuses have been seen, every prompt's ids are also checked against the
tokenizer's own; a mismatch turns the cache off for that tokenizer for good (with a warning).
"""

from __future__ import annotations

import logging
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("mlxd.server")

ENTRIES = 32  # prompts kept (least recently used out)
MIN_CHARS = 1024  # shorter texts are tokenized whole and not kept (they cost well under 1 ms)
VERIFY = 3  # reuses checked against a full tokenization before the cache is trusted


@dataclass(slots=True)
class _Entry:
    text: str
    ids: array  # int32 token ids of `text`
    bounds: list[tuple[int, int]]  # (chars, tokens): the text up to a special token's end


class PromptTokenCache:
    """`encode(text)` for chat prompts (no special tokens added); thread-safe."""

    def __init__(self, tokenizer: Any, entries: int = ENTRIES):
        backend: Any = getattr(tokenizer, "_tokenizer", None)
        fast = bool(getattr(tokenizer, "is_fast", False)) and hasattr(backend, "encode")
        self._backend: Any = backend if fast else None
        self._tokenizer = tokenizer
        self._specials: dict[int, str] = {}
        for tid, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
            if getattr(added, "special", False) and not getattr(added, "normalized", True) \
                    and not getattr(added, "single_word", False):
                self._specials[int(tid)] = str(added.content)
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._max = entries
        self._lock = threading.Lock()
        self._verify = VERIFY
        self.enabled = self._backend is not None and bool(self._specials)
        self.reused_tokens = 0  # ids taken from the cache instead of the tokenizer

    def encode(self, text: str) -> list[int]:
        if not self.enabled or len(text) < MIN_CHARS:
            return self._full(text)
        hit = self._lookup(text)
        reused = 0
        tail = None
        if hit is not None:
            entry, chars, reused = hit
            tail = self._anchored(entry.ids[reused - 1], text[chars:])
        if tail is None:
            reused = 0
            ids, bounds = self._encode_with_bounds(text)
        else:
            tail_ids, tail_bounds = tail
            ids = entry.ids[:reused].tolist() + tail_ids
            bounds = [b for b in entry.bounds if b[0] <= chars]
            bounds += [(chars + c, reused + t) for c, t in tail_bounds]
        if not self._checked(text, ids, reused > 0):
            return self._full(text)
        self.reused_tokens += reused
        self._keep(text, ids, bounds)
        return ids

    # -- internals ---------------------------------------------------------------------
    def _full(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False, verbose=False))

    def _encode_with_bounds(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        enc = self._backend.encode(text, add_special_tokens=False)
        ids = list(enc.ids)
        specials = self._specials
        bounds = [(end, i + 1)
                  for i, (tid, (_, end)) in enumerate(zip(ids, enc.offsets, strict=True))
                  if tid in specials]
        return ids, bounds

    def _anchored(self, special_id: int, rest: str
                  ) -> tuple[list[int], list[tuple[int, int]]] | None:
        """`rest` tokenized as it follows the special token `special_id` in a whole text: the
        token's text + `rest`, its first id dropped (None when the first id is not that token)."""
        special = self._specials[special_id]
        ids, bounds = self._encode_with_bounds(special + rest)
        if not ids or ids[0] != special_id or not bounds or bounds[0][1] != 1:
            return None
        n = len(special)  # the token may have taken whitespace after it too, as in the whole text
        return ids[1:], [(c - n, t - 1) for c, t in bounds[1:]]

    def _lookup(self, text: str) -> tuple[_Entry, int, int] | None:
        """The cached entry, and its (chars, tokens) bound, sharing the longest prefix with
        `text` up to a special token's end."""
        best: tuple[_Entry, int, int] | None = None
        with self._lock:
            entries = list(self._entries.values())
        head = text[:64]
        for entry in entries:
            bounds = entry.bounds
            if not bounds or not entry.text.startswith(head):
                continue
            lo, hi = 0, len(bounds)  # the prefix matches up to bounds[:lo]
            while lo < hi:
                mid = (lo + hi) // 2
                chars = bounds[mid][0]
                if chars <= len(text) and text[:chars] == entry.text[:chars]:
                    lo = mid + 1
                else:
                    hi = mid
            if lo and (best is None or bounds[lo - 1][0] > best[1]):
                best = (entry, *bounds[lo - 1])
        return best

    def _checked(self, text: str, ids: list[int], reused: bool) -> bool:
        """Until `VERIFY` reuses have been checked: whether `ids` equal the tokenizer's own
        (every prompt is checked until then; a mismatch turns the cache off)."""
        if self._verify <= 0:
            return True
        if self._full(text) == ids:
            if reused:
                with self._lock:
                    self._verify -= 1
            return True
        self.enabled = False
        log.warning("prompt token cache off: its ids for a prompt differ from the tokenizer's "
                    "for this model")
        return False

    def _keep(self, text: str, ids: list[int], bounds: list[tuple[int, int]]) -> None:
        if not bounds:
            return
        entry = _Entry(text, array("i", ids), bounds)
        with self._lock:
            # a conversation's previous turn is a prefix of this one: this entry covers it
            for key, old in list(self._entries.items()):
                if len(old.text) <= len(text) and text.startswith(old.text):
                    del self._entries[key]
            self._entries[id(entry)] = entry
            while len(self._entries) > self._max:
                self._entries.popitem(last=False)
