"""kernels/affine: the few-row affine quantized matmul (CUDA kernel, MLX twin, layer swap, routing).

On the CPU: the kernel's index math (its packing and group reads, and the mma body's fragment
layout, emulated lane by lane) against mx.dequantize; FewRowQuantizedLinear equals
QuantizedLinear exactly (the twin runs); the install swap; joined sibling projections equal to
the members alone; the ROUTE table and, with CUDA forced (the kernel call replaced by MLX's
twin), which rows go where and with which shapes; and the engine's exact tier with the swap
and the CUDA routing forced. The CUDA sources compile for sm_90 with nvcc when it is
installed. The `gpu` tests compare the CUDA kernel with mx.quantized_matmul on the H200.
"""

from __future__ import annotations

import gc
import math
import os
import re
import shutil
import subprocess

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from kernels.affine import linear, qmm
from kernels.affine import source as src
from kernels.common import gpu_backend, swap_classes

BITS_GROUPS = [(b, g) for b in qmm.BITS for g in qmm.GROUPS]


def _quantized(n: int, k: int, bits: int, group: int, dtype=mx.float32, seed: int = 0):
    w = mx.random.normal((n, k), key=mx.random.key(seed)) / 8
    wq, scales, biases = mx.quantize(w, group_size=group, bits=bits)
    return wq, scales.astype(dtype), biases.astype(dtype)


@pytest.mark.parametrize("bits,group", BITS_GROUPS)
def test_kernel_indexing_equals_mx_dequantize(bits, group):
    wq, scales, biases = _quantized(37, 384, bits, group)
    want = np.array(mx.dequantize(wq, scales, biases, group_size=group, bits=bits))
    got = qmm.dequantize_np(np.array(wq), np.array(scales), np.array(biases), bits, group)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("bits,k,rows", [(4, 96, 1), (4, 256, 9), (8, 160, 16), (8, 64, 3), (4, 1024, 8)])
def test_mma_fragment_layout_computes_x_times_w_transposed(bits, k, rows):
    """The mma body's loads and C slots (emulated with PTX's m16n8k16 fragment layouts) give
    x @ W.T, for K not a multiple of an iteration's columns and N not a multiple of 8."""
    rng = np.random.default_rng(1)
    w_hat = rng.normal(size=(13, k))
    x = rng.normal(size=(rows, k))
    np.testing.assert_allclose(qmm.mma_emulate_np(x, w_hat, bits), x @ w_hat.T, rtol=1e-10, atol=1e-10)
    if bits == 4:
        np.testing.assert_allclose(qmm.mma_emulate_np(x, w_hat, bits, "mma4"), x @ w_hat.T, rtol=1e-10, atol=1e-10)


def test_mma4_nibble_pairs_and_magic_exponents():
    """mma4's bit tricks: (v >> 4i) & 0x000F000F holds nibbles i and i + 4 of v in its two halves;
    0x4300 | q is bfloat16 128 + q and 0x6400 | q float16 1024 + q, for every q < 16."""
    v = np.uint32(0xFEDCBA98)
    for i in range(4):
        pair = (v >> np.uint32(4 * i)) & np.uint32(0x000F000F)
        assert int(pair) & 0xFFFF == (int(v) >> (4 * i)) & 15
        assert int(pair) >> 16 == (int(v) >> (4 * (i + 4))) & 15
    q = np.arange(16, dtype=np.uint32)
    bf16 = ((q | 0x4300) << 16).view(np.float32)  # bfloat16 bits are a float32's top half
    np.testing.assert_array_equal(bf16 - 128, q.astype(np.float32))
    np.testing.assert_array_equal((q | 0x6400).astype(np.uint16).view(np.float16).astype(np.float32) - 1024, q)


def test_launch_constants_and_dims():
    cfg = qmm.LaunchConfig("simt", 4, 2, 1)
    assert qmm.constants(cfg, 3, 4) == {"M": 3, "BITS": 4, "WPB": 2, "U": 1, "RPW": 4, "NV": 12, "NP": 16}
    assert qmm.launch_dims(cfg, 10) == ((3 * 64, 1, 1), (64, 1, 1))
    mma = qmm.LaunchConfig("mma", 2, 4, 2)
    assert qmm.constants(mma, 16, 8) == {"BITS": 8, "WPB": 4, "U": 2, "M16": 1, "NT": 2}
    assert qmm.constants(mma, 8, 4)["M16"] == 0
    assert qmm.launch_dims(mma, 17) == ((2 * 128, 1, 1), (128, 1, 1))
    assert qmm.LaunchConfig.parse(mma.key()) == mma


def test_pick_config_reads_the_table(monkeypatch):
    cfg = qmm.LaunchConfig("mma", 4, 8, 1)
    monkeypatch.setattr(qmm, "TUNED", {qmm.shape_key(4, 64, mx.bfloat16, 4096, 4096, 8): cfg})
    assert qmm.pick_config(4, 64, mx.bfloat16, 4096, 4096, 5) == cfg  # the next swept row count up
    assert qmm.pick_config(4, 64, mx.bfloat16, 4096, 4096, 9) == qmm.default_config(4096, 4096, 4)
    assert qmm.default_config(4096, 4096, 4) == qmm.LaunchConfig("mma", 1, 8, 2)  # 4096 warps
    assert qmm.default_config(28672, 4096, 4).wpb == 2
    assert qmm.default_config(64, 128, 4).wpb == 1  # one iteration a row: no split
    assert qmm.pick_config(4, 64, mx.float32, 4096, 4096, 5) == qmm.FLOAT32  # one layout for float32


def test_load_tuned_round_trips(tmp_path):
    path = tmp_path / "t.json"
    path.write_text('{"b4-g64-bfloat16-64x64-m1": "simt-t2-w4-u1"}')
    assert qmm.load_tuned(path) == {"b4-g64-bfloat16-64x64-m1": qmm.LaunchConfig("simt", 2, 4, 1)}
    assert qmm.load_tuned(tmp_path / "absent.json") == {}


def test_takes_rules(monkeypatch):
    wq, scales, _ = _quantized(8, 64, 4, 32)
    monkeypatch.setattr(qmm, "ANY_DEVICE", True)
    assert qmm.takes(mx.zeros((1, 64)), wq, scales, 4, 32)
    assert qmm.takes(mx.zeros((4, 4, 64)), wq, scales, 4, 32)  # 16 rows in all
    assert not qmm.takes(mx.zeros((17, 64)), wq, scales, 4, 32)
    assert not qmm.takes(mx.zeros((3, 64), dtype=mx.float16), wq, scales, 4, 32)  # dtypes differ
    assert not qmm.takes(mx.zeros((3, 64)), wq, scales, 3, 32)  # 3 bits: MLX's kernels
    monkeypatch.setattr(qmm, "ANY_DEVICE", False)
    if gpu_backend() != "cuda":
        assert not qmm.takes(mx.zeros((1, 64)), wq, scales, 4, 32)


def test_check_shapes_rejects_misfits():
    wq, scales, biases = _quantized(8, 64, 4, 32)
    with pytest.raises(ValueError, match="rows"):
        qmm.check_shapes(mx.zeros((17, 64)), wq, scales, biases, 4, 32)
    with pytest.raises(ValueError, match="columns"):
        qmm.check_shapes(mx.zeros((1, 96)), wq, scales, biases, 4, 32)
    with pytest.raises(ValueError, match="dtype"):
        qmm.check_shapes(mx.zeros((1, 64), dtype=mx.float16), wq, scales, biases, 4, 32)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 16, 20])
@pytest.mark.parametrize("cpu_kernel", [False, True])
def test_linear_equals_quantized_linear_on_cpu(monkeypatch, bias, rows, cpu_kernel):
    """Here on the CPU: equal to QuantizedLinear, bit for bit through MLX's kernel, to float32
    rounding through the C++ kernel (kernels/affine/cpu.py, below the dense rows)."""
    if not cpu_kernel:
        monkeypatch.setattr(linear.cpu_kernel, "takes", lambda *a: False)
    elif not linear.cpu_kernel.available():
        pytest.skip("no C++ compiler for the CPU kernel")
    ql = nn.QuantizedLinear(128, 40, bias=bias, group_size=64, bits=4)
    if bias:
        ql.bias = mx.random.normal((40,))
    x = mx.random.normal((rows, 128))
    want = ql(x)
    ql.__class__ = linear.FewRowQuantizedLinear
    got = ql(x)
    assert got.dtype == want.dtype
    if cpu_kernel and rows < linear.DEQUANTIZE_ROWS["cpu"] and gpu_backend() is None:
        assert mx.allclose(got, want, atol=1e-5, rtol=1e-5)
    else:
        assert mx.array_equal(got, want)


def _tiny_quantized(arch: str = "llama", **overrides):
    from tests.tiny_models import tiny_model

    model, cfg = tiny_model(arch, **overrides)
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return model, cfg


def test_install_on_cuda_and_cpu_or_forced_and_leaves_other_layers():
    model, _ = _tiny_quantized()
    model.extra = nn.Linear(8, 8)  # a plain Linear: not ours to swap
    quantized = sum(type(m) in (nn.QuantizedLinear, nn.QuantizedEmbedding) for _, m in model.named_modules())
    assert quantized > 0
    assert linear.swapped_here() == (gpu_backend() != "metal")
    if not linear.swapped_here():
        assert linear.install(model) == 0
        assert not any(isinstance(m, linear.FewRowQuantizedLinear) for _, m in model.named_modules())
    linear.uninstall(model)
    assert linear.install(model, force=True) == quantized
    assert type(model.extra) is nn.Linear
    assert linear.uninstall(model) == quantized
    assert not any(isinstance(m, linear.FewRowQuantizedLinear) for _, m in model.named_modules())


class _Siblings(nn.Module):
    """An attention's q/k/v and an MLP's gate/up, 4-bit, optionally with biases (qwen2's q/k/v)."""

    def __init__(self, bias: bool = False, v_bits: int = 4, scale: int = 1) -> None:
        super().__init__()
        k, kv = 128 * scale, 32 * scale
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(k, 2 * kv, bias=bias), nn.Linear(k, kv, bias=bias),
                                                 nn.Linear(k, kv, bias=bias))
        self.gate_proj, self.up_proj = nn.Linear(k, 3 * kv), nn.Linear(k, 3 * kv)
        self.o_proj = nn.Linear(2 * kv, k)  # no sibling: stays alone
        nn.quantize(self, group_size=32, bits=4)
        if v_bits != 4:
            self.v_proj = nn.QuantizedLinear.from_linear(nn.Linear(k, kv, bias=bias), group_size=32, bits=v_bits)
        mx.eval(self.parameters())


QKV, GATE_UP = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 16, 17])
def test_joined_siblings_equal_the_members_alone(monkeypatch, bias, rows):
    """q/k/v and gate/up joined: each member's output equals its own call bit for bit, called
    in any order, with the joined product taken up to JOIN_ROWS rows and each member's own
    beyond."""
    monkeypatch.setitem(linear.JOIN_ROWS, "cpu", 16)
    monkeypatch.setitem(linear.JOIN_ROWS, "cuda", 16)
    mod = _Siblings(bias=bias)
    x = mx.random.normal((rows, 128), key=mx.random.key(rows))
    swap = {nn.QuantizedLinear: linear.FewRowQuantizedLinear}
    swap_classes(mod, swap)  # alone: the few-row layer without a group
    want = {n: getattr(mod, n)(x) for n in QKV + GATE_UP}
    mx.eval(want)
    swap_classes(mod, {v: k for k, v in swap.items()})
    assert linear.install(mod, force=True) == 6
    assert linear.join_siblings(mod) == 0  # joined once
    group = mod.q_proj.__dict__["_siblings"]
    assert mod.gate_proj.__dict__["_siblings"] is mod.up_proj.__dict__["_siblings"] is not group
    assert "_siblings" not in mod.o_proj.__dict__
    assert group.weight.shape == (128, 128 * 4 // 32) and group.splits == [64, 96]
    joined = rows <= 16
    calls: list[int] = []
    real = linear.affine_matmul
    monkeypatch.setattr(linear, "affine_matmul", lambda x, w, *a, **k: calls.append(w.shape[0]) or real(x, w, *a, **k))
    for order in (QKV, ("v_proj", "q_proj", "k_proj"), GATE_UP, ("up_proj", "gate_proj")):
        calls.clear()
        got = {n: getattr(mod, n)(x) for n in order}
        for n in order:
            assert mx.array_equal(got[n], want[n]), (order, n)
        full = 128 if order[0] in QKV else 192
        assert calls == ([full] if joined else [getattr(mod, n)["weight"].shape[0] for n in order])
        assert group._x is None and not group._parts  # nothing held once every member took its part


def test_joined_members_are_views_of_one_buffer():
    """Joining siblings keeps one copy of their weights: the members' parameters become views of
    the joined buffer. Measured on layers whose weights (2 MB) dwarf the process's other
    allocations in the window."""
    mod = _Siblings(scale=8)
    mx.synchronize()
    gc.collect()
    before = mx.get_active_memory()
    assert linear.install(mod, force=True) == 6
    groups = (mod.q_proj.__dict__["_siblings"], mod.up_proj.__dict__["_siblings"])
    gc.collect()
    mx.synchronize()
    joined_bytes = sum(a.nbytes for g in groups for a in (g.weight, g.scales, g.biases))
    assert joined_bytes > 1_900_000
    assert mx.get_active_memory() - before < joined_bytes / 4


def test_a_member_called_with_another_input_computes_alone():
    mod = _Siblings()
    x, x2 = mx.random.normal((1, 128), key=mx.random.key(1)), mx.random.normal((1, 128), key=mx.random.key(2))
    linear.install(mod, force=True)

    def alone(name: str, x: mx.array) -> mx.array:
        m = getattr(mod, name)
        return linear.affine_matmul(x, m["weight"], m["scales"], m["biases"], 4, 32)

    q = mod.q_proj(x)
    assert mx.array_equal(mod.k_proj(x2), alone("k_proj", x2))  # not x's part
    assert mx.array_equal(mod.v_proj(x), alone("v_proj", x))  # x's part, still held
    assert mx.array_equal(q, alone("q_proj", x))
    assert linear.uninstall(mod) == 6
    assert all("_siblings" not in getattr(mod, n).__dict__ for n in QKV + GATE_UP)
    assert mx.allclose(mod.k_proj(x2), alone("k_proj", x2), atol=1e-5)  # MLX's class over the view


def test_install_joins_where_the_device_is_listed(monkeypatch):
    if not linear.swapped_here():
        pytest.skip("Metal keeps MLX's classes")
    device = gpu_backend() or "cpu"
    monkeypatch.setitem(linear.JOIN_ROWS, device, 16)
    mod = _Siblings()
    linear.install(mod)
    assert "_siblings" in mod.q_proj.__dict__
    monkeypatch.delitem(linear.JOIN_ROWS, device)
    mod = _Siblings()
    linear.install(mod)
    assert not any("_siblings" in getattr(mod, n).__dict__ for n in QKV + GATE_UP)


def test_siblings_of_other_formats_stay_apart():
    mod = _Siblings(v_bits=8)
    linear.install(mod, force=True)
    assert all("_siblings" not in getattr(mod, n).__dict__ for n in QKV)
    assert "_siblings" in mod.gate_proj.__dict__


def test_route_table():
    """One row on MLX's one-row kernel, 2..16 rows on ours, anything else on MLX's."""
    assert linear.ROUTE == {1: "mlx", **{m: "ours" for m in range(2, 17)}}
    assert qmm.MAX_ROWS == 16
    assert linear.route(mx.zeros((1, 1, 64))) == "mlx"
    assert linear.route(mx.zeros((4, 1, 64))) == "ours"
    assert linear.route(mx.zeros((4, 4, 64))) == "ours"  # 16 rows in all
    assert linear.route(mx.zeros((17, 64))) == "mlx"
    assert linear.route(mx.zeros((0, 64))) == "mlx"


class _Calls:
    """Records the x shapes of mx.quantized_matmul and of the kernel entry (the twin stands in)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.mlx: list[tuple[int, ...]] = []
        self.ours: list[tuple[int, ...]] = []
        real = mx.quantized_matmul

        def spy(x, *args, **kwargs):
            self.mlx.append(tuple(x.shape))
            return real(x, *args, **kwargs)

        def compiled(bits, group, with_bias):
            def call(x, w, scales, biases, b=None):
                self.ours.append(tuple(x.shape))
                y = real(x, w, scales, biases, transpose=True, group_size=group, bits=bits)
                return y if b is None else y + b

            return call

        monkeypatch.setattr(linear, "gpu_backend", lambda: "cuda")
        monkeypatch.setattr(qmm, "ANY_DEVICE", True)
        monkeypatch.setattr(linear, "_compiled", compiled)
        monkeypatch.setattr(mx, "quantized_matmul", spy)

    def take(self) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
        out = (self.mlx, self.ours)
        self.mlx, self.ours = [], []
        return out


def _mlx_shape(x: mx.array) -> tuple[int, ...]:
    """The x MLX's call gets on CUDA: flattened to [rows, K] when x is more than one problem."""
    if x.ndim > 2 and math.prod(x.shape[:-2]) > 1:
        return (x.size // x.shape[-1], x.shape[-1])
    return tuple(x.shape)


@pytest.mark.parametrize("bias", [False, True])
def test_forced_cuda_routes_rows_and_flattens_mlx_calls(monkeypatch, bias):
    """CUDA forced: 1 and 17+ rows go to mx.quantized_matmul, x flattened to 2-D where its
    leading dims hold more than one problem, 2..16 rows to the kernel entry with x as given;
    every output equals QuantizedLinear's, shape included."""
    ql = nn.QuantizedLinear(128, 40, bias=bias, group_size=64, bits=4)
    if bias:
        ql.bias = mx.random.normal((40,))
    shapes = [(1, 128), (1, 1, 128), (2, 1, 128), (1, 5, 128), (16, 1, 128), (4, 4, 128), (17, 1, 128),
              (3, 7, 128), (40, 128)]
    xs = [mx.random.normal(s, key=mx.random.key(i)) for i, s in enumerate(shapes)]
    want = [ql(x) for x in xs]
    calls = _Calls(monkeypatch)
    ql.__class__ = linear.FewRowQuantizedLinear
    for x, w in zip(xs, want, strict=True):
        got = ql(x)
        mlx_calls, ours = calls.take()
        rows = x.size // x.shape[-1]
        if 2 <= rows <= 16:
            assert (mlx_calls, ours) == ([], [tuple(x.shape)])
        else:
            assert (mlx_calls, ours) == ([_mlx_shape(x)], [])
        assert got.shape == w.shape and mx.array_equal(got, w), x.shape


@pytest.mark.parametrize("bias", [False, True])
def test_forced_cuda_dequantizes_prefill_sized_calls(monkeypatch, bias):
    """CUDA forced: from DEQUANTIZE_ROWS rows in all an affine call is a dense matmul over the
    dequantized weight (neither MLX's quantized_matmul nor the kernel), equal to
    QuantizedLinear's up to rounding; one row fewer stays on MLX's; another mode never
    dequantizes."""
    ql = nn.QuantizedLinear(128, 40, bias=bias, group_size=64, bits=4)
    if bias:
        ql.bias = mx.random.normal((40,))
    other = nn.QuantizedLinear(128, 32, bias=False, group_size=32, bits=4, mode="mxfp4")
    n = linear.DEQUANTIZE_ROWS["cuda"]
    shapes = [(n, 128), (2, n // 2, 128), (1, n + 3, 128), (n - 1, 128)]
    xs = [mx.random.normal(s, key=mx.random.key(i)) for i, s in enumerate(shapes)]
    want = [ql(x) for x in xs]
    want_other = [other(x) for x in xs]
    calls = _Calls(monkeypatch)
    ql.__class__ = linear.FewRowQuantizedLinear
    other.__class__ = linear.FewRowQuantizedLinear
    for x, w, wo in zip(xs, want, want_other, strict=True):
        got = ql(x)
        if x.size // x.shape[-1] >= n:
            assert calls.take() == ([], [])
            assert got.shape == w.shape and got.dtype == w.dtype
            assert mx.allclose(got, w, atol=1e-4, rtol=1e-4), x.shape
        else:
            assert calls.take() == ([_mlx_shape(x)], [])
            assert mx.array_equal(got, w)
        assert mx.array_equal(other(x), wo)
        assert calls.take() == ([_mlx_shape(x)], [])


def test_forced_cuda_routes_a_tied_head_and_other_modes(monkeypatch):
    """The tied lm_head (QuantizedEmbedding.as_linear) routes the same way; a layer in another
    mode never takes the kernel but still gets x flattened."""
    emb = nn.QuantizedEmbedding(50, 64, group_size=32, bits=4)
    other = nn.QuantizedLinear(64, 32, bias=False, group_size=32, bits=4, mode="mxfp4")
    xs = [mx.random.normal((b, 1, 64), key=mx.random.key(b)) for b in (1, 3, 20)]
    want_emb = [emb.as_linear(x) for x in xs]
    want_other = [other(x) for x in xs]
    calls = _Calls(monkeypatch)
    emb.__class__ = linear.FewRowQuantizedEmbedding
    other.__class__ = linear.FewRowQuantizedLinear
    for x, we, wo in zip(xs, want_emb, want_other, strict=True):
        b = x.shape[0]
        assert mx.array_equal(emb.as_linear(x), we)
        assert calls.take() == (([], [(b, 1, 64)]) if b == 3 else ([_mlx_shape(x)], []))
        assert mx.array_equal(other(x), wo)
        assert calls.take() == ([_mlx_shape(x)], [])


@pytest.mark.parametrize("bias", [False, True])
def test_cpu_calls_mlx_below_the_dense_rows_and_dense_from_them(monkeypatch, bias):
    """On the CPU without the C++ kernel (kernels/affine/cpu.py: no compiler): below
    DEQUANTIZE_ROWS["cpu"] rows in all a call is MLX's quantized_matmul on x as given (never the
    CUDA kernel, nothing flattened); from there on a dense matmul over the dequantized weight,
    equal to QuantizedLinear's up to float32 rounding."""
    monkeypatch.setattr(linear, "gpu_backend", lambda: None)
    monkeypatch.setattr(linear.cpu_kernel, "takes", lambda *a: False)
    ql = nn.QuantizedLinear(128, 40, bias=bias, group_size=64, bits=4)
    if bias:
        ql.bias = mx.random.normal((40,))
    n = linear.DEQUANTIZE_ROWS["cpu"]
    xs = [mx.random.normal(shape, key=mx.random.key(i))
          for i, shape in enumerate([(4, 1, 128), (n - 1, 128), (n, 1, 128), (2, n, 128)])]
    want = [ql(x) for x in xs]
    real = mx.quantized_matmul
    seen: list[tuple[int, ...]] = []
    monkeypatch.setattr(mx, "quantized_matmul", lambda x, *a, **k: seen.append(tuple(x.shape)) or real(x, *a, **k))
    ql.__class__ = linear.FewRowQuantizedLinear
    for x, w in zip(xs, want, strict=True):
        got = ql(x)
        if x.size // x.shape[-1] < n:
            assert mx.array_equal(got, w) and seen == [tuple(x.shape)]
        else:
            assert seen == [] and got.shape == w.shape and mx.allclose(got, w, atol=1e-5, rtol=1e-5)
        seen.clear()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_exact_tier_with_the_swap_forced(arch, monkeypatch):
    """Batched rows equal rows run alone and greedy speculation equals plain greedy, float32,
    with every quantized layer swapped and the CUDA routing forced (on the CPU: the kernel entry
    and MLX's calls through MLX's twin, MLX's with x flattened)."""
    from tests.test_spec_engine import _outputs, _repetitive_prompts, exact_tier
    from tests.tiny_models import greedy, loaded

    model, cfg = _tiny_quantized(arch, vocab_size=16)  # outputs repeat: n-gram lookups hit
    lm = loaded(model, cfg)
    prompts = _repetitive_prompts(cfg["vocab_size"], 4, seed=7)
    reqs = [greedy(f"q{i}", p, max_tokens=20 + 4 * i) for i, p in enumerate(prompts)]
    want, _ = _outputs(lm, None, reqs, prefill_chunk=32)  # MLX's QuantizedLinear, batched
    calls = _Calls(monkeypatch)
    assert linear.install(model, force=True) > 0
    try:
        st = exact_tier(lm, reqs, want)
    finally:
        linear.uninstall(model)
    mlx_calls, ours = calls.take()
    assert ours and all(2 <= math.prod(s[:-1]) <= 16 for s in ours)  # decode batches and verifies
    assert mlx_calls and all(len(s) == 2 or math.prod(s[:-2]) == 1 for s in mlx_calls)
    assert st.spec_steps > 0


# ---- the CUDA source, built by nvcc (no GPU needed) -----------------------------------------

_NVCC = shutil.which("nvcc") or ("/usr/local/cuda-13.0/bin/nvcc" if os.path.exists("/usr/local/cuda-13.0/bin/nvcc") else None)


@pytest.mark.skipif(_NVCC is None, reason="no nvcc")
@pytest.mark.parametrize(
    "body,dtype,rows,bits,group,cfg",
    [
        ("mma", "bfloat16", 1, 4, 64, qmm.default_config(4096, 4096, 4)),
        ("mma", "float16", 16, 8, 32, qmm.LaunchConfig("mma", 4, 8, 2)),
        ("mma", "bfloat16", 9, 4, 128, qmm.LaunchConfig("mma", 1, 1, 1)),
        ("simt", "float32", 16, 4, 64, qmm.FLOAT32),
        ("simt", "float32", 1, 8, 128, qmm.FLOAT32),
        ("simt", "bfloat16", 2, 4, 64, qmm.LaunchConfig("simt", 4, 4, 2)),
        ("mma4", "bfloat16", 16, 4, 64, qmm.LaunchConfig("mma4", 4, 8, 2)),
        ("mma4", "float16", 3, 4, 32, qmm.LaunchConfig("mma4", 1, 2, 1)),
    ],
)
def test_cuda_source_compiles_for_sm90_without_spills(tmp_path, body, dtype, rows, bits, group, cfg):
    """The translation unit MLX builds (its wrapper written out, MLX's header replaced by the
    CUDA headers it includes), built by nvcc for sm_90: no errors, no register spills."""
    text = src.harness_source(body, qmm.constants(cfg, rows, bits), dtype)
    cu = tmp_path / "k.cu"
    cu.write_text(text)
    proc = subprocess.run(
        [_NVCC, "-std=c++17", "-arch=sm_90", "-cubin", "-Xptxas", "-v", "-o", str(tmp_path / "k.cubin"), str(cu)],
        capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    spills = [int(v) for v in re.findall(r"(\d+) bytes spill stores", proc.stderr)]
    assert spills and max(spills) == 0, proc.stderr[-2000:]


# ---- on the GPU (MLX-CUDA) ------------------------------------------------------------------

# of max |y|: an indexing error is O(1). float32 allows for MLX's reference itself taking TF32 tensor
# cores in some kernels; the 16-bit dtypes for the output rounding and the weights dequantized to them.
_TOL = {mx.float32: 1e-3, mx.float16: 4e-3, mx.bfloat16: 2e-2}


def _needs_cuda():
    if gpu_backend() != "cuda":
        pytest.skip("needs MLX-CUDA")


def _compare(n, k, rows, bits, group, dtype, config=None, lead=()):
    wq, scales, biases = _quantized(n, k, bits, group, dtype, seed=n + k + rows)
    x = (mx.random.normal((*lead, rows, k), key=mx.random.key(rows)) / 4).astype(dtype)
    got = qmm.affine_qmm(x, wq, scales, biases, bits=bits, group=group, config=config)
    # the reference in float32 from the same (rounded) activations and weights
    want = qmm.twin(x.astype(mx.float32), wq, scales.astype(mx.float32), biases.astype(mx.float32), bits=bits, group=group)
    assert got.dtype == dtype and got.shape == want.shape
    err = float(mx.abs(got.astype(mx.float32) - want).max())
    scale = float(mx.abs(want).max())
    assert err <= _TOL[dtype] * scale, (err, scale, config)


@pytest.mark.gpu
@pytest.mark.parametrize("bits,group", BITS_GROUPS)
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
def test_cuda_kernel_equals_quantized_matmul_every_row_count(bits, group, dtype):
    _needs_cuda()
    for rows in range(1, qmm.MAX_ROWS + 1):
        _compare(389, 512, rows, bits, group, dtype)  # odd N


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 16])
def test_cuda_every_candidate_layout(rows):
    _needs_cuda()
    for cfg in qmm.candidates(mx.bfloat16, rows, 4):
        _compare(200, 4096 + 128, rows, 4, 64, mx.bfloat16, cfg)  # K not a multiple of 1024
    for cfg in qmm.candidates(mx.float16, rows, 4)[::5]:
        _compare(77, 512 + 32, rows, 4, 32, mx.float16, cfg)


@pytest.mark.gpu
def test_cuda_odd_shapes_and_leading_dims():
    _needs_cuda()
    _compare(7, 96, 3, 4, 32, mx.bfloat16)  # K = 96: lanes past K idle
    _compare(1, 160, 16, 8, 32, mx.float16)
    _compare(4096, 4096, 2, 4, 64, mx.bfloat16, lead=(2,))  # [2, 2, K]


@pytest.mark.gpu
def test_cuda_float32_rows_equal_rows_alone():
    """One layout for float32: a row's output is bit-identical alone and in a batch."""
    _needs_cuda()
    wq, scales, biases = _quantized(300, 1024, 4, 64)
    x = mx.random.normal((16, 1024))
    batched = qmm.affine_qmm(x, wq, scales, biases, bits=4, group=64)
    for m in (0, 5, 15):
        alone = qmm.affine_qmm(x[m : m + 1], wq, scales, biases, bits=4, group=64)
        assert mx.array_equal(alone[0], batched[m])


@pytest.mark.gpu
def test_cuda_linear_matches_mlx():
    """Every route on MLX-CUDA: one row and 20 rows (MLX's, flattened), 4 and 8 rows (ours),
    a prefill of DEQUANTIZE_ROWS["cuda"] + 8 tokens (dequantized, dense)."""
    _needs_cuda()
    model, _ = _tiny_quantized()
    model.set_dtype(mx.bfloat16)
    for shape in ((1, 1), (1, 4), (8, 1), (2, 10), (1, linear.DEQUANTIZE_ROWS["cuda"] + 8)):
        tokens = mx.random.randint(0, 60, shape, key=mx.random.key(shape[0])).astype(mx.int32)
        want = model(tokens).astype(mx.float32)
        assert linear.install(model) > 0
        got = model(tokens).astype(mx.float32)
        linear.uninstall(model)
        assert float(mx.abs(got - want).max()) <= 0.05 * float(mx.abs(want).max()), shape


@pytest.mark.gpu
def test_cuda_kernel_reads_x_views_at_any_offset():
    """x a view 3 elements into a buffer (not 8- or 16-byte aligned): the vector loads step aside."""
    _needs_cuda()
    wq, scales, biases = _quantized(72, 256, 4, 64, mx.bfloat16)
    for dtype in (mx.bfloat16, mx.float32):
        s, b = scales.astype(dtype), biases.astype(dtype)
        for rows in (1, 12):
            buf = mx.random.normal((rows * 256 + 3,)).astype(dtype)
            x = buf[3:].reshape(rows, 256)
            got = qmm.affine_qmm(x, wq, s, b, bits=4, group=64).astype(mx.float32)
            want = qmm.twin(x.astype(mx.float32), wq, s.astype(mx.float32), b.astype(mx.float32), bits=4, group=64)
            assert float(mx.abs(got - want).max()) <= _TOL[dtype] * float(mx.abs(want).max())


def test_bench_variants_and_table(monkeypatch):
    """bench qmm's variants: "flat" is MLX's with x flattened (never the kernel), "mlxd" the
    install, "stock" MLX's classes back from either; its kernel table marks a failed check."""
    from bench import qmm as bench_qmm

    model, _ = _tiny_quantized()
    tokens = mx.array([[3, 4, 5], [6, 7, 8]], dtype=mx.int32)
    want = model(tokens)
    calls = _Calls(monkeypatch)
    for variant, cls in (("flat", bench_qmm.FlatQuantizedLinear), ("mlxd", linear.FewRowQuantizedLinear),
                         ("stock", nn.QuantizedLinear), ("flat", bench_qmm.FlatQuantizedLinear)):
        bench_qmm.set_variant(model, variant)
        assert type(model.model.layers[0].mlp.up_proj) is cls
        calls.take()
        assert mx.array_equal(model(tokens), want), variant
        mlx_calls, ours = calls.take()
        if variant == "flat":
            assert not ours and mlx_calls and all(len(s) == 2 for s in mlx_calls)
        if variant == "mlxd":
            assert ours  # 6 rows in all: the kernel entry
    with pytest.raises(ValueError, match="variant"):
        bench_qmm.set_variant(model, "pad8")
    bench_qmm.set_variant(model, "stock")
    rows = [
        {"shape": [64, 64], "rows": 1, "mlx_us": 20.0, "ours_us": 10.0, "ours_compiled_us": 8.0, "ours_GBps": 1.0, "ours_layout": "mma-t1-w2-u1"},
        {"shape": [64, 64], "rows": 4, "mlx_us": 40.0},
    ]
    table = bench_qmm.kernel_table(rows).splitlines()
    assert "2.00x" in table[1] and table[2].endswith("FAILED")
    assert "pad8" not in table[0]


@pytest.mark.parametrize("backend", ["cuda", None, "metal"])
def test_dense_copies_counted_in_prefill_activations(monkeypatch, backend):
    """A forward of the device's DEQUANTIZE_ROWS tokens or more holds dense copies of weights:
    the memory budget counts two of the largest (a tied head included) from that many tokens
    on; on Metal (MLX's kernel) nothing."""
    from engine.kv.memory import MemoryBudget

    model, _ = _tiny_quantized(tie_word_embeddings=True)
    monkeypatch.setattr(linear, "gpu_backend", lambda: backend)
    budget = MemoryBudget.for_model(model, 1 << 34, {})
    if backend == "metal":
        assert linear.dequantized_peak_bytes(model) == 0 and budget.dense_bytes == 0
        return
    dense = {n: m["weight"].shape[0] * m["weight"].shape[1] * 32 // m.bits * m["scales"].dtype.size
             for n, m in model.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))}
    n = linear.DEQUANTIZE_ROWS[backend or "cpu"]
    assert budget.dense_bytes == linear.dequantized_peak_bytes(model) == 2 * max(dense.values()) > 0
    assert budget.dense_from == n
    assert budget.transient(n, 10) - budget.transient(n - 1, 10) == (
        budget.dense_bytes + budget.prefill_bytes_per_token + budget.score_bytes * 10)


def test_bench_prefill_products_and_table():
    """bench qmm --prefill: each (bits, shape, rows) timed both ways and checked against MLX's;
    its table gives MLX's time over the dense path's."""
    import argparse

    from bench import qmm as bench_qmm

    result: dict = {}
    saved = []
    failures = bench_qmm.bench_prefill_kernels(
        argparse.Namespace(shapes=[(64, 128)], rows=[3, 5]), result, lambda: saved.append(1))
    rows = result["prefill_kernels"]
    assert failures == [] and len(saved) == 2
    assert [(r["bits"], r["rows"]) for r in rows] == [(4, 3), (4, 5), (8, 3), (8, 5)]
    assert all(r["mlx_us"] > 0 and r["dequantize_us"] > 0 and r["shape"] == [64, 128] for r in rows)
    few = gpu_backend() is None and linear.cpu_kernel.available()  # the CPU's C++ kernel timed too
    assert all(("cpu_kernel_us" in r) == few for r in rows)
    base = {k: v for k, v in rows[0].items() if k != "cpu_kernel_us"}
    table = bench_qmm.prefill_kernel_table([{**base, "mlx_us": 30.0, "dequantize_us": 10.0}]).splitlines()
    assert table[1].rstrip().endswith("3.00x")
    table = bench_qmm.prefill_kernel_table([{**base, "mlx_us": 30.0, "dequantize_us": 10.0, "cpu_kernel_us": 5.0}])
    assert table.splitlines()[1].rstrip().endswith("3.00x        5.0     6.00x")


@pytest.mark.parametrize("parts", [2, 3])
def test_cpu_split_products_are_bit_identical(monkeypatch, parts):
    """On the CPU a weight of CPU_SPLIT_WEIGHTS elements or more below the dense rows is split by
    output rows over `parts` streams: the same outputs bit for bit, bias included, one MLX call
    per part."""
    monkeypatch.setattr(linear, "gpu_backend", lambda: None)
    monkeypatch.setattr(linear.cpu_kernel, "takes", lambda *a: False)  # MLX's kernel, split
    monkeypatch.setattr(linear, "cpu_streams", lambda: parts)
    ql = nn.QuantizedLinear(2048, 2050 if parts == 3 else 2048, bias=True, group_size=64, bits=4)
    ql.bias = mx.random.normal((ql.weight.shape[0],))
    assert ql.weight.shape[0] * 2048 >= linear.CPU_SPLIT_WEIGHTS
    xs = [mx.random.normal(s, key=mx.random.key(i)) for i, s in enumerate([(1, 1, 2048), (4, 1, 2048), (1, 15, 2048)])]
    want = [ql(x) for x in xs]
    real = mx.quantized_matmul
    seen: list[int] = []
    monkeypatch.setattr(mx, "quantized_matmul", lambda x, w, *a, **k: seen.append(w.shape[0]) or real(x, w, *a, **k))
    ql.__class__ = linear.FewRowQuantizedLinear
    for x, w in zip(xs, want, strict=True):
        assert mx.array_equal(ql(x), w)
        assert len(seen) == parts and sum(seen) == ql.weight.shape[0]
        seen.clear()


def test_cpu_split_products_on_another_thread(monkeypatch):
    """MLX's streams belong to the thread that made them: a split product evaluated first on
    one thread (the warm-up) and then on another (the engine's) still runs, bit-identical."""
    import threading

    monkeypatch.setattr(linear, "gpu_backend", lambda: None)
    monkeypatch.setattr(linear.cpu_kernel, "takes", lambda *a: False)  # MLX's kernel, split
    monkeypatch.setattr(linear, "cpu_streams", lambda: 2)
    ql = nn.QuantizedLinear(2048, 2048, bias=False, group_size=64, bits=4)
    x = mx.random.normal((1, 1, 2048))
    want = ql(x)
    ql.__class__ = linear.FewRowQuantizedLinear
    assert mx.array_equal(ql(x), want)
    got: list[object] = []

    def run() -> None:
        try:
            got.append(bool(mx.array_equal(ql(x), want)))
        except Exception as exc:  # noqa: BLE001 (reported below)
            got.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert got == [True]
