"""engine/cuda_guard.py: the guarded RoPE modules slice one-query, small-head inputs of more than
`ROWS` rows into batch slices MLX-CUDA can launch. On the CPU (the guard forced on): a guarded
module equals the plain one bit for bit, loading a model leaves `mx.fast.rope` itself alone and
swaps the model's RoPE modules only where the guard applies; the GPU test runs the shape that
failed to launch on the H200."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.rope_utils import initialize_rope

from engine import cuda_guard
from mlxd import DEFAULT_MODEL_DIR

FAST_ROPE = mx.fast.rope  # as MLX defines it

SCALINGS = [
    None,
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "longrope", "original_max_position_embeddings": 64, "short_factor": 1.0,
     "long_factor": 2.0},
]


def _rope(scaling: dict | None, dims: int = 16, traditional: bool = False) -> nn.Module:
    return initialize_rope(dims, 10000.0, traditional, scaling, max_position_embeddings=256)


def _recording(monkeypatch) -> list[tuple[int, ...]]:
    """Record the input shape of every call to MLX's RoPE kernel (the test's own spy)."""
    shapes: list[tuple[int, ...]] = []

    def spy(x, *a, **k):
        shapes.append(tuple(x.shape))
        return FAST_ROPE(x, *a, **k)

    monkeypatch.setattr(mx.fast, "rope", spy)
    return shapes


@pytest.mark.parametrize("scaling", SCALINGS, ids=["plain", "llama3", "yarn", "su"])
@pytest.mark.parametrize("offset", ["rows", "int", "scalar"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_guarded_module_equals_plain_bit_for_bit(monkeypatch, scaling, offset, dtype):
    B, H = 150, 4  # 600 one-query rows of head dim 16: the guard slices them
    x = mx.array(np.random.default_rng(0).normal(size=(B, H, 1, 16)).astype(np.float32))
    x = x.astype(getattr(mx, dtype))
    off = {"rows": mx.arange(3, 3 + B, dtype=mx.int32), "int": 37, "scalar": mx.array(9)}[offset]
    plain, guarded = _rope(scaling), _rope(scaling)
    assert cuda_guard.install(guarded, force=True) == 1
    assert type(guarded).__name__ == "Guarded" + type(plain).__name__
    want = plain(x, offset=off)
    shapes = _recording(monkeypatch)
    got = guarded(x, offset=off)
    assert got.dtype == want.dtype and mx.array_equal(got, want).item()
    # slices of whole batch rows, each within the rows that launch
    assert len(shapes) == -(-B // (cuda_guard.ROWS // H)) > 1
    assert all(s[0] * s[1] <= cuda_guard.ROWS for s in shapes)


def test_guarded_module_calls_mlx_once_where_the_kernel_launches(monkeypatch):
    guarded = nn.RoPE(16)
    cuda_guard.install(guarded, force=True)
    shapes = _recording(monkeypatch)
    for shape in [(64, 4, 1, 16),  # 256 rows: launches
                  (150, 4, 1, 64),  # head dim 64: launches at any size
                  (150, 4, 7, 16),  # several queries a row (verify, prefill)
                  (300, 1, 16)]:  # 3-D, 300 rows: sliced in two
        guarded(mx.ones(shape), offset=mx.arange(shape[0]))
    assert shapes == [(64, 4, 1, 16), (150, 4, 1, 64), (150, 4, 7, 16), (256, 1, 16), (44, 1, 16)]


def test_offsets_not_one_per_batch_row_go_through_whole(monkeypatch):
    guarded = nn.RoPE(16)
    cuda_guard.install(guarded, force=True)
    shapes = _recording(monkeypatch)
    x = mx.ones((2, 300, 1, 16))  # 600 rows, but a slice of one batch row already has 300
    guarded(x, offset=mx.array([1, 2]))
    assert shapes == [(2, 300, 1, 16)]


def test_model_rope_modules_swapped_only_where_the_guard_applies(monkeypatch):
    from tests.tiny_models import tiny_model

    model, _ = tiny_model("qwen3")
    assert not cuda_guard.applies() and cuda_guard.install(model) == 0  # CPU: nothing swapped
    assert all(not type(m).__name__.startswith("Guarded") for _, m in model.named_modules())
    ropes = [p for p, m in model.named_modules() if isinstance(m, nn.RoPE)]
    assert len(ropes) == 3  # one per layer
    monkeypatch.setattr(cuda_guard, "applies", lambda: True)  # as on MLX-CUDA
    assert cuda_guard.install(model) == 3
    assert cuda_guard.install(model) == 0  # idempotent
    swapped = [p for p, m in model.named_modules() if type(m).__name__.startswith("Guarded")]
    assert swapped == ropes  # attention, norms, MLPs and the rest keep their classes
    assert cuda_guard.install(None) == 0
    assert mx.fast.rope is FAST_ROPE


def test_loading_a_model_leaves_mx_fast_rope_alone(monkeypatch):
    """With the guard applying (forced, as on CUDA) the loader swaps the bundled model's RoPE
    modules, and `mx.fast.rope` is still MLX's own function."""
    from engine.loader import load_model

    monkeypatch.setattr(cuda_guard, "applies", lambda: True)
    lm = load_model(str(DEFAULT_MODEL_DIR))
    guarded = [m for _, m in lm.model.named_modules() if type(m).__name__ == "GuardedRoPE"]
    assert len(guarded) == lm.config["num_hidden_layers"]
    assert mx.fast.rope is FAST_ROPE


def test_model_forward_through_the_guard_is_exact(monkeypatch):
    """A tiny llama's batched decode step with per-row offsets (the engine's layouts) gives the
    same logits, bit for bit, with its RoPE calls sliced."""
    from engine.kv import batch as kvb
    from engine.models import make_batch_layouts
    from tests.tiny_models import tiny_model

    model, _ = tiny_model("llama")
    B = 5
    prompt = mx.array(np.random.default_rng(1).integers(1, 200, (B, 12)), dtype=mx.int32)

    def run():
        layouts = make_batch_layouts(model, B)
        kvb.prepare(layouts, lengths=[12, 7, 10, 3, 12])
        model(prompt, cache=layouts)
        kvb.finalize(layouts)
        return model(mx.arange(5, 5 + B, dtype=mx.int32)[:, None], cache=layouts)

    want = run()
    monkeypatch.setattr(cuda_guard, "ROWS", 8)  # 2 batch rows of 4 query heads a slice
    shapes = _recording(monkeypatch)
    assert cuda_guard.install(model, force=True) == 4
    got = run()
    assert mx.array_equal(got, want).item()
    assert (2, 4, 1, 16) in shapes and (1, 4, 1, 16) in shapes  # the decode step was sliced


@pytest.mark.gpu
def test_cuda_rope_many_rows_evaluates():
    """The H200's failing call: [512, 4, 1, 16] float32 with 512 per-row offsets, through a
    guarded nn.RoPE, against MLX's CPU kernel."""
    if not cuda_guard.applies():
        pytest.skip("MLX-CUDA only")
    rope = nn.RoPE(16)
    assert cuda_guard.install(rope) == 1
    x = mx.array(np.random.default_rng(2).normal(size=(512, 4, 1, 16)).astype(np.float32))
    off = mx.arange(512, dtype=mx.int32)
    got = rope(x, offset=off)
    mx.eval(got)
    with mx.stream(mx.cpu):
        want = nn.RoPE(16)(x, offset=off)
    assert float(mx.abs(got - want).max()) < 1e-4
