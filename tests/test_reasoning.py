"""<think> reasoning split: whole and streamed agree for every split; partial tags are held."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from server.reasoning import ReasoningSplitter, split_reasoning

TEXT = "  <think>Let me see: 2 < 3 and </thi is not a tag.</think>\n\nThe answer is <b>4</b>."


def _stream(text, cuts, **kw):
    s = ReasoningSplitter(**kw)
    parts = []
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        parts += s.feed(text[a:b])
    parts += s.finish()
    return ("".join(t for k, t in parts if k == "reasoning"), "".join(t for k, t in parts if k == "content"))


def test_whole_split():
    assert split_reasoning(TEXT) == ("Let me see: 2 < 3 and </thi is not a tag.", "The answer is <b>4</b>.")
    assert split_reasoning("no thinking <think>here</think>") == (None, "no thinking <think>here</think>")
    assert split_reasoning("still thinking when cut", in_reasoning=True) == ("still thinking when cut", "")
    assert split_reasoning("<thi") == (None, "<thi")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, len(TEXT)), max_size=10))
def test_streamed_equals_whole(cuts):
    assert _stream(TEXT, sorted(set(cuts))) == split_reasoning(TEXT)


def test_template_opened_thinking():
    assert _stream("plan A</think>done", [3, 9], in_reasoning=True) == ("plan A", "done")
