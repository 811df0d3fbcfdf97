"""Exact tier: greedy output with speculation equals greedy output without it, token for token.

On tiny random models (sliding window 24, so short generations wrap the rings many times; a
recurrent hybrid) and on the bundled tinycoder-16m with its draft model, for the draft-model
and the n-gram drafter, one request alone and several batched (joining mid-decode, with and
without speculation in the same batch), and 420-token generations far past the 256-token window.
Speculation is forced on (`adaptive=False`: the ceiling every step) so every step verifies.
"""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from engine.api import Request, SamplingParams
from engine.core import Engine, EngineConfig
from engine.kv import batch as kvb
from engine.scheduler import SchedulerConfig
from engine.spec import SpecConfig
from tests.tiny_models import Collected, assert_same_greedy, greedy, loaded, submit, tiny_model


def _engine(lm, spec: SpecConfig | None, **sched) -> Engine:
    eng = Engine(lm, EngineConfig(SchedulerConfig(**sched), spec=spec))
    eng.start()
    return eng


def _run(eng: Engine, reqs: list[Request], stagger: bool) -> dict[str, Collected]:
    """Submit `reqs`; with `stagger`, the second half joins while the first half decodes."""
    half = len(reqs) // 2
    first, rest = (reqs[:half], reqs[half:]) if stagger and half else (reqs, [])
    outs = {r.req_id: submit(eng, r) for r in first}
    for r in rest:
        lead = outs[first[0].req_id]
        for _ in range(400):
            if len(lead.tokens) >= 4 or lead.done.is_set():
                break
            lead.done.wait(0.01)
        outs[r.req_id] = submit(eng, r)
    for r in reqs:
        assert outs[r.req_id].done.wait(600), r.req_id
    return outs


def _outputs(lm, spec, reqs, stagger=True, **sched) -> tuple[dict[str, list[int]], dict]:
    eng = _engine(lm, spec, **sched)
    try:
        outs = _run(eng, reqs, stagger)
        stats = eng.stats()
        assert stats.num_running == 0 and stats.kv_bytes == 0
        return {k: v.tokens for k, v in outs.items()}, stats.spec
    finally:
        eng.stop()


def _perturbed(model, cfg, scale: float, seed: int):
    """A draft model: the target's weights plus noise (same vocabulary, imperfect agreement)."""
    draft, _ = tiny_model(cfg["model_type"])
    rng = np.random.default_rng(seed)
    params = [
        (k, v + mx.array(rng.normal(size=v.shape).astype(np.float32)) * scale * float(mx.std(v)))
        for k, v in tree_flatten(model.parameters())
    ]
    draft.update(tree_unflatten(params))
    mx.eval(draft.parameters())
    return draft


def _repetitive_prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    """Prompts with repeated stretches, so n-gram lookup finds matches."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        motif = [rng.randrange(3, vocab) for _ in range(rng.randint(4, 9))]
        noise = [rng.randrange(3, vocab) for _ in range(rng.randint(0, 12))]
        out.append((motif * 3 + noise + motif)[: rng.randint(12, 40)])
    return out


def _check(lm, spec: SpecConfig, reqs: list[Request], want=None, min_accept=0.0, **sched):
    """Speculative outputs == plain outputs (`want`, computed here if not given)."""
    if want is None:
        want, _ = _outputs(lm, None, reqs, **sched)
    got, stats = _outputs(lm, spec, reqs, **sched)
    for r in reqs:
        assert_same_greedy(lm, r, got[r.req_id], want[r.req_id])
        assert len(want[r.req_id]) == r.params.max_tokens
    st = stats
    assert st.method == spec.method
    assert st.spec_steps > 0 and st.drafted_tokens > 0
    assert st.acceptance_rate >= min_accept, st
    return st


def exact_tier(lm, reqs: list[Request], want=None, prefill_chunk: int = 32):
    """The exact tier of a model as installed: each request run alone, all of them batched
    (equal to the alone ones, and to `want` when given), and greedy n-gram speculation (equal
    to `want`, else to the alone ones); returns the speculation stats."""
    alone: dict[str, list[int]] = {}
    for r in reqs:
        out, _ = _outputs(lm, None, [r], prefill_chunk=prefill_chunk)
        alone.update(out)
    batched, _ = _outputs(lm, None, reqs, stagger=False, prefill_chunk=prefill_chunk)
    st = _check(lm, SpecConfig("ngram", num_draft_tokens=4, adaptive=False), reqs,
                want if want is not None else alone, prefill_chunk=prefill_chunk)
    for r in reqs:
        assert batched[r.req_id] == alone[r.req_id], r.req_id
        if want is not None:
            assert alone[r.req_id] == want[r.req_id], r.req_id
    return st


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "qwen3"])
def test_tiny_greedy_spec_equals_plain(arch):
    model, cfg = tiny_model(arch)
    lm = loaded(model, cfg)
    prompts = _repetitive_prompts(cfg["vocab_size"], 6, seed=3)
    reqs = [greedy(f"r{i}", p, max_tokens=20 + 9 * i) for i, p in enumerate(prompts)]
    want, _ = _outputs(lm, None, reqs, prefill_chunk=32)
    draft = _perturbed(model, cfg, 0.01, seed=1)
    spec = SpecConfig("draft", draft_model=draft, num_draft_tokens=3, adaptive=False)
    st = _check(lm, spec, reqs, want, min_accept=0.2, prefill_chunk=32)
    assert st.tokens_per_row_round > 1.2
    # n-gram: a 16-token vocabulary, whose greedy outputs repeat themselves, so lookups hit
    # while decoding (the first token comes from the prefill, before any lookup)
    model, cfg = tiny_model(arch, vocab_size=16)
    lm = loaded(model, cfg)
    prompts = _repetitive_prompts(cfg["vocab_size"], 6, seed=3)
    reqs = [greedy(f"r{i}", p, max_tokens=20 + 9 * i) for i, p in enumerate(prompts)]
    spec = SpecConfig("ngram", num_draft_tokens=4, adaptive=False)
    _check(lm, spec, reqs, prefill_chunk=32)


def test_tiny_spec_rows_with_and_without_drafts_share_a_batch():
    """Sampled rows (seeded), greedy rows, a row under a repetition penalty and rows about to
    finish (max_tokens 1-2: no room for drafts) decode together; n-gram verification emits
    what the plain sampler would draw, so even the sampled rows match plain decoding. (A
    16-token vocabulary: outputs repeat themselves, so lookups hit while decoding.)"""
    model, cfg = tiny_model("llama", vocab_size=16)
    lm = loaded(model, cfg)
    prompts = _repetitive_prompts(cfg["vocab_size"], 6, seed=5)
    params = [
        SamplingParams(temperature=0.0, max_tokens=60),
        SamplingParams(temperature=1.0, seed=11, max_tokens=50),
        SamplingParams(temperature=0.7, top_k=20, seed=12, max_tokens=45),
        SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=40),
        SamplingParams(temperature=0.0, max_tokens=1),
        SamplingParams(temperature=0.9, top_p=0.9, seed=13, max_tokens=2),
    ]
    reqs = [Request(f"r{i}", p, params[i]) for i, p in enumerate(prompts)]
    _check(lm, SpecConfig("ngram", num_draft_tokens=4, adaptive=False), reqs, prefill_chunk=32)


def test_tiny_recurrent_hybrid_spec_equals_plain():
    """qwen3_next: gated-DeltaNet layers roll back to per-row snapshots."""
    from tests.tiny_archs import TINY_CONFIGS
    from tests.tiny_archs import tiny_model as registry_tiny

    mx.disable_compile()  # compiled helpers JIT per shape on CPU (slow); same answers
    try:
        cfg = dict(TINY_CONFIGS["qwen3_next"], vocab_size=16)  # outputs repeat: lookups hit
        model = registry_tiny("qwen3_next", seed=2, vocab_size=16)
        lm = loaded(model, cfg)
        prompts = _repetitive_prompts(cfg["vocab_size"], 3, seed=7)
        reqs = [greedy(f"r{i}", p, max_tokens=24) for i, p in enumerate(prompts)]
        spec = SpecConfig("ngram", num_draft_tokens=3, adaptive=False)
        _check(lm, spec, reqs, prefill_chunk=32)
    finally:
        mx.enable_compile()


def test_stop_token_and_max_tokens_cut_accepted_drafts():
    """A stop id inside an accepted run ends the row there (not emitted); max_tokens is exact."""
    model, cfg = tiny_model("llama")
    lm = loaded(model, cfg)
    prompt = _repetitive_prompts(cfg["vocab_size"], 1, seed=9)[0]
    plain, _ = _outputs(lm, None, [greedy("a", prompt, max_tokens=80)])
    ref = plain["a"]
    stop = ref[37]
    first = ref.index(stop)
    spec = SpecConfig(
        "draft",
        draft_model=_perturbed(model, cfg, 0.02, seed=3),
        num_draft_tokens=4,
        adaptive=False,
    )
    reqs = [greedy("stop", prompt, 80, stop_token_ids=(stop,))] + [
        greedy(f"len{n}", prompt, n) for n in (5, 13, 22)
    ]
    got, _ = _outputs(lm, spec, reqs, stagger=False)
    assert got["stop"] == ref[:first]
    for n in (5, 13, 22):
        assert got[f"len{n}"] == ref[:n]


# -- the bundled model with its draft model -------------------------------------------------

LONG = 420  # far past the 256-token sliding window (mlx-lm 0.32.2 departs at ~261)
JOIN_AT = 280  # the long row decodes alone past the window, then three rows join it


@pytest.fixture(scope="module")
def tinycoder(tinycoder_path):
    from engine.loader import load_model

    lm = load_model(str(tinycoder_path), dtype="float32")
    lm.eos_token_ids = ()  # run every row to its max_tokens
    return lm


@pytest.fixture(scope="module")
def tinycoder_requests(tinycoder):
    tok = tinycoder.tokenizer
    texts = [
        "def parse_args(argv):",
        "class Stack:\n    def __init__(self):",
        "import os\n\ndef walk(root):",
        "def fib(n):",
    ]
    lengths = [LONG, 70, 50, 40]
    return [
        greedy(f"t{i}", tok.encode(t), n)
        for i, (t, n) in enumerate(zip(texts, lengths, strict=True))
    ]


def _alone_then_batched(lm, spec, reqs) -> tuple[dict[str, list[int]], dict]:
    eng = _engine(lm, spec, prefill_chunk=128)
    try:
        outs = {reqs[0].req_id: submit(eng, reqs[0])}
        lead = outs[reqs[0].req_id]
        while len(lead.tokens) < JOIN_AT and not lead.done.is_set():
            lead.done.wait(0.02)
        for r in reqs[1:]:
            outs[r.req_id] = submit(eng, r)
        for r in reqs:
            assert outs[r.req_id].done.wait(600), r.req_id
        return {k: v.tokens for k, v in outs.items()}, eng.stats().spec
    finally:
        eng.stop()


@pytest.fixture(scope="module")
def tinycoder_plain(tinycoder, tinycoder_requests):
    return _alone_then_batched(tinycoder, None, tinycoder_requests)[0]


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_tinycoder_spec_equals_plain_alone_and_batched(
    method, tinycoder, tinycoder_requests, tinycoder_plain, request
):
    draft = str(request.getfixturevalue("draft_model_path")) if method == "draft" else None
    spec = SpecConfig(method, draft_model=draft, num_draft_tokens=4, adaptive=False)
    got, stats = _alone_then_batched(tinycoder, spec, tinycoder_requests)
    for r in tinycoder_requests:
        assert len(got[r.req_id]) == r.params.max_tokens
        assert_same_greedy(tinycoder, r, got[r.req_id], tinycoder_plain[r.req_id])
    st = stats
    assert st.method == method
    assert st.spec_steps > 0
    if method == "draft":  # the draft model's tokens are mostly accepted on code
        assert st.acceptance_rate > 0.4, st
        assert st.tokens_per_row_round > 2.0, st


def test_drafts_stopped_by_their_price_keep_greedy_exact(
    tinycoder, tinycoder_requests, tinycoder_plain, draft_model_path, monkeypatch
):
    """Every step speculates with each draft past the first priced at 0.8 expected tokens a row:
    the draft model stops a round where its rows' chances fall below that, the round verifies
    only the drafts kept, and greedy output stays plain's, alone and batched."""
    from engine.spec import adaptive

    def decide(self, caps, priced=False):
        assert priced  # greedy rows and a draft model: the drafter prices its drafts
        top = int(caps.max(initial=0)) + 1
        need = np.r_[0.0, np.full(max(top - 2, 0), 0.8 * len(caps))]
        return adaptive.Decision(top, caps, min_gain=need if top > 1 else None)

    monkeypatch.setattr(adaptive.Controller, "decide", decide)
    spec = SpecConfig("draft", draft_model=str(draft_model_path), num_draft_tokens=6)
    got, st = _alone_then_batched(tinycoder, spec, tinycoder_requests)
    for r in tinycoder_requests:
        assert_same_greedy(tinycoder, r, got[r.req_id], tinycoder_plain[r.req_id])
    rounds = st.spec_steps
    assert 0 < st.drafter["stopped_rounds"] < rounds, st
    assert st.drafter["draft_steps"] < 6 * rounds and st.mean_verify_width < 7, st


def test_adaptive_switching_between_plain_and_spec_keeps_greedy_exact():
    """The adaptive controller drains the pipeline into speculative steps and back (probes
    every few steps here); draft state catches up after plain stretches. Output unchanged."""
    model, cfg = tiny_model("llama")
    lm = loaded(model, cfg)
    prompts = _repetitive_prompts(cfg["vocab_size"], 4, seed=11)
    reqs = [greedy(f"r{i}", p, max_tokens=40 + 10 * i) for i, p in enumerate(prompts)]
    want, _ = _outputs(lm, None, reqs, prefill_chunk=32)
    for method in ("draft", "ngram"):
        draft = _perturbed(model, cfg, 0.01, seed=2) if method == "draft" else None
        # unigram matches too, so that a random model's output finds proposals
        spec = SpecConfig(method, draft_model=draft, num_draft_tokens=3, ngram_min=1)
        eng = _engine(lm, spec, prefill_chunk=32)
        cfg = eng.spec.controller.config
        cfg.min_gap = cfg.max_gap = 3  # probe every few steps
        cfg.budget = 1.0  # as often as due
        try:
            outs = _run(eng, reqs, stagger=True)
            st = eng.stats().spec
        finally:
            eng.stop()
        for r in reqs:
            assert_same_greedy(lm, r, outs[r.req_id].tokens, want[r.req_id], (method, r.req_id))
        assert st.spec_steps > 0 and st.plain_steps > 0, st


def test_sampled_rows_with_a_draft_model_end_to_end():
    """Temperature > 0 through the engine with a draft model (rejection sampling): filters,
    penalties and logprobs per emitted token; a seeded request reproduces itself."""
    model, cfg = tiny_model("llama")
    lm = loaded(model, cfg)
    draft = _perturbed(model, cfg, 0.05, seed=4)
    prompt = _repetitive_prompts(cfg["vocab_size"], 1, seed=13)[0]
    params = SamplingParams(
        temperature=0.8,
        top_k=40,
        top_p=0.95,
        repetition_penalty=1.1,
        seed=7,
        max_tokens=40,
        logprobs=True,
        top_logprobs=3,
    )
    spec = SpecConfig("draft", draft_model=draft, num_draft_tokens=3, adaptive=False)
    runs = []
    for _ in range(2):
        eng = _engine(lm, spec)
        try:
            out = _run(eng, [Request("s", list(prompt), params)], stagger=False)["s"]
            st = eng.stats().spec
        finally:
            eng.stop()
        runs.append(out.tokens)
        assert len(out.tokens) == 40 and st.spec_steps > 0 and st.accepted_tokens > 0
        for ev in out.events:
            assert len(ev.logprobs) == len(ev.token_ids) == len(ev.top_logprobs)
            assert all(lp <= 0 for lp in ev.logprobs)
            assert all(len(t) == 3 for t in ev.top_logprobs)
        assert any(len(ev.token_ids) > 1 for ev in out.events)  # drafts were accepted
    assert runs[0] == runs[1]


def test_sampled_distribution_end_to_end_matches_the_model():
    """T = 1 on an 8-token vocabulary, a (deliberately poor) draft model, 3,000 seeded requests:
    the first token comes from the prefill and the second from the plain step the rows join
    the batch in, so the third and fourth are the first verify round's; their joint follows
    the target's own marginal p(x2, x3) = sum over (x0, x1) of p(x0) p(x1 | x0) p(x2 | x0 x1)
    p(x3 | x0 x1 x2) (chi-square over the 64 cells)."""
    from scipy.stats import chisquare

    model, cfg = tiny_model("llama", vocab_size=8)
    lm = loaded(model, cfg)
    draft = _perturbed(model, cfg, 0.5, seed=5)
    prompt = [1, 5, 2, 7, 3, 1, 5]

    def probs(prefixes: np.ndarray) -> np.ndarray:
        """[N, 8]: p(next | prompt + prefix) for every row of `prefixes` [N, k]."""
        ids = np.concatenate([np.tile(prompt, (len(prefixes), 1)), prefixes], axis=1)
        logits = model(mx.array(ids.astype(np.int32)))[:, -1].astype(mx.float32)
        return np.array(mx.softmax(logits, axis=-1))

    grid = [np.zeros((1, 0), np.int64)]  # every prefix (x0 .. x_k-1) of length k, in order
    grid += [np.array(list(np.ndindex(*(8,) * k)), dtype=np.int64) for k in range(1, 4)]
    joint = probs(grid[0]).reshape(8)  # p(x0), then p(x0 .. x_k) over the grid
    for k in range(1, 4):
        joint = (joint[:, None] * probs(grid[k])).reshape(-1)
    want = joint.reshape(64, 64).sum(axis=0)  # marginal over (x0, x1): cells x2 * 8 + x3
    n = 3000
    spec = SpecConfig("draft", draft_model=draft, num_draft_tokens=2, adaptive=False)
    eng = _engine(lm, spec, max_num_seqs=256, max_queue=4096)
    try:
        reqs = [
            Request(f"r{i}", list(prompt), SamplingParams(temperature=1.0, seed=i, max_tokens=4))
            for i in range(n)
        ]
        outs = _run(eng, reqs, stagger=False)
        st = eng.stats().spec
    finally:
        eng.stop()
    quads = np.array([outs[r.req_id].tokens for r in reqs])
    observed = np.bincount(quads[:, 2] * 8 + quads[:, 3], minlength=64)
    keep = want * n >= 1
    obs = observed[keep].astype(np.float64)
    exp = want[keep].astype(np.float64)
    stat, pvalue = chisquare(obs, exp / exp.sum() * obs.sum())
    assert pvalue > 1e-3, (stat, pvalue)
    assert 0.05 < st.acceptance_rate < 0.95, st  # both outcomes of the rule happened


class _CountingModel:
    """A model wrapper that counts forwards (the draft model's work while idle)."""

    def __init__(self, model) -> None:
        self.model, self.calls = model, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.model(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_idle_draft_model_does_no_work_then_catches_up_past_the_window():
    """While the controller decodes plainly the draft model runs no forward (no prefill at
    admission, no per-token feed); when speculation starts again it catches up in one chunked
    forward on everything the row decoded meanwhile — here 90 tokens, far past the draft's own
    24-token ring — and the output stays exactly plain greedy decoding's."""
    model, cfg = tiny_model("llama")
    lm = loaded(model, cfg)
    prompt = _repetitive_prompts(cfg["vocab_size"], 1, seed=21)[0]
    reqs = [greedy("r0", prompt, max_tokens=130)]
    want, _ = _outputs(lm, None, reqs, stagger=False)
    draft = _perturbed(model, cfg, 0.01, seed=3)
    eng = _engine(lm, SpecConfig("draft", draft_model=draft, num_draft_tokens=3))
    drafter = eng.spec.drafter
    counter = drafter.model = _CountingModel(drafter.model)
    plain_steps = 90
    seen: dict[str, int] = {}
    decide = eng.spec.decide

    decisions = [0]  # counted here: stats() is a snapshot the engine publishes now and then

    def forced(batch):  # plain for `plain_steps` decisions, then speculation (3 drafts) each step
        decisions[0] += 1
        if decisions[0] <= plain_steps:
            decide(batch)  # the controller's own bookkeeping still runs
            return 1
        seen.setdefault("calls_while_idle", counter.calls)
        seen.setdefault("fed_while_idle", drafter.num_fed_tokens)
        return 4

    eng.spec.decide = forced
    try:
        got = _run(eng, reqs, stagger=False)["r0"].tokens
        st = eng.stats().spec
    finally:
        eng.stop()
    assert seen == {"calls_while_idle": 0, "fed_while_idle": 0}, seen
    assert_same_greedy(lm, reqs[0], got, want["r0"])
    assert st.spec_steps > 0 and st.drafter["catch_up_seconds"] > 0, st
    # one catch-up: the prompt and the ~90 plainly decoded tokens, fed once
    assert len(prompt) + plain_steps - 4 <= st.drafter["fed_tokens"] <= len(prompt) + plain_steps + 4, st


def test_draft_kv_is_dropped_while_speculation_is_off_and_rebuilt_exactly():
    """Speculation for 12 steps (the rows' draft KV filled), then the controller's own choice
    at a batch size where it does not speculate: the draft KV is dropped (rows that finish then
    move none of it), and when rounds are forced again the rows catch up from their prompts,
    with every row's output still plain greedy decoding's."""
    model, cfg = tiny_model("llama")
    lm = loaded(model, cfg)
    prompts = _repetitive_prompts(cfg["vocab_size"], 3, seed=5)
    reqs = [greedy(f"r{i}", p, max_tokens=60 + 10 * i) for i, p in enumerate(prompts)]
    want, _ = _outputs(lm, None, reqs, stagger=False)
    eng = _engine(lm, SpecConfig("draft", draft_model=_perturbed(model, cfg, 0.01, seed=3),
                                 num_draft_tokens=3))
    spec = eng.spec
    decide = spec.decide
    steps, held = [0], []

    def forced(batch):  # rounds, then the controller's choice (plain here), then rounds again
        steps[0] += 1
        if 12 < steps[0] <= 30:
            before = max(kvb.num_tokens(batch.spec.drafter_state.layouts))
            width = decide(batch)
            held.append((before, width, spec.controller.warm(len(batch.rows)),
                         max(kvb.num_tokens(batch.spec.drafter_state.layouts))))
            return 1
        return 4

    spec.decide = forced
    try:
        got = {k: v.tokens for k, v in _run(eng, reqs, stagger=False).items()}
        st = eng.stats().spec
    finally:
        eng.stop()
    assert held[0][0] > 0, held  # the rounds before had filled it
    plain = [after for _, w, warm, after in held if w == 1 and not warm]
    assert plain and plain[-1] == 0, held  # dropped once the choice held plain
    for r in reqs:
        assert_same_greedy(lm, r, got[r.req_id], want[r.req_id])
    assert st.spec_steps > 12 and st.drafter["catch_up_seconds"] > 0, st


def test_flat_costs_take_the_lookup_offer_in_the_engine(tinycoder, monkeypatch):
    """Step times are replaced by a flat-cost device's (a plain step 1 ms, any verify 2 ms, as
    on MLX-CUDA), so W = 2 never pays: the controller's probe of the widest width the rows fill
    finds that wide verifies of the n-gram's offer do, and greedy output stays plain's."""
    from engine.spec import adaptive

    record = adaptive.Controller.record

    def flat(self, num_rows, width, seconds, typical, emitted=1.0, drafter=0.0):
        seconds = 0.001 if width == 1 else 0.002
        return record(self, num_rows, width, seconds, typical, emitted, drafter)

    monkeypatch.setattr(adaptive.Controller, "record", flat)
    tok = tinycoder.tokenizer
    src = "def area(w, h):\n    total = w * h\n    if total < 0:\n        raise ValueError('negative')\n    return total\n\n"
    text = src + "# the same function, renamed to size:\n" + src.replace("area", "size")[:40]
    reqs = [greedy("e0", tok.encode(text), 60)]
    want, _ = _outputs(tinycoder, None, reqs, prefill_chunk=128)
    got, stats = _outputs(tinycoder, SpecConfig("ngram", num_draft_tokens=8), reqs, prefill_chunk=128)
    assert got == want
    st = stats
    widths = [int(k.split("x")[1]) for k in st.step_ms]
    assert st.spec_steps > 0 and max(widths) >= 6, st


def test_a_lookup_miss_while_speculation_pays_reads_the_next_step_first(tinycoder, monkeypatch):
    """While n-gram speculation pays (a verify of W columns costs 1 + 0.085 (W - 1) plain
    steps, as on a bandwidth-bound target), a step whose lookup found
    nothing is decoded synchronously: nothing is left in flight after it, so the next lookup
    sees the token it produced (a copied stretch is verified from the step after it starts,
    not a step later). Greedy output stays plain's."""
    from engine import runner as runner_mod
    from engine.spec import adaptive

    record = adaptive.Controller.record

    def flat(self, num_rows, width, seconds, typical, emitted=1.0, drafter=0.0):
        seconds = 0.001 * (1 + 0.085 * (width - 1))
        return record(self, num_rows, width, seconds, typical, emitted, drafter)

    monkeypatch.setattr(adaptive.Controller, "record", flat)
    synced: list[bool] = []
    run = runner_mod.Runner.run

    def watched(self, plan):
        result = run(self, plan)
        if self.spec.sync_plain and result.width == 1:
            synced.append(self._inflight is None)
        return result

    monkeypatch.setattr(runner_mod.Runner, "run", watched)
    tok = tinycoder.tokenizer
    src = "def area(w, h):\n    total = w * h\n    if total < 0:\n        raise ValueError('negative')\n    return total\n\n"
    text = src + "# the same function, renamed to size:\n" + src.replace("area", "size")[:40]
    reqs = [greedy("e0", tok.encode(text), 160)]  # on past the copy: misses
    want, _ = _outputs(tinycoder, None, reqs, prefill_chunk=128)
    got, stats = _outputs(tinycoder, SpecConfig("ngram", num_draft_tokens=8), reqs,
                          prefill_chunk=128)
    assert got == want and stats.spec_steps > 0
    assert synced and all(synced), synced


def test_a_step_in_which_rows_leave_the_batch_is_not_a_cost_sample(monkeypatch):
    """The controller's cost cells hold typical steps only: a step after which rows left the
    batch (their slots refilled by moving other rows, once-off work that may wait for the step
    in flight) is recorded as not typical, in plain decoding and in verify steps alike."""
    from engine.spec import adaptive

    model, cfg = tiny_model("llama")
    lm = loaded(model, cfg)
    calls: list[tuple[int, bool]] = []
    record = adaptive.Controller.record

    def watched(self, num_rows, width, seconds, typical, emitted=1.0, drafter=0.0):
        calls.append((num_rows, typical))
        return record(self, num_rows, width, seconds, typical, emitted, drafter)

    monkeypatch.setattr(adaptive.Controller, "record", watched)
    prompts = _repetitive_prompts(cfg["vocab_size"], 4, seed=5)
    reqs = [greedy(f"r{i}", p, 6 + 5 * i) for i, p in enumerate(prompts)]
    _outputs(lm, SpecConfig("ngram", num_draft_tokens=4), reqs, stagger=False)
    drops = [i for i in range(len(calls) - 1) if calls[i + 1][0] < calls[i][0]]
    assert len(drops) >= 2, calls
    assert not any(calls[i][1] for i in drops), calls
    assert any(typical for _, typical in calls), calls


def _with_prediction(req: Request, prediction: list[int] | None) -> Request:
    req.prediction_ids = prediction
    return req


@pytest.mark.parametrize("adaptive", [False, True])
def test_a_predicted_output_is_copied_into_drafts_and_the_output_is_plain_greedy(adaptive):
    """A request's predicted output (OpenAI's `prediction`) is what an n-gram drafter copies
    first: the output stays plain greedy's, and the prediction's accepted tokens reach the
    last event (all but one a round when the prediction is the answer; an edited prediction
    rejoins after the edit). Without speculation a prediction changes nothing."""
    model, cfg = tiny_model("llama")
    lm = loaded(model, cfg)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, cfg["vocab_size"], 12).tolist() for _ in range(3)]
    reqs = [greedy(f"p{i}", p, 40) for i, p in enumerate(prompts)]
    want, _ = _outputs(lm, None, reqs, stagger=False)
    edited = {k: v[:10] + [(t + 1) % cfg["vocab_size"] for t in v[10:13]] + v[13:]
              for k, v in want.items()}
    for preds, least in ((want, 28), (edited, 20)):
        spec = SpecConfig("ngram", num_draft_tokens=4, adaptive=adaptive)
        eng = _engine(lm, spec)
        try:
            outs = _run(eng, [_with_prediction(greedy(r.req_id, r.prompt_ids, 40), preds[r.req_id])
                              for r in reqs], stagger=False)
            spec_stats = eng.stats().spec
        finally:
            eng.stop()
        for r in reqs:
            out = outs[r.req_id]
            assert out.tokens == want[r.req_id]
            if not adaptive:  # forced: every round verifies the prediction's next tokens
                assert out.events[-1].accepted_prediction >= least, (r.req_id, out.events[-1])
        assert spec_stats.spec_steps > 0 or adaptive
    eng = _engine(lm, None)
    try:
        outs = _run(eng, [_with_prediction(greedy(r.req_id, r.prompt_ids, 40), want[r.req_id])
                          for r in reqs], stagger=False)
    finally:
        eng.stop()
    assert {k: v.tokens for k, v in outs.items()} == want
    assert all(o.events[-1].accepted_prediction == 0 for o in outs.values())
