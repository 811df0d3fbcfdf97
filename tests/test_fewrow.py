"""engine/fewrow.py: 3..16-row matmuls as one gathered gemv (`mx.gather_mm`, MLX-CUDA's
gemv_gather kernel). On the CPU the path is forced (`ANY_DEVICE`) and compared with `x @ W.T`;
the dispatch rules are checked; and the engine's exact tier holds with every Linear of a tiny
model swapped (spec vs plain greedy, batched vs alone). The GPU test compares against MLX's
one-row gemv, row by row: the gathered rows should be computed by the same kernel code."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from engine import fewrow


@pytest.fixture
def anywhere(monkeypatch):
    monkeypatch.setattr(fewrow, "ANY_DEVICE", True)


def _check_against_matmul(shape, dtype):
    rng = np.random.default_rng(0)
    cast = getattr(mx, dtype)
    x = mx.array(rng.normal(size=shape).astype(np.float32)).astype(cast)
    w = mx.array(rng.normal(size=(48, shape[-1])).astype(np.float32) / 8).astype(cast)
    assert fewrow.takes(x, w)
    got = fewrow.gather_matmul(x, w)
    want = x @ w.T
    assert got.shape == want.shape and got.dtype == want.dtype
    err = float(mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max())
    scale = float(mx.abs(want.astype(mx.float32)).max())
    # float32 on CUDA: MLX's x @ W.T runs cuBLASLt in TF32 (10-bit mantissa), the gemv in float32
    f32 = 1e-5 if mx.default_device() != mx.gpu else 3e-3
    assert err <= (f32 if dtype == "float32" else 2 * 2.0 ** -7) * scale, err


@pytest.mark.parametrize("shape", [(3, 64), (5, 96), (3, 3, 128), (16, 32), (1, 4, 64)])
def test_gather_matmul_equals_the_matmul(shape, anywhere):
    # MLX's CPU gather_mm takes float32 only; the half types run in the GPU test
    _check_against_matmul(shape, "float32")


def test_dispatch_rules(anywhere, monkeypatch):
    w = mx.zeros((8, 64))
    assert not fewrow.takes(mx.zeros((1, 64)), w)  # one row: MLX's gemv already
    assert not fewrow.takes(mx.zeros((2, 64)), w)  # two rows: measured faster through cuBLASLt
    assert fewrow.takes(mx.zeros((3, 64)), w)
    assert fewrow.takes(mx.zeros((4, 4, 64)), w)  # 16 rows in all
    assert not fewrow.takes(mx.zeros((17, 64)), w)  # a prefill chunk: cuBLASLt
    assert not fewrow.takes(mx.zeros((3, 48)), mx.zeros((8, 48)))  # K % 32
    big = mx.zeros((8192, 384))  # 12.6 MB float32: 3 rows would read 38 MB
    assert not fewrow.takes(mx.zeros((3, 384)), big)
    monkeypatch.setattr(fewrow, "MAX_BYTES", 64 << 20)
    assert fewrow.takes(mx.zeros((3, 384)), big)
    assert not fewrow.takes(mx.zeros((3, 64), dtype=mx.float16), w)  # mixed dtypes
    assert not fewrow.takes(mx.zeros((3, 64), dtype=mx.int32), mx.zeros((8, 64), dtype=mx.int32))
    monkeypatch.setattr(fewrow, "ANY_DEVICE", False)
    if mx.default_device() != mx.gpu:
        assert not fewrow.takes(mx.zeros((3, 64)), w)  # a CPU forward keeps the matmul


def test_install_swaps_plain_linears_and_the_tied_head(anywhere):
    from tests.tiny_models import tiny_model

    model, _ = tiny_model("llama")
    plain = sum(type(m) in (nn.Linear, nn.Embedding) for _, m in model.named_modules())
    assert fewrow.install(model) == 0 or fewrow.enabled()  # CPU: a no-op unless forced
    fewrow.uninstall(model)
    assert fewrow.install(model, force=True) == plain
    tokens = mx.array([[3, 4, 5, 6], [7, 8, 9, 10]], dtype=mx.int32)
    got = model(tokens)
    assert fewrow.uninstall(model) == plain
    want = model(tokens)
    assert float(mx.abs(got - want).max()) < 1e-4


def test_linear_with_bias(anywhere):
    lin = nn.Linear(64, 40, bias=True)
    x = mx.random.normal((3, 64))
    want = lin(x)
    assert fewrow.takes(x, lin.weight)
    lin.__class__ = fewrow.FewRowLinear
    assert float(mx.abs(lin(x) - want).max()) < 1e-5


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_exact_tier_with_the_gathered_matmuls(arch, anywhere):
    """Greedy speculative output equals plain greedy output, and batched rows equal rows run
    alone, with every Linear (and the tied head) of the tiny model through the gathered gemv."""
    from tests.test_spec_engine import _outputs, _repetitive_prompts, exact_tier
    from tests.tiny_models import greedy, loaded, tiny_model

    model, cfg = tiny_model(arch, vocab_size=16)  # outputs repeat: n-gram lookups hit
    lm = loaded(model, cfg)
    prompts = _repetitive_prompts(cfg["vocab_size"], 4, seed=7)
    reqs = [greedy(f"f{i}", p, max_tokens=24 + 5 * i) for i, p in enumerate(prompts)]
    want, _ = _outputs(lm, None, reqs, prefill_chunk=32)  # plain matmuls, batched
    assert fewrow.install(model, force=True) > 0
    try:  # alone: one-row steps (the plain gemv path)
        st = exact_tier(lm, reqs, want)
    finally:
        fewrow.uninstall(model)
    assert st.spec_steps > 0


@pytest.mark.gpu
def test_cuda_gathered_rows_equal_one_row_gemvs():
    """On MLX-CUDA every gathered row is bit-identical to the same row through the one-row gemv
    (both run MLX's gemv code), which is what makes batched rows equal rows run alone."""
    from kernels.common import gpu_backend

    if gpu_backend() != "cuda":
        pytest.skip("MLX-CUDA only")
    for dtype in ("float32", "bfloat16", "float16"):
        for shape in [(3, 64), (5, 96), (3, 3, 128), (16, 32)]:
            _check_against_matmul(shape, dtype)
    rng = np.random.default_rng(3)
    for n, k, m in [(384, 384, 3), (1024, 384, 9), (8192, 384, 5), (384, 1024, 16)]:
        x = mx.array(rng.normal(size=(m, k)).astype(np.float32)).astype(mx.bfloat16)
        w = mx.array(rng.normal(size=(n, k)).astype(np.float32) / 20).astype(mx.bfloat16)
        got = fewrow.gather_matmul(x, w)
        rows = mx.concatenate([x[i : i + 1] @ w.T for i in range(m)], axis=0)
        assert mx.array_equal(got, rows), (n, k, m)


@pytest.mark.parametrize("preset", [None, "/tmp/somewhere"])
def test_engine_import_keeps_cuda_kernels_in_a_persistent_cache(preset, tmp_path):
    """engine/__init__.py points MLX_PTX_CACHE_DIR under XDG_CACHE_HOME (per MLX version) and
    keeps a user's value."""
    import os
    import subprocess
    import sys
    from importlib import metadata

    env = {k: v for k, v in os.environ.items() if k != "MLX_PTX_CACHE_DIR"}
    env["XDG_CACHE_HOME"] = str(tmp_path)
    if preset is not None:
        env["MLX_PTX_CACHE_DIR"] = preset
    out = subprocess.run(
        [sys.executable, "-c", "import engine, os; print(os.environ['MLX_PTX_CACHE_DIR'])"],
        env=env, capture_output=True, text=True, check=True, timeout=120,
    )
    want = preset or str(tmp_path / "mlxd" / "ptx" / metadata.version("mlx"))
    assert out.stdout.strip() == want
