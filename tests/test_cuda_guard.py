"""engine/cuda_guard.py: the plain-MLX RoPE that stands in for `mx.fast.rope` over many rows on
MLX-CUDA, and the plain-MLX attention that stands in for cuDNN's over a few queries per row. On
the CPU each reference is compared with MLX's kernel (equal up to float rounding) and the
dispatch is checked by installing the guard by force; the GPU tests run the shape that failed
on the H200 and compare the attention with MLX's CUDA kernels."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine import cuda_guard
from engine.cuda_guard import rope_reference


def _forced_guard(monkeypatch, name: str, record, **settings) -> tuple[list, object]:
    """Wrap mx.fast.<name> with a recorder (record(args) per call to MLX's kernel), apply the
    guard `settings`, install the guard by force; returns (calls, the recorder)."""
    calls: list = []
    original = getattr(mx.fast, name)

    def counting(*a, **k):
        calls.append(record(a))
        return original(*a, **k)

    monkeypatch.setattr(mx.fast, name, counting)
    for attr, value in settings.items():
        monkeypatch.setattr(cuda_guard, attr, value)
    cuda_guard.uninstall()
    assert cuda_guard.install(force=True)
    return calls, counting


CASES = [
    # shape, dims, traditional, base, freqs, offset
    ((4, 6, 9, 64), 64, False, 10000.0, None, [0, 5, 300, 7]),
    ((4, 6, 1, 64), 64, True, 10000.0, None, [3, 1, 2, 9]),
    ((2, 3, 5, 32), 16, False, 500000.0, None, 17),  # dims < D: the rest passes unchanged
    ((3, 2, 4, 16), 16, False, None, "freqs", [1, 2, 3]),  # scaled-RoPE models pass freqs
    ((2, 4, 3, 64), 64, False, 10000.0, None, "scalar"),
    ((3, 5, 64), 64, False, 10000.0, None, 4),  # 3-D input
]


def _args(case):
    shape, dims, trad, base, freqs, off = case
    if freqs == "freqs":
        freqs = mx.array(np.linspace(1.0, 100.0, dims // 2).astype(np.float32))
    if off == "scalar":
        off = mx.array(5)
    elif isinstance(off, list):
        off = mx.array(off, dtype=mx.int32)
    return shape, dict(dims=dims, traditional=trad, base=base, scale=0.5 if dims == 16 else 1.0,
                       offset=off, freqs=freqs)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_reference_matches_mlx_rope(case, dtype):
    shape, kw = _args(case)
    x = mx.array(np.random.default_rng(0).normal(size=shape).astype(np.float32))
    x = x.astype(getattr(mx, dtype))
    dims = kw.pop("dims")
    want = mx.fast.rope(x, dims, **kw).astype(mx.float32)
    got = rope_reference(x, dims, **kw)
    assert got.dtype == x.dtype and got.shape == x.shape
    err = float(mx.abs(got.astype(mx.float32) - want).max())
    # float32: angles up to position ~300 agree to ~1e-5; half types: one rounding step
    tol = 1e-4 if dtype == "float32" else 2 * 2.0 ** -7 * float(mx.abs(want).max())
    assert err <= tol, err
    # and the unrotated features are copied bit for bit
    if dims < shape[-1]:
        assert mx.array_equal(got[..., dims:], x[..., dims:])


def test_guard_sends_only_large_inputs_to_the_reference(monkeypatch):
    original = mx.fast.rope
    calls, counting = _forced_guard(monkeypatch, "rope", lambda a: a[0].shape, ROWS=64)
    try:
        assert mx.fast.rope is cuda_guard.rope
        small = mx.ones((16, 4, 1, 16))  # 64 rows: MLX's kernel
        big = mx.ones((32, 4, 1, 16))  # 128 rows of one query, head dim 16: the reference
        wide_head = mx.ones((32, 4, 1, 64))  # head dim 64: MLX's kernel at any size
        prefill = mx.ones((2, 4, 32, 16))  # several queries per row: MLX's kernel
        off = mx.arange(16, dtype=mx.int32)
        a = mx.fast.rope(small, 16, traditional=False, base=1e4, scale=1.0, offset=off)
        b = mx.fast.rope(big, 16, traditional=False, base=1e4, scale=1.0, offset=3)
        c = mx.fast.rope(wide_head, 64, traditional=False, base=1e4, scale=1.0, offset=3)
        d = mx.fast.rope(prefill, 16, traditional=False, base=1e4, scale=1.0, offset=3)
        mx.eval(a, b, c, d)
        assert calls == [(16, 4, 1, 16), (32, 4, 1, 64), (2, 4, 32, 16)]
        want = original(big, 16, traditional=False, base=1e4, scale=1.0, offset=3)
        assert float(mx.abs(b - want).max()) < 1e-5
    finally:
        cuda_guard.uninstall()
    assert mx.fast.rope is counting


def test_model_forward_through_the_guard_matches(monkeypatch):
    """A tiny llama's batched decode step with per-row offsets (the engine's layouts) gives
    the same logits with its RoPE calls through the reference."""
    from engine.kv import batch as kvb
    from engine.models import make_batch_layouts
    from tests.tiny_models import tiny_model

    model, _ = tiny_model("llama")
    prompt = mx.array(np.random.default_rng(1).integers(1, 200, (3, 12)), dtype=mx.int32)

    def run():
        layouts = make_batch_layouts(model, 3)
        kvb.prepare(layouts, lengths=[12, 7, 10])
        model(prompt, cache=layouts)
        kvb.finalize(layouts)
        return model(mx.array([[5], [6], [7]], dtype=mx.int32), cache=layouts)

    want = run()
    monkeypatch.setattr(cuda_guard, "ROWS", 0)
    cuda_guard.uninstall()
    cuda_guard.install(force=True)
    try:
        got = run()
    finally:
        cuda_guard.uninstall()
    assert float(mx.abs(got - want).max()) < 1e-4


@pytest.mark.gpu
def test_cuda_rope_many_rows_evaluates():
    """The H200's failing call: [256, 4, 1, 16] float32 with 256 per-row offsets."""
    from kernels.common import gpu_backend

    if gpu_backend() != "cuda":
        pytest.skip("MLX-CUDA only")
    assert cuda_guard.install()
    x = mx.array(np.random.default_rng(2).normal(size=(256, 4, 1, 16)).astype(np.float32))
    off = mx.arange(256, dtype=mx.int32)
    got = mx.fast.rope(x, 16, traditional=False, base=1e4, scale=1.0, offset=off)
    with mx.stream(mx.cpu):
        want = cuda_guard._ORIGINAL["rope"](x, 16, traditional=False, base=1e4, scale=1.0, offset=off)
    assert float(mx.abs(got - want).max()) < 1e-4


SDPA_CASES = [
    # B, Hq, Hk, N, K, D, mask
    (2, 4, 4, 5, 37, 64, "bool"),  # the engine's verify: [B, 1, N, K] booleans
    (3, 8, 2, 9, 300, 64, "bool"),  # GQA 4:1, a wide verify
    (1, 6, 3, 2, 17, 32, "causal"),
    (2, 4, 1, 16, 64, 16, "additive"),  # MQA, additive mask over every head
    (2, 2, 2, 3, 8, 64, None),
    (1, 4, 2, 4, 20, 64, "2d"),  # a [N, K] mask broadcast over batch and heads
]


def _sdpa_inputs(case, dtype, seed=0):
    B, Hq, Hk, N, K, D, kind = case
    rng = np.random.default_rng(seed)
    cast = getattr(mx, dtype)
    q, k, v = (
        mx.array(rng.normal(size=s).astype(np.float32)).astype(cast)
        for s in ((B, Hq, N, D), (B, Hk, K, D), (B, Hk, K, D))
    )
    if kind == "bool":
        lens = rng.integers(N, K + 1, size=B)  # right padding past each row's length
        cols = np.arange(K)[None, None, :]
        qpos = (lens[:, None] - N + np.arange(N)[None, :])[:, :, None]
        mask = mx.array((cols <= qpos)[:, None])  # [B, 1, N, K]
    elif kind == "additive":
        mask = mx.array(rng.normal(size=(B, Hq, N, K)).astype(np.float32)).astype(cast)
    elif kind == "2d":
        mask = mx.array(rng.random(size=(N, K)) > 0.3) | mx.array(np.eye(N, K, dtype=bool))
    else:
        mask = kind
    return q, k, v, mask, 1.0 / np.sqrt(D)


@pytest.mark.parametrize("case", SDPA_CASES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_sdpa_reference_matches_mlx_attention(case, dtype):
    q, k, v, mask, scale = _sdpa_inputs(case, dtype)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    got = cuda_guard.sdpa_reference(q, k, v, scale=scale, mask=mask)
    assert got.dtype == want.dtype and got.shape == want.shape
    err = float(mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max())
    tol = 1e-5 if dtype == "float32" else 4 * 2.0 ** -8  # half types: a rounding step or two
    assert err <= tol, err


def test_sdpa_guard_sends_only_few_query_calls_to_the_reference(monkeypatch):
    calls, counting = _forced_guard(
        monkeypatch, "scaled_dot_product_attention", lambda a: a[0].shape[2], PLAIN_MAX=16
    )
    try:
        assert mx.fast.scaled_dot_product_attention is cuda_guard.sdpa
        k = mx.ones((2, 2, 40, 64))
        sinks = mx.zeros((4,))
        outs = []
        for n, kw in [(1, {}), (2, {}), (16, {}), (17, {}), (5, {"sinks": sinks}),
                      (5, {"mask": "causal"})]:
            q = mx.ones((2, 4, n, 64))
            outs.append(mx.fast.scaled_dot_product_attention(q, k, k, scale=0.125, **kw))
        mx.eval(outs)
        # one query (vector kernel), 17 (a prefill chunk) and sinks stay with MLX's kernel
        assert calls == [1, 17, 5]
    finally:
        cuda_guard.uninstall()
    assert mx.fast.scaled_dot_product_attention is counting
    monkeypatch.setattr(cuda_guard, "PLAIN_MAX", 0)  # off: every call to MLX's kernel
    cuda_guard.install(force=True)
    try:
        calls.clear()
        mx.eval(mx.fast.scaled_dot_product_attention(mx.ones((1, 2, 4, 64)), k[:1], k[:1],
                                                     scale=0.1))
        assert calls == [4]
    finally:
        cuda_guard.uninstall()


@pytest.mark.parametrize("arch", ["gemma3_text", "qwen3"])
def test_spec_engine_through_the_guard_equals_plain(arch, monkeypatch):
    """Exact tier with the guard forced on: every verify forward's attention runs through the
    plain-MLX reference (and the RoPE reference), and greedy speculative output still equals
    plain greedy output token for token (sliding-window rings included: gemma3's window is 24)."""
    from engine.spec import SpecConfig
    from tests.test_spec_engine import _check, _outputs, _repetitive_prompts
    from tests.tiny_models import greedy, loaded, tiny_model

    model, cfg = tiny_model(arch)
    lm = loaded(model, cfg)
    prompts = _repetitive_prompts(cfg["vocab_size"], 4, seed=5)
    reqs = [greedy(f"g{i}", p, max_tokens=30 + 7 * i) for i, p in enumerate(prompts)]
    want, _ = _outputs(lm, None, reqs, prefill_chunk=32)
    monkeypatch.setattr(cuda_guard, "PLAIN_MAX", 16)  # the plain attention is opt-in
    monkeypatch.setattr(cuda_guard, "ROWS", 0)
    calls = []
    monkeypatch.setattr(cuda_guard, "sdpa_reference",
                        lambda *a, _f=cuda_guard.sdpa_reference, **k: calls.append(1) or _f(*a, **k))
    cuda_guard.uninstall()
    cuda_guard.install(force=True)
    try:
        spec = SpecConfig("ngram", num_draft_tokens=4, adaptive=False)
        st = _check(lm, spec, reqs, want, prefill_chunk=32)
    finally:
        cuda_guard.uninstall()
    assert st.spec_steps > 0 and calls  # the verify forwards' attention took the reference


@pytest.mark.gpu
@pytest.mark.parametrize("case", SDPA_CASES[:4])
def test_cuda_sdpa_reference_matches_mlx_kernels(case):
    """On MLX-CUDA: the reference against MLX's own attention (cuDNN for bfloat16)."""
    from kernels.common import gpu_backend

    if gpu_backend() != "cuda":
        pytest.skip("MLX-CUDA only")
    q, k, v, mask, scale = _sdpa_inputs(case, "bfloat16")
    fast = cuda_guard._ORIGINAL.get("sdpa", mx.fast.scaled_dot_product_attention)
    want = fast(q, k, v, scale=scale, mask=mask).astype(mx.float32)
    got = cuda_guard.sdpa_reference(q, k, v, scale=scale, mask=mask).astype(mx.float32)
    assert float(mx.abs(got - want).max()) <= 4 * 2.0 ** -8
