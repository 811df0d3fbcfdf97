"""gpt-oss harmony output: channels become reasoning, answer text and tool calls; streamed in any
pieces it gives what the whole output gives; cut-off and header-less output stay usable."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from server.harmony import HarmonyParser, is_harmony
from server.reasoning import ReasoningEvent
from server.tools import HARMONY, CallArgs, CallEnd, CallStart, TextEvent, format_for_template

TOOLS = ["get_weather", "count"]
CALL_OUTPUT = ('<|channel|>analysis<|message|>The user wants Paris; call the tool.<|end|>'
               '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json'
               '<|message|>{"city": "Paris", "days": [1, 2]}<|call|>')
ANSWER_OUTPUT = ('<|channel|>analysis<|message|>Easy: 2 < 3 and <|end is not a marker.<|end|>'
                 '<|start|>assistant<|channel|>commentary<|message|>Let me think aloud.<|end|>'
                 '<|start|>assistant<|channel|>final<|message|>It is sunny in <b>Paris</b>.<|return|>')


def _run(text: str, cuts=(), tools=TOOLS):
    """(reasoning, content, [(name, arguments)], events) of `text` fed in pieces cut at `cuts`."""
    p = HarmonyParser(tools)
    events = []
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        events += p.feed(text[a:b])
    events += p.finish()
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningEvent))
    content = "".join(e.text for e in events if isinstance(e, TextEvent))
    calls: dict[int, list[str]] = {}
    for e in events:
        if isinstance(e, CallStart):
            calls[e.index] = [e.name, ""]
        elif isinstance(e, CallArgs):
            calls[e.index][1] += e.fragment
    ended = [e.index for e in events if isinstance(e, CallEnd)]
    assert ended == sorted(calls), "every call ends once, in order"
    assert [(c.name, c.arguments) for c in p.calls] == [tuple(calls[i]) for i in sorted(calls)]
    return reasoning, content, [tuple(calls[i]) for i in sorted(calls)]


def test_channels_split_into_reasoning_answer_and_calls():
    assert _run(CALL_OUTPUT) == ("The user wants Paris; call the tool.", "",
                                 [("get_weather", '{"city": "Paris", "days": [1, 2]}')])
    assert _run(ANSWER_OUTPUT) == ("Easy: 2 < 3 and <|end is not a marker.",
                                   "Let me think aloud.\n\nIt is sunny in <b>Paris</b>.", [])
    # the recipient before the channel (how templates render a call in the history)
    assert _run(' to=functions.count<|channel|>commentary json<|message|>{"n": 3}<|call|>')[2] == [
        ("count", '{"n": 3}')]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([CALL_OUTPUT, ANSWER_OUTPUT]), st.lists(st.integers(0, len(CALL_OUTPUT)), max_size=12))
def test_streamed_in_any_pieces_equals_whole(text, cuts):
    cuts = sorted({c for c in cuts if c <= len(text)})
    assert _run(text, cuts) == _run(text)


def test_the_output_ends_at_call_or_return_and_a_cut_off_call_keeps_its_arguments():
    after = CALL_OUTPUT + "<|start|>functions.get_weather to=assistant<|message|>made up"
    assert _run(after) == _run(CALL_OUTPUT)
    cut = CALL_OUTPUT[: CALL_OUTPUT.index("days")]
    assert _run(cut)[2] == [("get_weather", '{"city": "Paris", "')]
    # a call with an empty body gets empty arguments; a header cut off before its body is dropped
    assert _run("<|channel|>commentary to=functions.count <|constrain|>json<|message|><|call|>")[2] == [
        ("count", "{}")]
    assert _run("<|channel|>analysis<|message|>hm<|end|><|start|>assistant<|channel|>fin") == ("hm", "", [])


def test_unknown_recipients_and_tools_off_are_text_and_headerless_output_is_the_answer():
    unknown = '<|channel|>commentary to=functions.launch <|constrain|>json<|message|>{"x": 1}<|call|>'
    assert _run(unknown) == ("", '{"x": 1}', [])
    assert _run(CALL_OUTPUT, tools=None) == ("The user wants Paris; call the tool.",
                                             '{"city": "Paris", "days": [1, 2]}', [])
    for cuts in ((), (1,), (3, 4)):
        assert _run('{"answer": 42}', cuts) == ("", '{"answer": 42}', [])
        assert _run("  plain words", cuts) == ("", "  plain words", [])


def test_harmony_templates_are_recognised():
    template = "{{ '<|start|>assistant<|channel|>final<|message|>' }}"
    assert is_harmony(template) and not is_harmony("<|im_start|>") and not is_harmony(None)
    assert format_for_template(template) is HARMONY
    assert HARMONY.lazy_trigger is None and HARMONY.one_call
