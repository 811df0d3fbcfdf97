"""Exact tier on tiny random models of every registered architecture (float32, greedy).

* our layouts, one row alone == mlx-lm's own single-sequence caches (whole and chunked prefill)
* batched == alone: a right-padded group prefill, rows joining mid-decode (from our one-row
  layouts and from mlx-lm caches), rows leaving (filter)
* speculative rounds (checkpoint, k+1 columns, rollback to the accepted prefix) == plain greedy
* quantized KV (8 and 4 bits): alone == mlx-lm's QuantizedKVCache, batched == alone
* sinks (`keep`) rings == mlx-lm's RotatingKVCache(keep) decoding token by token
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as mlc

from engine.kv import batch as kvb
from engine.models import ARCHITECTURES, layer_templates, make_batch_layouts, prepare_model
from tests.tiny_archs import tiny_model

ARCHS = sorted(ARCHITECTURES)
QUANT_ARCHS = [a for a in ARCHS if ARCHITECTURES[a].can_quantize]
STEPS = 10
PROMPT_LENGTHS = (5, 13, 3, 9)


@pytest.fixture(scope="module", autouse=True)
def _no_compile():
    # mx.compile'd helpers in some model files JIT-compile C++ per new shape on CPU (slow);
    # plain ops give the same answers here, for the reference and for us alike
    mx.disable_compile()
    yield
    mx.enable_compile()


_MODELS: dict[str, object] = {}


def model_for(arch: str):
    if arch not in _MODELS:
        model = tiny_model(arch, seed=1)
        prepare_model(model)
        _MODELS[arch] = model
    return _MODELS[arch]


def prompts(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 256, n).tolist() for n in PROMPT_LENGTHS]


def argmax(logits: mx.array) -> list[int]:
    return mx.argmax(logits, axis=-1).tolist()


def greedy(
    model, cache: list, prompt: list[int], steps: int = STEPS, chunk: int | None = None
) -> list[int]:
    """One sequence: prefill (whole or in chunks), then `steps` greedy tokens."""
    chunk = chunk or len(prompt)
    for s in range(0, len(prompt), chunk):
        logits = model(mx.array([prompt[s : s + chunk]]), cache=cache)[:, -1]
    out: list[int] = []
    for _ in range(steps):
        out.append(argmax(logits)[0])
        logits = model(mx.array([[out[-1]]]), cache=cache)[:, -1]
    return out


def quantized_reference(model, bits: int) -> list:
    """mlx-lm's QuantizedKVCache on every attention layer (sliding layers get the window mask)."""
    return [
        t if isinstance(t, mlc.ArraysCache) else mlc.QuantizedKVCache(group_size=32, bits=bits)
        for t in layer_templates(model)
    ]


def prefill_group(model, caches: list, group: list[list[int]], chunk: int) -> list[int]:
    """Right-padded prefill of several prompts at once, in chunks; returns each first token."""
    lengths = [len(p) for p in group]
    width = max(lengths)
    kvb.prepare(caches, lengths=lengths)
    first: list[int | None] = [None] * len(group)
    for s in range(0, width, chunk):
        w = min(chunk, width - s)
        rows = [(p[s : s + w] + [0] * w)[:w] for p in group]
        logits = model(mx.array(rows), cache=caches)
        for i, n in enumerate(lengths):
            if s <= n - 1 < s + w:
                first[i] = argmax(logits[i, n - 1 - s])
    kvb.finalize(caches)
    return [int(t) for t in first]  # type: ignore[arg-type]


def run_batched(
    model,
    ps: list[list[int]],
    make: Callable[[int], list],
    mlx_row: Callable[[], list] | None = None,
    steps: int = STEPS,
) -> list[list[int]]:
    """A small continuous-batching run: rows 0-1 prefill together (right padded), row 2 joins
    after 2 steps (our one-row layouts), row 3 after 4 steps (mlx-lm's own caches, converted);
    each row stops after `steps - i` tokens and is filtered out."""
    budget = [steps - i for i in range(len(ps))]
    outs: list[list[int]] = [[] for _ in ps]
    batch = make(2)
    nxt = prefill_group(model, batch, ps[:2], chunk=4)
    live = [0, 1]
    for i, t in zip(live, nxt, strict=True):
        outs[i].append(t)
    step_no = 0
    while live:
        if step_no == 2:
            row = make(1)
            nxt.append(argmax(model(mx.array([ps[2]]), cache=row)[:, -1])[0])
            batch = kvb.merge_rows(batch, [row])
            live.append(2)
            outs[2].append(nxt[-1])
        if step_no == 4:
            row = mlx_row() if mlx_row else layer_templates(model)
            nxt.append(argmax(model(mx.array([ps[3]]), cache=row)[:, -1])[0])
            batch = kvb.merge_rows(batch, [row])
            live.append(3)
            outs[3].append(nxt[-1])
        keep = [j for j, i in enumerate(live) if len(outs[i]) < budget[i]]
        if len(keep) < len(live):
            kvb.filter_rows(batch, keep)
            live, nxt = [live[j] for j in keep], [nxt[j] for j in keep]
        if not live:
            break
        logits = model(mx.array(nxt)[:, None], cache=batch)[:, -1]
        nxt = argmax(logits)
        for i, t in zip(live, nxt, strict=True):
            outs[i].append(t)
        step_no += 1
    return outs


def quantized_row_reference(model, bits: int, ps: list[list[int]]) -> list[list[int]]:
    return [greedy(model, quantized_reference(model, bits), p, STEPS - i) for i, p in enumerate(ps)]


@pytest.mark.parametrize("arch", ARCHS)
def test_alone_matches_mlx_reference(arch):
    model = model_for(arch)
    for p in prompts(1)[:2]:
        want = greedy(model, layer_templates(model), p)
        assert greedy(model, make_batch_layouts(model, 1), p) == want
        assert greedy(model, make_batch_layouts(model, 1, max_draft=2), p, chunk=3) == want
        assert greedy(model, make_batch_layouts(model, 1), p, chunk=6) == want


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_equals_alone(arch):
    model = model_for(arch)
    ps = prompts(2)
    want = [greedy(model, layer_templates(model), p, STEPS - i) for i, p in enumerate(ps)]
    got = run_batched(model, ps, lambda n: make_batch_layouts(model, n))
    assert got == want


@pytest.mark.parametrize("arch", ARCHS)
def test_speculative_rollback_equals_greedy(arch):
    """Drafts are the true continuation with a random token corrupted, so every acceptance
    count 1..k+1 happens; rounds cross the ring's wrap point (window 8, k = 3)."""
    model = model_for(arch)
    ps = prompts(3)[:3]
    k, steps = 3, 14
    want = [greedy(model, layer_templates(model), p, steps + k + 1) for p in ps]
    rng = np.random.default_rng(0)
    rows = [make_batch_layouts(model, 1, max_draft=k) for _ in ps]
    for row, p in zip(rows, ps, strict=True):
        model(mx.array([p]), cache=row)
    batch = kvb.merge_rows(None, rows)
    outs = [[w[0]] for w in want]
    while min(len(o) for o in outs) < steps:
        drafts = []
        for i, o in enumerate(outs):
            d = list(want[i][len(o) : len(o) + k])
            bad = int(rng.integers(0, k + 2))  # k+1 means no corruption
            if bad < k:
                d[bad] = (d[bad] + 1) % 256
            drafts.append(d)
        inp = [[o[-1], *d] for o, d in zip(outs, drafts, strict=True)]
        kvb.checkpoint(batch)
        pred = np.array(argmax(model(mx.array(inp), cache=batch)))
        accepted = []
        for i, d in enumerate(drafts):
            a = 0
            while a < k and d[a] == pred[i, a]:
                a += 1
            outs[i].extend(pred[i, : a + 1].tolist())
            accepted.append(a + 1)
        kvb.rollback(batch, accepted)
        assert kvb.num_tokens(batch) == [len(p) + len(o) - 1 for p, o in zip(ps, outs, strict=True)]
    for i, o in enumerate(outs):
        assert o == want[i][: len(o)]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("arch", QUANT_ARCHS)
def test_quantized_matches_quantized_reference(arch, bits):
    model = model_for(arch)
    ps = prompts(4)
    want = quantized_row_reference(model, bits, ps)
    alone = [
        greedy(model, make_batch_layouts(model, 1, kv_bits=bits, kv_group_size=32), p, STEPS - i)
        for i, p in enumerate(ps)
    ]
    assert alone == want
    got = run_batched(
        model,
        ps,
        lambda n: make_batch_layouts(model, n, kv_bits=bits, kv_group_size=32),
        mlx_row=lambda: quantized_reference(model, bits),
    )
    assert got == want


def test_sink_ring_matches_mlx_rotating_keep():
    """--max-kv-size turns full layers into rings with `keep` sinks: token-by-token decoding
    matches mlx-lm's RotatingKVCache(max_size, keep) (whose decode keeps sinks + recent)."""
    model = model_for("llama")
    p = prompts(5)[1]

    def ref_cache():
        return [
            mlc.RotatingKVCache(max_size=t.max_size, keep=0)
            if isinstance(t, mlc.RotatingKVCache)
            else mlc.RotatingKVCache(max_size=6, keep=2)
            for t in layer_templates(model)
        ]

    want = greedy(model, ref_cache(), p, 16, chunk=1)
    ours = make_batch_layouts(model, 1, max_kv_size=6, sink_tokens=2)
    assert greedy(model, ours, p, 16, chunk=1) == want
    ours = make_batch_layouts(model, 1, max_kv_size=6, sink_tokens=2, max_draft=2)
    assert greedy(model, ours, p, 16, chunk=5) == want


def test_unsupported_quantization_is_refused():
    for arch in ARCHS:
        if not ARCHITECTURES[arch].can_quantize:
            with pytest.raises(ValueError, match="quantized KV is not supported"):
                make_batch_layouts(model_for(arch), 1, kv_bits=8)


@pytest.mark.parametrize("arch", ARCHS)
def test_left_padded_group_prefill_equals_alone(arch):
    """mlx-lm-style left padding (fresh rows): pads reach neither attention nor recurrent state."""
    model = model_for(arch)
    ps = prompts(6)[:3]
    want = [greedy(model, layer_templates(model), p, 6) for p in ps]
    width = max(len(p) for p in ps)
    caches = make_batch_layouts(model, len(ps))
    kvb.prepare(caches, left_padding=[width - len(p) for p in ps], lengths=[len(p) for p in ps])
    padded = [[0] * (width - len(p)) + p for p in ps]
    for s in range(0, width, 4):  # chunks narrower than the padding of the short rows
        logits = model(mx.array([r[s : s + 4] for r in padded]), cache=caches)
    kvb.finalize(caches)
    outs = [[t] for t in argmax(logits[:, -1])]
    for _ in range(5):
        nxt = argmax(model(mx.array([o[-1] for o in outs])[:, None], cache=caches)[:, -1])
        for o, t in zip(outs, nxt, strict=True):
            o.append(t)
    assert outs == want


def test_docs_list_every_registered_architecture():
    from pathlib import Path

    doc = (Path(__file__).resolve().parent.parent / "docs" / "kv-layouts.md").read_text()
    for arch in ARCHS:
        assert f"| `{arch}` |" in doc
