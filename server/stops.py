"""Stop strings over a stream of text deltas: cut at the first match, never leak a partial one.

`push(delta)` returns the text that is safe to emit now. Text that could still become a stop
string (a suffix of what we have that is a prefix of some stop string) is held back until the
next delta decides it. Example with stop "###":

    push("a #")  -> "a "     (holds "#")
    push("#")    -> ""       (holds "##")
    push("#b")   -> ""       matched: output ends at "a ", nothing after it

The match is the stop string that *ends* first in the text (ties: the one that starts first),
which is what a stream can know; so the result never depends on how the text was split.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    def __init__(self, stops: Sequence[str], *, include_stop: bool = False):
        self.stops = [s for s in stops if s]
        self.include_stop = include_stop
        self.matched: str | None = None  # the stop string that ended the text
        self._held = ""

    @property
    def held(self) -> str:
        return self._held

    def push(self, text: str) -> str:
        if self.matched is not None:
            return ""
        if not self.stops:
            return text
        buf = self._held + text
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self.stops:
            i = buf.find(stop)
            if i >= 0 and (best is None or (i + len(stop), i) < best[:2]):
                best = (i + len(stop), i, stop)
        if best is not None:
            end, start, stop = best
            self.matched = stop
            self._held = ""
            return buf[:end] if self.include_stop else buf[:start]
        keep = partial_suffix(buf, self.stops)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """The generation ended without a match: the held text was real text after all."""
        out, self._held = self._held, ""
        return "" if self.matched is not None else out


def partial_suffix(buf: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of `buf` that is a proper prefix of one of `markers`: text
    held back until the next delta decides it (stop strings here; tool-call, reasoning and
    channel markers in server.tools, server.reasoning and server.harmony)."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(buf)), best, -1):
            if buf.endswith(m[:k]):
                best = k
                break
    return best
