"""Decode attention over rows of different lengths (kernels/attention/decode.py): the engine's
layouts hand over each row's key count, the route takes exactly the calls it should, the lengths
say what the step's mask says (checked on a CPU through the plain-MLX twin), and on CUDA the
kernel equals MLX's masked attention."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine import cuda_guard
from kernels.attention import decode


def test_takes_the_shapes_it_computes():
    q = mx.zeros((3, 32, 1, 64), dtype=mx.bfloat16)
    k = mx.zeros((3, 8, 300, 64), dtype=mx.bfloat16)
    assert decode.takes(q, k, k)
    assert not decode.takes(q.astype(mx.float32), k.astype(mx.float32), k.astype(mx.float32))
    assert not decode.takes(mx.zeros((3, 32, 2, 64), dtype=mx.bfloat16), k, k)  # two queries
    assert not decode.takes(mx.zeros((3, 32, 1, 80), dtype=mx.bfloat16),
                            mx.zeros((3, 8, 300, 80), dtype=mx.bfloat16),
                            mx.zeros((3, 8, 300, 80), dtype=mx.bfloat16))  # head dim
    assert not decode.takes(mx.zeros((3, 24, 1, 64), dtype=mx.bfloat16),
                            mx.zeros((3, 16, 300, 64), dtype=mx.bfloat16),
                            mx.zeros((3, 16, 300, 64), dtype=mx.bfloat16))  # 24 % 16
    assert not decode.takes(mx.zeros((3, 32, 1, 64), dtype=mx.bfloat16),
                            mx.zeros((3, 2, 300, 64), dtype=mx.bfloat16),
                            mx.zeros((3, 2, 300, 64), dtype=mx.bfloat16))  # group of 16
    # enough blocks for the GPU: long rows take big splits, a lone short row small ones
    assert decode.split_for(16, 8, 8192) == 1024 and decode.split_for(1, 8, 1024) == 256


def _batched_decode(model, lengths: list[int], steps: int = 3):
    """Rows of different prompt lengths prefilled together into the engine's layouts, then a
    few decode steps; the logits of every step."""
    from engine.kv import batch as kvb
    from engine.models import make_batch_layouts

    rng = np.random.default_rng(7)
    B, W = len(lengths), max(lengths)
    layouts = make_batch_layouts(model, B)
    kvb.prepare(layouts, lengths=lengths)
    model(mx.array(rng.integers(1, 200, (B, W)), dtype=mx.int32), cache=layouts)
    kvb.finalize(layouts)
    out = []
    tok = mx.array(rng.integers(1, 200, (B, 1)), dtype=mx.int32)
    for _ in range(steps):
        logits = model(tok, cache=layouts)
        out.append(logits)
        tok = mx.argmax(logits[:, -1:], axis=-1).astype(mx.int32)
    mx.eval(out)
    return out


def test_layout_lengths_are_the_mask_and_the_route_stays_exact(monkeypatch):
    """Forced on (as on CUDA), a tiny qwen3's decode steps over rows of 5, 23 and 40 tokens take
    the kernel's route at every layer; there each row's length equals what the step's mask lets
    its query see, and with the plain-MLX twin in the kernel's place the logits are mlx-lm's."""
    import mlx_lm.models.qwen3 as qwen3_module
    from mlx_lm.models import base

    from tests.tiny_models import tiny_model

    monkeypatch.setattr(qwen3_module, "scaled_dot_product_attention",
                        base.scaled_dot_product_attention)
    model, cfg = tiny_model("qwen3")
    lengths = [5, 23, 40]
    want = _batched_decode(model, lengths)
    calls: list[list[int]] = []

    def fake(q, k, v, lens, scale):
        seen = np.array(lens)
        calls.append(seen.tolist())
        return decode.twin(q, k, v, lens, scale)

    real_sdpa = mx.fast.scaled_dot_product_attention

    def checked(q, k, v, *, scale, mask=None, **kw):
        if q.shape[2] == 1 and isinstance(mask, mx.array):
            visible = np.array(mask).reshape(q.shape[0], -1)  # [B, K]
            checked.masks.append(visible.sum(axis=1).tolist())
            assert all(visible[b, : int(visible[b].sum())].all() for b in range(len(visible)))
        return real_sdpa(q, k, v, scale=scale, mask=mask, **kw)

    checked.masks = []
    monkeypatch.setattr(decode, "takes", lambda q, k, v: q.shape[2] == 1)
    monkeypatch.setattr(decode, "decode_attention", fake)
    assert cuda_guard.install_attention(model, force=True) == 1
    got = _batched_decode(model, lengths)
    layers = cfg["num_hidden_layers"]
    assert len(calls) == 3 * layers  # every layer of every decode step
    assert calls[0] == [6, 24, 41] and calls[-1] == [8, 26, 43]  # the prompt + the new columns
    for a, b in zip(got, want, strict=True):
        assert float(mx.abs(a - b).max()) < 1e-5

    # the lengths are the mask: the same steps with the mask itself checked at the fused call
    monkeypatch.setattr(decode, "takes", lambda q, k, v: False)
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", checked)
    _batched_decode(model, lengths)
    assert checked.masks[::layers] == calls[::layers]


def test_equal_rows_and_prefill_keep_mlx_attention(monkeypatch):
    """Rows of one length (mlx-lm's own mask forms, which MLX fuses) and prefill chunks never
    take the kernel."""
    import mlx_lm.models.qwen3 as qwen3_module
    from mlx_lm.models import base

    from tests.tiny_models import tiny_model

    monkeypatch.setattr(qwen3_module, "scaled_dot_product_attention",
                        base.scaled_dot_product_attention)
    model, _ = tiny_model("qwen3")
    calls: list[int] = []
    monkeypatch.setattr(decode, "takes", lambda q, k, v: True)
    monkeypatch.setattr(decode, "decode_attention",
                        lambda q, k, v, lens, scale: calls.append(1) or decode.twin(q, k, v, lens, scale))
    cuda_guard.install_attention(model, force=True)
    _batched_decode(model, [17, 17])
    assert calls == []


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", [(1, 32, 8, 64, 1024), (16, 32, 8, 64, 8192), (5, 16, 8, 128, 3000),
                                   (3, 8, 8, 128, 700), (4, 28, 4, 128, 2048), (2, 16, 2, 64, 257)],
                         ids=lambda s: "x".join(map(str, s)))
def test_kernel_equals_masked_attention(shape, dtype):
    """On CUDA: rows of different lengths (1 key up to the slice's width) over a slice of a
    wider buffer, against MLX's masked attention, by bf16/fp16 rounding only."""
    if not cuda_guard.applies():
        pytest.skip("MLX-CUDA only")
    B, Hq, Hkv, D, C = shape
    rng = np.random.default_rng(B * C)
    q = mx.array(rng.normal(size=(B, Hq, 1, D))).astype(dtype)
    k = mx.array(rng.normal(size=(B, Hkv, C + 256, D))).astype(dtype)
    v = mx.array(rng.normal(size=(B, Hkv, C + 256, D))).astype(dtype)
    lens = rng.integers(1, C + 1, size=B)
    lens[0] = C
    if B > 1:
        lens[1] = 1
    ks, vs = k[:, :, :C], v[:, :, :C]  # what a layout hands over: a slice, not a copy
    got = decode.decode_attention(q, ks, vs, mx.array(lens.astype(np.int32)), D ** -0.5)
    want = decode.twin(q, ks, vs, lens, D ** -0.5)
    err = float(mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max())
    assert got.shape == want.shape and got.dtype == dtype
    assert err < (2e-2 if dtype == mx.bfloat16 else 4e-3), err


@pytest.mark.gpu
def test_engine_layouts_decode_through_the_kernel_on_cuda(monkeypatch):
    """On CUDA, a bf16 qwen3 with 64-wide heads decoding rows of 5, 300 and 1,000 tokens: the
    kernel runs at every layer and its logits are those of MLX's masked attention."""
    if not cuda_guard.applies():
        pytest.skip("MLX-CUDA only")
    from tests.tiny_models import tiny_model

    model, cfg = tiny_model("qwen3", head_dim=64, hidden_size=256)
    model.set_dtype(mx.bfloat16)
    cuda_guard.install_attention(model)
    runs: list[int] = []
    real = decode.decode_attention
    monkeypatch.setattr(decode, "decode_attention", lambda *a: runs.append(1) or real(*a))
    got = _batched_decode(model, [5, 300, 1000])
    assert len(runs) == 3 * cfg["num_hidden_layers"]
    monkeypatch.setattr(decode, "takes", lambda q, k, v: False)
    want = _batched_decode(model, [5, 300, 1000])
    for a, b in zip(got, want, strict=True):
        a, b = a.astype(mx.float32), b.astype(mx.float32)
        assert float(mx.abs(a - b).max()) < 0.05 * float(mx.abs(b).max())


def _bf16(x: np.ndarray) -> np.ndarray:
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _float(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


@pytest.mark.parametrize("case", [(2, 8, 2, 64, 300, 256), (2, 8, 1, 128, 260, 256)],
                         ids=lambda c: "x".join(map(str, c)))
def test_kernel_bodies_on_the_cpu_harness(case):
    """The CUDA bodies themselves, compiled with g++ behind a CPU prelude (a thread per lane,
    shuffles and __syncthreads through shared slots): rows of 1 key up to the slice's width,
    across a split boundary, keys read through a wider buffer's strides, GQA groups of 4 and 8,
    against float64 attention over the same bf16 values."""
    import ctypes
    import math

    from kernels.common import compile_cpu_library, cpu_compiler

    if cpu_compiler() is None:
        pytest.skip("no C++ compiler")
    B, Hq, Hkv, D, C, split = case
    rng = np.random.default_rng(C)
    q = _bf16(rng.normal(size=(B, Hq, 1, D)))
    k = _bf16(rng.normal(size=(B, Hkv, C + 64, D)))
    v = _bf16(rng.normal(size=(B, Hkv, C + 64, D)))
    lens = np.array([C, 1][:B], dtype=np.int32)
    strides = np.array([Hkv * (C + 64) * D, (C + 64) * D, D, 1], dtype=np.int64)
    out = np.zeros((B, Hq, 1, D), np.uint16)
    scale = np.array([D ** -0.5], np.float32)
    lib = compile_cpu_library(decode.cpu_harness_source(D, Hq // Hkv, split), "dattn",
                              ("-O1", "-pthread", "-Wno-unknown-pragmas"))
    ptr = [a.ctypes.data_as(ctypes.c_void_p) for a in (q, k, v, lens, scale, strides, strides)]
    lib.decode_attention_cpu(*ptr, ctypes.c_int(B), ctypes.c_int(Hkv),
                             ctypes.c_int(math.ceil(C / split)), out.ctypes.data_as(ctypes.c_void_p))
    qf, kf, vf = _float(q), _float(k), _float(v)
    G = Hq // Hkv
    for b in range(B):
        for h in range(Hq):
            s = kf[b, h // G, : lens[b]] @ qf[b, h, 0] * D ** -0.5
            p = np.exp(s - s.max())
            want = (p / p.sum()) @ vf[b, h // G, : lens[b]]
            assert np.abs(_float(out[b, h, 0]) - want).max() < 8e-3, (b, h)


def test_warm_up_runs_the_kernel_route(monkeypatch):
    """The engine's warm-up decodes rows of different lengths, so on CUDA the kernel (and every
    split's build) runs before the first request, not during it."""
    import mlx_lm.models.qwen3 as qwen3_module
    from mlx_lm.models import base

    from engine.core import Engine, EngineConfig
    from engine.scheduler import SchedulerConfig
    from tests.tiny_models import loaded, tiny_model

    monkeypatch.setattr(qwen3_module, "scaled_dot_product_attention",
                        base.scaled_dot_product_attention)
    model, cfg = tiny_model("qwen3")
    calls: list[list[int]] = []
    monkeypatch.setattr(decode, "takes", lambda q, k, v: q.shape[2] == 1)
    monkeypatch.setattr(decode, "decode_attention", lambda q, k, v, lens, scale: (
        calls.append(np.array(lens).tolist()) or decode.twin(q, k, v, lens, scale)))
    cuda_guard.install_attention(model, force=True)
    monkeypatch.setattr("engine.core.shapes_build_on_first_use", lambda: True)  # the GPU warm-up
    Engine(loaded(model, cfg), EngineConfig(SchedulerConfig(), warmup=True))
    assert calls and any(len(set(lens)) > 1 for lens in calls)
