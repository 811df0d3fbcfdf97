"""engine/cuda_guard.py: the plain-MLX RoPE that stands in for `mx.fast.rope` over many rows on
MLX-CUDA. On the CPU the reference is compared with MLX's kernel (the same rotation up to float
rounding) and the dispatch is checked by installing the guard by force; the GPU test runs the
shape that failed on the H200."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine import cuda_guard
from engine.cuda_guard import rope_reference

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
    calls = []
    original = mx.fast.rope

    def counting(*a, **k):
        calls.append(a[0].shape)
        return original(*a, **k)

    monkeypatch.setattr(mx.fast, "rope", counting)
    monkeypatch.setattr(cuda_guard, "ROWS", 64)
    cuda_guard.uninstall()
    assert cuda_guard.install(force=True)
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
        want = cuda_guard._ORIGINAL[0](x, 16, traditional=False, base=1e4, scale=1.0, offset=off)
    assert float(mx.abs(got - want).max()) < 1e-4
