"""Reasoning split: `<think>…</think>` → reasoning text apart from the answer, streamed too.

Models that think in tags (DeepSeek-R1, Qwen3, QwQ, …) write their reasoning first. The splitter
takes text deltas and returns `("reasoning" | "content", text)` pieces; a partial tag at the end of
a delta is held back until the next one decides it. Some templates open the tag themselves (the
rendered prompt ends in "<think>\\n"): then the output starts inside the reasoning.

    s = ReasoningSplitter()
    s.feed("<think>hmm, 2+2")  -> [("reasoning", "hmm, 2+2")]
    s.feed("</think>\\n\\n4")     -> [("content", "4")]

Only a tag at the start of the output (after whitespace) opens reasoning; later "<think>" is text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from server.stops import partial_suffix

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


_VOCAB_THINKS: dict[int, bool] = {}  # by id(tokenizer): the served tokenizer lives as long as we do


def model_thinks(template: str | None, tokenizer: Any) -> bool:
    """Whether this model writes <think> reasoning (its template or vocabulary mentions it)."""
    if template and THINK_OPEN in template:
        return True
    key = id(tokenizer)
    if key not in _VOCAB_THINKS:  # get_vocab() builds a dict of the whole vocabulary: once
        try:
            vocab = tokenizer.get_vocab()
        except Exception:
            vocab = {}
        _VOCAB_THINKS[key] = THINK_OPEN in vocab and THINK_CLOSE in vocab
    return _VOCAB_THINKS[key]


def prompt_opens_thinking(prompt_text: str) -> bool:
    tail = prompt_text.rstrip()
    return tail.endswith(THINK_OPEN)


@dataclass(slots=True)
class ReasoningEvent:
    """A piece of a turn's reasoning (server.turn's events)."""

    text: str


class ReasoningSplitter:
    def __init__(self, *, in_reasoning: bool = False):
        self.state = "reasoning" if in_reasoning else "start"  # start | reasoning | after | content
        self._held = ""

    def feed(self, text: str) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        buf = self._held + text
        self._held = ""
        while buf:
            if self.state == "start":
                stripped = buf.lstrip()
                if stripped.startswith(THINK_OPEN):
                    buf = stripped[len(THINK_OPEN):]
                    self.state = "reasoning"
                elif THINK_OPEN.startswith(stripped):  # "", "<", "<th", ...: undecided
                    self._held = buf
                    return out
                else:
                    self.state = "content"
            elif self.state == "reasoning":
                i = buf.find(THINK_CLOSE)
                if i >= 0:
                    _add(out, "reasoning", buf[:i])
                    buf = buf[i + len(THINK_CLOSE):]
                    self.state = "after"
                else:
                    keep = partial_suffix(buf, (THINK_CLOSE,))
                    _add(out, "reasoning", buf[: len(buf) - keep])
                    self._held = buf[len(buf) - keep:]
                    return out
            elif self.state == "after":  # drop the blank lines between reasoning and answer
                buf = buf.lstrip()
                if buf:
                    self.state = "content"
            else:
                _add(out, "content", buf)
                buf = ""
        return out

    def finish(self) -> list[tuple[str, str]]:
        held, self._held = self._held, ""
        if not held:
            return []
        return [("reasoning" if self.state == "reasoning" else "content", held)]


def _add(out: list[tuple[str, str]], kind: str, text: str) -> None:
    if text:
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + text)
        else:
            out.append((kind, text))


def split_reasoning(text: str, *, in_reasoning: bool = False) -> tuple[str | None, str]:
    """A whole output → (reasoning or None, content)."""
    s = ReasoningSplitter(in_reasoning=in_reasoning)
    parts = s.feed(text) + s.finish()
    reasoning = "".join(t for k, t in parts if k == "reasoning")
    content = "".join(t for k, t in parts if k == "content")
    saw = in_reasoning or s.state in ("reasoning", "after") or bool(reasoning)
    return (reasoning if saw else None), content
