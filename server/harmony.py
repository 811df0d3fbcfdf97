"""gpt-oss's harmony output → reasoning, answer text and tool calls, incrementally.

A harmony prompt ends with `<|start|>assistant`; the model then writes one or more messages,
each a header, `<|message|>`, a body and an end token:

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

    <|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>Sunny.<|return|>

The header names the message's channel and, for a tool call, its recipient (`to=functions.NAME`,
written before or after the channel). Bodies go by channel: `analysis` is reasoning; `final`, and
`commentary` without a recipient (a preamble the user is shown), are the answer's text (a blank
line between two such messages); a message to a function is a call whose arguments are its body,
streamed as written. `<|call|>` and `<|return|>` end the output (they are end-of-sequence tokens,
so normally the engine has already stopped there); `<|end|>` ends one message and another
follows.

The markers are special tokens: the output must be detokenized with them kept. Output with no
header at all (a constrained JSON answer, a model that skipped its channel) is answer text. A
message to a function that is not one of the request's tools, or when tools are off, is text too
(as in server.tools' parser).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from server.reasoning import ReasoningEvent
from server.stops import partial_suffix
from server.tools import (
    CallArgs,
    CallEnd,
    CallStart,
    Event,
    TextEvent,
    ToolCall,
    new_call_id,
)

CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
END = "<|end|>"
CALL = "<|call|>"
RETURN = "<|return|>"
_BODY_ENDS = (END, CALL, RETURN)
# how reasoning opens and ends (the answer opens with HARMONY_FINAL: what a constrained answer
# waits for)
HARMONY_ANALYSIS = CHANNEL + "analysis" + MESSAGE
HARMONY_NEXT = END + "<|start|>assistant"
_HEADER_STARTS = ("<|", "to=")  # what a header's first word can be (after whitespace)
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")

HarmonyEvent = ReasoningEvent | Event


def is_harmony(template: str | None) -> bool:
    """Whether a chat template writes harmony (gpt-oss)."""
    return bool(template) and CHANNEL in template  # type: ignore[operator]


class HarmonyParser:
    """Text deltas of one choice → ReasoningEvent / TextEvent / CallStart, CallArgs, CallEnd.
    `tool_names`: the request's tools (None: tools are off; calls stay text)."""

    def __init__(self, tool_names: Sequence[str] | None):
        self.tools = set(tool_names) if tool_names is not None else None
        self.calls: list[ToolCall] = []
        self._state = "header"  # header | body | done
        self._kind = ""  # the body's: reasoning | text | call
        self._text_seen = False  # an earlier message gave answer text (a preamble)
        self._gap = False  # ... so this one's text starts after a blank line
        self._buf = ""  # the header so far, or body text that may begin an end marker

    def feed(self, text: str) -> list[HarmonyEvent]:
        events: list[HarmonyEvent] = []
        buf = self._buf + text
        self._buf = ""
        while buf and self._state != "done":
            if self._state == "header":
                buf = self._header(buf, events)
            else:
                buf = self._body(buf, events)
        return events

    def finish(self) -> list[HarmonyEvent]:
        """The output ended: a cut-off body keeps what arrived (a call is closed with it); a
        header that never reached its body is dropped, unless it is not a header at all."""
        events: list[HarmonyEvent] = []
        held, self._buf = self._buf, ""
        if self._state == "body":
            self._emit(held, events)
            self._close(events)
        elif self._state == "header" and held and "<|" not in held:
            events.append(TextEvent(held))
        self._state = "done"
        return events

    # -- states ------------------------------------------------------------------------------

    def _header(self, buf: str, events: list[HarmonyEvent]) -> str:
        i = buf.find(MESSAGE)
        if i < 0:
            lead = buf.lstrip()
            if lead and not any(lead.startswith(s) or s.startswith(lead) for s in _HEADER_STARTS):
                self._open("", "", events)  # no header: the answer itself
                return buf
            self._buf = buf
            return ""
        header = buf[:i]
        channel = _CHANNEL_NAME.search(header)
        recipient = _RECIPIENT.search(header)
        self._open(channel.group(1) if channel else "", recipient.group(1) if recipient else "", events)
        return buf[i + len(MESSAGE):]

    def _open(self, channel: str, recipient: str, events: list[HarmonyEvent]) -> None:
        self._state = "body"
        name = recipient.removeprefix("functions.")
        if recipient and self.tools is not None and name in self.tools:
            self._kind = "call"
            self.calls.append(ToolCall(new_call_id(), name, ""))
            events.append(CallStart(len(self.calls) - 1, self.calls[-1].id, name))
        else:
            self._kind = "reasoning" if channel == "analysis" and not recipient else "text"
            self._gap = self._kind == "text" and self._text_seen

    def _body(self, buf: str, events: list[HarmonyEvent]) -> str:
        hits = [(j, m) for m in _BODY_ENDS if (j := buf.find(m)) >= 0]
        if not hits:
            keep = partial_suffix(buf, _BODY_ENDS)
            self._emit(buf[: len(buf) - keep], events)
            self._buf = buf[len(buf) - keep:]
            return ""
        j, marker = min(hits)
        self._emit(buf[:j], events)
        self._close(events)
        self._state = "header" if marker == END else "done"
        return buf[j + len(marker):]

    def _emit(self, text: str, events: list[HarmonyEvent]) -> None:
        if not text:
            return
        if self._kind == "call":
            self.calls[-1].arguments += text
            events.append(CallArgs(len(self.calls) - 1, text))
        elif self._kind == "reasoning":
            events.append(ReasoningEvent(text))
        else:
            events.append(TextEvent("\n\n" + text if self._gap else text))
            self._text_seen, self._gap = True, False

    def _close(self, events: list[HarmonyEvent]) -> None:
        if self._kind == "call":
            index = len(self.calls) - 1
            if not self.calls[index].arguments:
                self.calls[index].arguments = "{}"
                events.append(CallArgs(index, "{}"))
            events.append(CallEnd(index))
        self._kind = ""
