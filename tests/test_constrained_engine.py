"""Constrained decoding in the engine: grammar masks on a shared batch, exactly.

- constrained and free rows in one batch produce, row for row, what each produces alone;
- a constrained row ends ("stop") when its grammar completes, and its text matches the grammar
  (tests/test_agents_real.py checks 20 seeds of strict json_schema over HTTP);
- a bad spec is refused by Engine.add with a 400 and a reason, before anything is queued.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from bench.spec import RECORD  # noqa: E402
from engine.api import EngineError, Request, SamplingParams  # noqa: E402
from engine.constrain import (  # noqa: E402
    allowed_from_bitmask,
    compile_constraint,
    fill_masks,
    new_bitmask,
)
from tests.tiny_models import make_engine, run_alone, submit  # noqa: E402

PERSON = RECORD  # a record of five typed fields (the bench's json workload holds answers to it)

# no finite JSON value matches: the grammar engine's forced output never ends
ENDLESS = {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}


@pytest.fixture(scope="module")
def tinycoder(tinycoder_path):
    from engine.loader import load_model

    return load_model(str(tinycoder_path), dtype="float32")


def _prompt(lm, text: str) -> list[int]:
    return lm.tokenizer.encode(text, add_special_tokens=False)


def test_bitmask_unpacks_to_allowed_tokens():
    bm = new_bitmask(2, 70)
    bm[0, :] = 0
    bm[0, 0] = 0b101  # tokens 0 and 2
    bm[0, 2] = np.int32(-(2**31))  # bit 31 of word 2 = token 95 (beyond vocab 70: cut off)
    bm[0, 1] = 1 << 3  # token 35
    allowed = np.array(allowed_from_bitmask(bm, 70))
    assert allowed.shape == (2, 70)
    assert np.flatnonzero(allowed[0]).tolist() == [0, 2, 35]
    assert allowed[1].all()


def test_matcher_follows_schema(tinycoder):
    tok = tinycoder.tokenizer
    c = compile_constraint({"type": "json_schema", "schema": PERSON}, tok, tinycoder.vocab_size,
                           tinycoder.eos_token_ids)
    good = '{"name": "Ada", "age": 36, "language": "rust", "tags": ["x"], "active": true}'
    ids = tok.encode(good, add_special_tokens=False)
    assert all(c.consume(t) for t in ids[:-1]) and not c.is_done()
    assert c.consume(ids[-1]) and c.is_done()
    c2 = compile_constraint({"type": "json_schema", "schema": PERSON}, tok, tinycoder.vocab_size,
                            tinycoder.eos_token_ids)
    bad = tok.encode('{"name": 5', add_special_tokens=False)
    assert not all(c2.consume(t) for t in bad)


@pytest.mark.parametrize(
    "spec, reason",
    [
        ({"type": "json_schema", "schema": {"type": "objectx"}}, "objectx"),
        ({"type": "json_schema", "schema": {"type": "string", "pattern": "(("}}, "unclosed group"),
        ({"type": "json_schema", "schema": {"$ref": "#/defs/nope"}}, "nope"),
        ({"type": "json_schema", "schema": {"type": "string", "format": "weird"}}, "weird"),
        ({"type": "json_schema", "schema": 3}, "JSON Schema object"),
        ({"type": "regex", "pattern": "[a-"}, "regex"),
        ({"type": "lark", "grammar": "start: missing_rule"}, "missing_rule"),
        ({"type": "tool_calls", "tools": []}, "non-empty"),
        ({"type": "yaml"}, "unknown constraint type"),
        # limits the grammar engine only meets while parsing: found when the spec is compiled
        ({"type": "json_schema", "schema": ENDLESS}, "refers back to its own object"),
        ({"type": "regex", "pattern": "(x{1000}){1000}"}, "regular expression"),
    ],
)
def test_bad_spec_is_a_400_before_queuing(tinycoder, spec, reason):
    eng = make_engine(tinycoder)
    try:
        req = Request("bad", _prompt(tinycoder, "x = "), SamplingParams(max_tokens=4, constraint=spec))
        with pytest.raises(EngineError) as err:
            eng.add(req, lambda events: None)
        assert err.value.status == 400
        assert reason in err.value.message
        assert len(err.value.message) <= 400 and "<state>" not in err.value.message
        assert eng.stats().num_waiting == 0
    finally:
        eng.stop()


def _mixed_requests(lm) -> list[Request]:
    prompts = ["def parse_args(argv):", "import os\nimport sys", "class Stack:", "x = [1, 2, 3]",
               "# a JSON config", "def main():"]
    specs = [
        {"type": "json_schema", "schema": PERSON},
        None,
        {"type": "regex", "pattern": r"(0|[1-9][0-9]{0,3})(\.[0-9]{1,2})?"},
        None,
        {"type": "json_object"},
        {"type": "json_schema", "schema": PERSON},
    ]
    reqs = []
    for i, (p, spec) in enumerate(zip(prompts, specs, strict=True)):
        # greedy rows and seeded temperature-1 rows, constrained and free, in one batch
        temp = 0.0 if i % 2 == 0 else 1.0
        max_tokens = 20 if spec is None else 60  # the JSON answers are ~30 tokens
        params = SamplingParams(temperature=temp, seed=100 + i, max_tokens=max_tokens, constraint=spec)
        reqs.append(Request(f"m{i}", _prompt(lm, p), params))
    return reqs


def test_constrained_and_free_rows_batched_equal_alone(tinycoder):
    eng = make_engine(tinycoder)
    try:
        reqs = _mixed_requests(tinycoder)
        alone = {r.req_id: run_alone(eng, r) for r in reqs}
        outs = {r.req_id: submit(eng, r) for r in reqs}
        for r in reqs:
            assert outs[r.req_id].done.wait(120)
        for r in reqs:
            got, ref = outs[r.req_id], alone[r.req_id]
            assert got.tokens == ref.tokens, r.req_id
            assert got.finish == ref.finish, r.req_id
        # the constrained rows really are constrained, and the grammar ended them
        for r in reqs:
            text = tinycoder.tokenizer.decode(alone[r.req_id].tokens)
            spec = r.params.constraint
            if spec is None:
                continue
            assert alone[r.req_id].finish == "stop", (r.req_id, text)
            if spec["type"] == "regex":
                import re

                assert re.fullmatch(spec["pattern"], text), text
            else:
                assert isinstance(json.loads(text), dict), text
        assert eng.stats().num_running == 0
    finally:
        eng.stop()


def test_grammar_rows_stay_pipelined_and_draw_what_synchronous_steps_draw(tinycoder):
    """Rows under a grammar decode on the pipelined path, each step masked one token behind;
    where a mask changed under the step in flight the row draws again from its logits. Every
    token, logprob and top logprob equals what an engine that waits for every step before
    masking the next draws, for greedy and sampled rows with filters and penalties; redraws
    that changed a token (so that its next input and penalty history were replaced) happen."""
    from server.tools import HERMES

    tools = [{"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
    lazy = HERMES.constraint(tools, parallel=True, lazy=True)
    # masks that hold still for a while (letters before the digits, free text before a call)
    # and then move (after a digit only digits; a call's opening): the pipelined path's regime
    words = {"type": "regex", "pattern": r"[a-z ]+[0-9]{4}"}
    cases = [
        ("def parse_args(argv):", words,
         dict(temperature=1.0, top_p=0.9, presence_penalty=0.4, repetition_penalty=1.1)),
        ("# a JSON config", words, dict(temperature=0.8, top_k=20, min_p=0.05)),
        ("x = [1, 2, 3]", words, dict(temperature=1.2, frequency_penalty=0.5)),
        ("class Stack:", words, dict(temperature=0.0)),
        ("def main():", words, dict(temperature=1.0)),
        ("import os\nimport sys", None, dict(temperature=1.0, presence_penalty=0.3)),
        ("def add(a, b):", lazy, dict(temperature=0.7, top_p=0.95)),
    ]

    def requests() -> list[Request]:
        return [Request(f"g{i}", _prompt(tinycoder, text), SamplingParams(
            seed=7 + i, max_tokens=50, constraint=spec, logprobs=True, top_logprobs=3, **kw))
            for i, (text, spec, kw) in enumerate(cases)]

    def run(synchronous: bool):
        eng = make_engine(tinycoder)
        if synchronous:  # every plain step read before the next is masked
            eng.runner.spec.sync_plain = True  # type: ignore[union-attr]
        try:
            outs = [submit(eng, r) for r in requests()]
            assert all(o.done.wait(120) for o in outs)
            return outs, eng.runner.redrawn
        finally:
            eng.stop()

    piped, redrawn = run(synchronous=False)
    ref, none = run(synchronous=True)
    assert redrawn > 0 and none == 0
    for (text, _, _), got, want in zip(cases, piped, ref, strict=True):
        assert got.tokens == want.tokens, text
        assert got.finish == want.finish
        lp = [x for e in got.events for x in e.logprobs or []]
        lp_ref = [x for e in want.events for x in e.logprobs or []]
        np.testing.assert_allclose(lp, lp_ref, rtol=0, atol=1e-4)  # batch-shape float drift
        tops = [t for e in got.events for t in e.top_logprobs or []]
        tops_ref = [t for e in want.events for t in e.top_logprobs or []]
        assert [[i for i, _ in t] for t in tops] == [[i for i, _ in t] for t in tops_ref]
    # rows that wrote their digits, after a stretch of letters
    finished = [o.finish for (_, spec, _), o in zip(cases, piped, strict=True) if spec is words]
    assert finished.count("stop") >= 2


def test_constrained_rows_are_masked_when_speculation_is_on(tinycoder):
    """With speculation on, a constrained row shares verify steps with its free batch mates:
    its answer follows the schema while they keep speculating."""
    from engine.core import Engine, EngineConfig
    from engine.scheduler import SchedulerConfig
    from engine.spec import SpecConfig

    eng = Engine(tinycoder, EngineConfig(SchedulerConfig(), spec=SpecConfig(method="ngram", adaptive=False)))
    eng.start()
    try:
        prompt = _prompt(tinycoder, "x = [1, 2, 3]\n" * 6 + "x = [1,")  # repetitive: n-grams draft
        free = submit(eng, Request("free", prompt, SamplingParams(temperature=0.0, max_tokens=60)))
        assert free.done.wait(120)
        steps_before = _spec_steps(eng.stats().spec)
        free = submit(eng, Request("free2", prompt, SamplingParams(temperature=0.0, max_tokens=60)))
        con = submit(eng, Request("con", prompt, SamplingParams(
            temperature=1.0, seed=3, max_tokens=80, constraint={"type": "json_schema", "schema": PERSON})))
        assert con.done.wait(120) and free.done.wait(120)
        text = tinycoder.tokenizer.decode(con.tokens)
        assert con.finish == "stop", (con.finish, text, con.events[-1].error)
        jsonschema.validate(json.loads(text), PERSON)
        assert free.finish in ("stop", "length") and free.tokens
        assert _spec_steps(eng.stats().spec) > steps_before  # the free row speculated meanwhile
    finally:
        eng.stop()


def test_a_verify_masks_each_column_under_the_state_after_the_drafts_before_it(tinycoder):
    """Column 0 is the grammar's mask now; column j its mask after the row's first j drafts,
    as far as the grammar takes them; past a refused draft the column is all ones (the verdict
    stops before it). The grammar is where it was afterwards."""
    from types import SimpleNamespace

    from engine.runner import _draft_masks

    tok, V = tinycoder.tokenizer, tinycoder.vocab_size

    def grammar(tokens):
        c = compile_constraint({"type": "json_schema", "schema": PERSON}, tok, V, tinycoder.eos_token_ids)
        assert all(c.consume(t) for t in tokens)
        return c

    def mask_of(c):
        m = new_bitmask(1, V)
        fill_masks([(c, 0)], m)
        return m[0]

    head = tok.encode('{"name": "Ada", "age": 3', add_special_tokens=False)
    c = grammar(head)
    good = tok.encode('6, "language"', add_special_tokens=False)[:2]
    bad = tok.encode("}", add_special_tokens=False)[0]  # the object cannot close yet
    drafts = np.array([good + [bad, good[0]], [0, 0, 0, 0]], np.int32)
    proposal = SimpleNamespace(host_tokens=drafts, num_drafts=np.array([4, 0]), tokens=None)
    rows = [SimpleNamespace(grammar_mask=None, grammar_mask_at=-1, grammar_steady=False,
                            num_generated=len(head)) for _ in range(2)]
    bitmask, errors, drafted = _draft_masks(_Batch(rows), [(c, 0)], proposal, V, 5)
    assert not errors and drafted and bitmask.shape == (2, 5, new_bitmask(1, V).shape[1])
    assert (bitmask[0, 0] == mask_of(grammar(head))).all()
    assert (bitmask[0, 1] == mask_of(grammar(head + good[:1]))).all()
    assert (bitmask[0, 2] == mask_of(grammar(head + good))).all()
    assert not np.array(allowed_from_bitmask(bitmask[0, 2:3], V))[0, bad]  # refused there
    assert (bitmask[0, 3:] == -1).all() and (bitmask[1] == -1).all()  # past it; a free row
    assert (rows[0].grammar_mask == bitmask[0, 0]).all()  # column 0 noted on its row
    assert (mask_of(c) == bitmask[0, 0]).all() and c.num_consumed == len(head)  # rolled back


class _Batch:
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_constrained_rows_draft_and_decode_what_plain_constrained_decoding_does(tinycoder, method):
    """Speculating, a row under a grammar drafts too, each verify column masked under the
    grammar's state after the drafts before it: greedy, its output is plain constrained
    decoding's token for token, with drafts accepted (n-gram copies the record the prompt
    repeats; the draft model is the target's weights plus noise, its drafts sometimes ones the
    grammar refuses); at temperature 1 (rejection sampling against the masked target for the
    draft model) it still follows the schema."""
    from engine.core import Engine, EngineConfig
    from engine.scheduler import SchedulerConfig
    from engine.spec import SpecConfig

    record = '{"name": "Ada", "age": 36, "language": "rust", "tags": ["x", "y"], "active": true}'
    prompt = _prompt(tinycoder, ("record = " + record + "\n") * 4 + "record = ")
    schema = {"type": "json_schema", "schema": PERSON}
    if method == "ngram":
        speculation = SpecConfig(method="ngram", adaptive=False)
    else:
        speculation = SpecConfig(method="draft", draft_model=_noisy(tinycoder), num_draft_tokens=4,
                                 adaptive=False)
    outs = {}
    for name, spec in (("plain", None), ("spec", speculation)):
        eng = Engine(tinycoder, EngineConfig(SchedulerConfig(), spec=spec))
        eng.start()
        try:
            greedy = run_alone(eng, Request("g", prompt, SamplingParams(
                temperature=0.0, max_tokens=60, constraint=schema)))
            sampled = run_alone(eng, Request("s", prompt, SamplingParams(
                temperature=1.0, seed=5, max_tokens=60, constraint=schema)))
            outs[name] = greedy, sampled, eng.stats().spec
        finally:
            eng.stop()
    (plain, _, _), (spec_greedy, spec_sampled, stats) = outs["plain"], outs["spec"]
    assert plain.finish == "stop" and spec_greedy.tokens == plain.tokens
    jsonschema.validate(json.loads(tinycoder.tokenizer.decode(plain.tokens)), PERSON)
    assert stats.accepted_tokens > 0 and stats.spec_steps > 0
    assert spec_sampled.finish == "stop"
    jsonschema.validate(json.loads(tinycoder.tokenizer.decode(spec_sampled.tokens)), PERSON)


def _noisy(lm):
    """A copy of `lm`'s model with noise on its weights (a draft that mostly agrees)."""
    import copy

    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    model = copy.deepcopy(lm.model)
    mx.random.seed(7)
    model.update(tree_unflatten([(k, v + 0.02 * mx.random.normal(v.shape) if v.ndim > 1 else v)
                                 for k, v in tree_flatten(model.parameters())]))
    mx.eval(model.parameters())
    return model


def _spec_steps(stats) -> int:
    return stats.spec_steps


def test_grammar_engine_errors_are_cut_to_what_the_client_can_act_on():
    from engine.constrain.llg import MAX_REASON, reason

    dump = ("lexer error: too many expressions constructed\n<state>\nTokens: x\nParser: {}\n</state>"
            "<grammar>\n{\"grammars\": []}\n</grammar>")
    assert reason(dump).startswith("a regular expression in the constraint is too complex")
    lark = 'at 1(8): unknown name: "missing_rule"\n   1 | start: missing_rule\n              ^\n'
    assert reason(lark) == 'at 1(8): unknown name: "missing_rule"'
    regex = "regex parse error:\n    [a-\n    ^\nerror: unclosed character class"
    assert reason(regex) == regex  # the caret under the client's own regex stays
    assert len(reason("x" * 5000)) == MAX_REASON


def test_strict_tool_calls_in_text_on_the_bundled_model(tinycoder):
    """The lazy tool-call grammar on real decoding. tinycoder-16m copying calls from its prompt
    writes the opening marker again and again without the grammar; with it, the calls it writes
    are whole and valid, and the output ends at the first repeat. Where the output never opens a
    call, it is the unconstrained output token for token."""
    from server.tools import HERMES

    tools = [{"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}}]
    spec = HERMES.constraint(tools, parallel=True, lazy=True)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    copying = _prompt(tinycoder, "# calls\nlog = '''\n" + call * 3)
    code = _prompt(tinycoder, "def add(a, b):")
    eng = make_engine(tinycoder)
    try:
        def text(req_id: str, prompt: list[int], constraint: dict | None) -> str:
            params = SamplingParams(temperature=0.0, max_tokens=80, constraint=constraint)
            return tinycoder.tokenizer.decode(run_alone(eng, Request(req_id, prompt, params)).tokens)

        free = text("free", copying, None)
        assert free.startswith("<tool_call>\n<tool_call>")  # what the grammar prevents
        calls = text("strict", copying, spec)
        blocks = calls.split("<tool_call>\n")[1:]
        assert calls.startswith("<tool_call>\n") and len(blocks) == 2, calls
        for block in blocks:
            body, _, rest = block.partition("\n</tool_call>")
            assert json.loads(body) == {"name": "get_weather", "arguments": {"city": "Paris"}}
            assert rest in ("", "\n")
        assert text("prose", code, spec) == text("prose-free", code, None)
    finally:
        eng.stop()
