"""Incremental detokenization, stop-string holdback and logprob alignment (no HTTP).

Property: however the tokens (or the text) are split into events, the streamed output is the
same as processing everything at once, and never contains a broken character or part of a stop
string that ends the text.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.api import SamplingParams
from server.detokenize import IncrementalDetokenizer, TokenVocab
from server.generation import ChoiceSpec, TextPipeline
from server.stops import StopMatcher
from tests.fake_engine import load_tokenizer

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

ALPHABET = st.sampled_from(list("ab c\n#:=()世界é🎉ü ") + ["def ", "return", "    ", "😀", "\t"])
TEXT = st.lists(ALPHABET, min_size=0, max_size=40).map("".join)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def vocab(tok):
    return TokenVocab(tok)


def split_points(n: int):
    return st.lists(st.integers(0, n), max_size=8).map(lambda cuts: sorted(set(cuts)))


def chunks(seq, cuts):
    out, prev = [], 0
    for c in [*cuts, len(seq)]:
        out.append(seq[prev:c])
        prev = c
    return out


def detok_stream(tok, ids, prompt_ids=()):
    d = IncrementalDetokenizer(tok, prompt_ids=prompt_ids)
    pieces = []
    for t in ids:
        piece = d.add(t)
        if piece is not None:
            assert "\ufffd" not in piece[-1:], "a committed piece never ends in a broken character"
            pieces.append(piece)
    pieces.append(d.flush())
    return pieces


# -- detokenizer -----------------------------------------------------------------------------


def test_multibyte_character_held_until_complete(tok):
    ids = tok.encode("🎉", add_special_tokens=False)
    assert len(ids) > 1  # byte-level BPE splits the emoji
    d = IncrementalDetokenizer(tok)
    outs = [d.add(t) for t in ids]
    assert outs[:-1] == [None] * (len(ids) - 1)
    assert outs[-1] == "🎉"


@SETTINGS
@given(data=st.data(), text=TEXT)
def test_detokenizer_equals_whole_decode(tok, data, text):
    ids = tok.encode(text, add_special_tokens=False)
    prompt = tok.encode(data.draw(TEXT), add_special_tokens=False)
    pieces = detok_stream(tok, ids, prompt)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)


@SETTINGS
@given(ids=st.lists(st.integers(0, 8191), max_size=30))
def test_detokenizer_random_ids_equal_whole_decode(tok, ids):
    # arbitrary ids: broken byte sequences included; the stream must still match decode()
    assert "".join(detok_stream(tok, ids)) == tok.decode(ids, skip_special_tokens=True)


def test_special_tokens_skipped(tok):
    ids = tok.encode("hi", add_special_tokens=False) + [1, 2]
    assert "".join(detok_stream(tok, ids)) == "hi"


def test_token_vocab_bytes_roundtrip(tok, vocab):
    ids = tok.encode("héllo 世界 🎉 def f(x):\n    return", add_special_tokens=False)
    raw = b"".join(vocab.token_bytes(t) for t in ids)
    assert raw.decode("utf-8") == "héllo 世界 🎉 def f(x):\n    return"
    partial = [t for t in ids if vocab.token_str(t).startswith("bytes:")]
    assert partial, "some emoji/CJK tokens are partial UTF-8"
    assert vocab.token_str(2) == "<|im_end|>"


# -- stop strings ----------------------------------------------------------------------------


def reference_cut(text: str, stops: list[str], include: bool = False) -> str:
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
            best = (i + len(s), i)
    if best is None:
        return text
    return text[: best[0]] if include else text[: best[1]]


def run_matcher(parts, stops, include=False):
    m = StopMatcher(stops, include_stop=include)
    emitted = []
    for p in parts:
        emitted.append(m.push(p))
        if m.matched:
            break
    emitted.append(m.flush())
    return "".join(emitted), m


def test_stop_holdback_example():
    m = StopMatcher(["###"])
    assert m.push("a #") == "a "
    assert m.push("#") == ""
    assert m.push("#b") == ""
    assert m.matched == "###"
    m = StopMatcher(["###"])
    assert m.push("a ##") == "a "
    assert m.push("x") == "##x"  # not a stop after all: released
    assert m.flush() == ""


@SETTINGS
@given(data=st.data(), text=TEXT, include=st.booleans())
def test_stop_strings_split_anywhere(data, text, include):
    # stops: substrings of the text (so they do match) and random strings
    stops = []
    for _ in range(data.draw(st.integers(0, 3))):
        if text and data.draw(st.booleans()):
            i = data.draw(st.integers(0, len(text) - 1))
            j = data.draw(st.integers(i + 1, min(len(text), i + 6)))
            stops.append(text[i:j])
        else:
            stops.append(data.draw(TEXT.filter(bool)))
    cuts = data.draw(split_points(len(text)))
    out, _ = run_matcher(chunks(text, cuts), stops, include)
    assert out == reference_cut(text, stops, include)


# -- the whole pipeline: tokens → text + logprobs, any event split ---------------------------


def pipeline_run(tok, ids, events_cuts, stops, logprobs=True, finish="length"):
    spec = ChoiceSpec(0, "r", [5, 6], SamplingParams(logprobs=logprobs), stop=stops)
    p = TextPipeline(tok, spec, eos_token_ids=(2,))
    text, entries = [], []
    parts = chunks(ids, events_cuts)
    for k, part in enumerate(parts):
        last = k == len(parts) - 1
        t, e = p.feed(part, [-1.0 * x for x in part], None, finish if last else None)
        text.append(t)
        entries.extend(e)
        if p.stopped:
            break
    return "".join(text), entries, p


@SETTINGS
@given(data=st.data(), text=TEXT)
def test_pipeline_split_invariant_with_stops(tok, vocab, data, text):
    ids = tok.encode(text, add_special_tokens=False)
    whole = tok.decode(ids)
    stops = []
    if whole and data.draw(st.booleans()):
        i = data.draw(st.integers(0, len(whole) - 1))
        stops.append(whole[i : i + data.draw(st.integers(1, 4))])
    out, entries, p = pipeline_run(tok, ids, data.draw(split_points(len(ids))), stops)
    ref_text, ref_entries, _ = pipeline_run(tok, ids, [], stops)
    assert out == ref_text == reference_cut(whole, stops)
    assert [(e.token_id, e.offset) for e in entries] == [
        (e.token_id, e.offset) for e in ref_entries
    ]
    # logprob entries cover exactly the text that was emitted, in order
    covered = b"".join(vocab.token_bytes(e.token_id) for e in entries).decode("utf-8", "replace")
    assert covered.startswith(out)
    assert [e.offset for e in entries] == sorted(e.offset for e in entries)
    if not stops or not p.stopped:
        assert len(entries) == len(ids)


def test_stop_string_split_across_tokens_never_leaks(tok):
    text = "x = 1\nEND_OF_IT more"
    ids = tok.encode(text, add_special_tokens=False)
    spec = ChoiceSpec(0, "r", [5], SamplingParams(), stop=["END_OF"])
    p = TextPipeline(tok, spec)
    seen = ""
    for t in ids:
        out, _ = p.feed([t])
        seen += out
        assert "E" not in seen
        if p.stopped:
            break
    assert p.stopped and seen == "x = 1\n"


def test_final_eos_token_is_not_text(tok):
    spec = ChoiceSpec(0, "r", [5], SamplingParams(logprobs=True))
    ids = tok.encode("ok", add_special_tokens=False)
    p = TextPipeline(tok, spec, eos_token_ids=(2,))
    text, entries = p.feed([*ids, 2], [-0.5] * (len(ids) + 1), None, "stop")
    assert text == "ok" and len(entries) == len(ids) and p.num_tokens == len(ids)


def test_held_partial_stop_released_at_end(tok):
    spec = ChoiceSpec(0, "r", [5], SamplingParams(), stop=["abc"])
    p = TextPipeline(tok, spec)
    ids = tok.encode("xyab", add_special_tokens=False)
    out1, _ = p.feed(ids)
    assert out1 == "xy"
    out2, _ = p.feed([], None, None, "length")
    assert out2 == "ab"


def test_infinite_logprobs_become_finite(tok):
    spec = ChoiceSpec(0, "r", [5], SamplingParams(logprobs=True, top_logprobs=2))
    p = TextPipeline(tok, spec)
    ids = tok.encode("ok", add_special_tokens=False)
    tops = [[(t, float("-inf")), (3, float("nan"))] for t in ids]
    _, entries = p.feed(ids, [float("-inf")] * len(ids), tops, "length")
    assert all(e.logprob == -9999.0 for e in entries)
    assert all(v == -9999.0 for e in entries for _, v in e.top)
