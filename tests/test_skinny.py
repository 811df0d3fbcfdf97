"""Fused skinny GEMM (kernels/skinny) == the plain-MLX twin x @ w.T.

- CPU (CI): the kernel's shared body, compiled with g++ behind a prelude that runs each lane of a
  warp as a thread (shuffles through a barrier), against numpy; the CUDA source parses under stub
  headers, and compiles for sm_90 with nvcc where nvcc is installed; the engine's dispatch.
- CUDA (``-m gpu`` on the GPU machine): the real kernel through mx.fast.cuda_kernel.
"""

from __future__ import annotations

import os
import shutil
import subprocess

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("MLX_PTX_CACHE_DIR", f"/tmp/mlx-ptx-{os.environ['PYTEST_XDIST_WORKER']}")

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from engine import skinny
from kernels.skinny import kernel as sk
from kernels.skinny import source as src

DT = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def _inputs(m: int, n: int, k: int, dtype: str, seed: int = 0):
    """x (M, K), w (N, K) rounded to dtype: (raw arrays for the harness, float64 copies)."""
    rng = np.random.default_rng(seed)
    x = mx.array(rng.standard_normal((m, k)).astype(np.float32)).astype(DT[dtype])
    w = mx.array((rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)).astype(DT[dtype])
    f64 = (np.array(x.astype(mx.float32), dtype=np.float64), np.array(w.astype(mx.float32), dtype=np.float64))
    if dtype == "float32":
        return (np.array(x), np.array(w)), f64
    return (np.array(x.view(mx.uint16)), np.array(w.view(mx.uint16))), f64


# ---- CPU: the shared body through the C++ prelude ---------------------------------------------

needs_cxx = pytest.mark.skipif(sk.cpu_compiler() is None, reason="no C++ compiler for the CPU harness")

CPU_CASES = [
    # (m, n, k, dtype, r, u, offset): odd row counts, rows shorter than one warp step, rows that
    # end mid-step, every R, several U, the unaligned load path
    (2, 37, 96, "float32", None, None, 0),
    (3, 5, 8, "bfloat16", None, None, 0),
    (4, 131, 384, "bfloat16", 4, 2, 0),
    (5, 19, 264, "float16", 2, 3, 0),
    (7, 33, 1032, "bfloat16", 4, 1, 0),
    (8, 64, 40, "float32", 4, 2, 1),
    (6, 9, 520, "float16", 1, 8, 3),
    (1, 12, 128, "float32", 2, None, 0),
    (16, 7, 72, "bfloat16", 2, 2, 0),
    (9, 30, 256, "float32", 1, 4, 0),
    (12, 3, 16, "float16", None, None, 0),
]


@needs_cxx
@pytest.mark.parametrize("m,n,k,dtype,r,u,offset", CPU_CASES)
def test_kernel_body_on_cpu_equals_numpy(m, n, k, dtype, r, u, offset):
    (x_raw, w_raw), (x64, w64) = _inputs(m, n, k, dtype, seed=m * 100 + n)
    got = sk.skinny_matmul_cpu_harness(x_raw, w_raw, dtype, r=r, u=u, offset=offset)
    ref = x64 @ w64.T
    assert got.shape == (m, n) and np.isfinite(got).all()  # every output written (y starts as nan)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@needs_cxx
def test_cpu_harness_can_fail():
    """A wrong answer is caught: the harness result differs when one weight changes."""
    (x_raw, w_raw), (x64, w64) = _inputs(3, 10, 64, "float32")
    w_raw = w_raw.copy()
    w_raw[7, 33] += 1.0
    got = sk.skinny_matmul_cpu_harness(x_raw, w_raw, "float32")
    ref = x64 @ w64.T
    assert not np.allclose(got[:, 7], ref[:, 7], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.delete(got, 7, axis=1), np.delete(ref, 7, axis=1), rtol=1e-5, atol=1e-6)


def test_every_backend_runs_the_same_body():
    source, header = sk.kernel_source()
    assert src.BODY in source and src.SHARED_HELPERS in header
    assert src.BODY in src.cpu_harness_source({"M": 2, "R": 1, "U": 1, "NP": 2}, "bfloat16")
    assert len(src.CUDA_PROLOGUE) < len(src.BODY) / 8  # the per-backend part stays thin


def test_layouts():
    for m in range(1, sk.MAX_ROWS + 1):
        for n in (1, 7, 128, 384, 1024, 4096, 8192, 151936):
            for k, itemsize in ((8, 2), (384, 2), (4096, 2), (14336, 2), (4096, 4)):
                lay = sk.layout(m, n, k, itemsize)
                assert lay.r in (1, 2, 4) and lay.r * m <= lay.np <= 32
                assert lay.np & (lay.np - 1) == 0 and lay.r * lay.u <= 8 and lay.u >= 1
    assert sk.layout(2, 8192, 4096, 2).r == 4 and sk.layout(8, 8192, 384, 2).r == 4
    assert sk.layout(8, 4096, 4096, 2).r == 2 and sk.layout(16, 8192, 4096, 2).r == 2
    assert sk.layout(4, 384, 384, 2).r == 1 and sk.layout(4, 384, 1024, 2).u == 4
    with pytest.raises(ValueError):
        sk.layout(17, 64, 64, 2)


def test_launch_geometry_covers_every_row():
    for m in (1, 2, 5, 8, 16):
        for n in (1, 3, 127, 128, 129, 4096, 8191):
            args = sk.launch_args(m, n, 384, mx.bfloat16, (m,))
            consts = dict(args["template"])
            threads = args["threadgroup"][0]
            assert threads % 32 == 0 and args["grid"][0] % threads == 0
            rows_covered = args["grid"][0] // 32 * consts["R"]
            assert n <= rows_covered < n + threads // 32 * consts["R"]
            assert consts["M"] == m and consts["DT"] == mx.bfloat16
            assert args["output_shapes"] == [(m, n)] and args["output_dtypes"] == [mx.bfloat16]


def test_supported():
    w = mx.zeros((64, 96), dtype=mx.bfloat16)
    assert sk.supported(mx.zeros((3, 96), dtype=mx.bfloat16), w)
    assert sk.supported(mx.zeros((2, 2, 96), dtype=mx.bfloat16), w)
    assert not sk.supported(mx.zeros((3, 96), dtype=mx.float32), w)  # mixed dtypes
    assert not sk.supported(mx.zeros((17, 96), dtype=mx.bfloat16), w)  # too many rows
    assert not sk.supported(mx.zeros((3, 100), dtype=mx.bfloat16), mx.zeros((64, 100), dtype=mx.bfloat16))  # K % 8
    assert not sk.supported(mx.zeros((3, 96), dtype=mx.int32), mx.zeros((64, 96), dtype=mx.int32))


# ---- the CUDA source parses (stub headers) and compiles for sm_90 (nvcc, where installed) -------

_CUDA_STUBS = r"""
#include <cstdint>
#include <cstring>
#include <cmath>
#define __device__
#define __global__
#define __forceinline__ inline
struct __half { unsigned short b; __half() {} __half(float) {} operator float() const { return 0.f; } };
struct __nv_bfloat16 { unsigned short b; __nv_bfloat16() {} __nv_bfloat16(float) {} operator float() const { return 0.f; } };
inline float __uint_as_float(unsigned int b) { float f; std::memcpy(&f, &b, 4); return f; }
inline __half __ushort_as_half(unsigned short b) { __half h; h.b = b; return h; }
inline float __half2float(__half h) { return (float)h; }
inline float __shfl_xor_sync(unsigned int, float v, int) { return v; }
struct uint4 { unsigned int x, y, z, w; };
struct dim3_stub { unsigned int x, y, z; };
static dim3_stub threadIdx, blockIdx, blockDim;
"""

_CUDA_TYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}


def _cuda_unit(dtype: str, consts: dict[str, int], prelude: str) -> str:
    source, header = sk.kernel_source()
    t = _CUDA_TYPES[dtype]
    return (
        prelude
        + header
        + "namespace mlx { namespace core { namespace cu {\n"
        + f"__global__ void k(const {t}* w, const {t}* x, const int32_t* dims, {t}* y) {{\n"
        + "".join(f"  constexpr int {k} = {v};\n" for k, v in consts.items())
        + f"  using DT = {t};\n"
        + source
        + "}\n}}}\n"
    )


@needs_cxx
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_cuda_source_parses(tmp_path, dtype):
    path = tmp_path / "k.cpp"
    path.write_text(_cuda_unit(dtype, {"M": 3, "R": 4, "U": 2, "NP": 16}, _CUDA_STUBS))
    proc = subprocess.run([sk.cpu_compiler(), "-std=c++17", "-fsyntax-only", "-Wno-unknown-pragmas", str(path)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]


_NVCC_PRELUDE = "#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n#include <cstdint>\n"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("m,n,k", [(2, 4096, 4096), (16, 4096, 4096), (8, 8192, 384)])
def test_cuda_source_compiles_for_sm90_without_spills(tmp_path, dtype, m, n, k):
    """What MLX's NVRTC gets (minus its own device header), built by nvcc for sm_90: no errors,
    no register spills for the layouts the dispatch picks."""
    import re

    args = sk.launch_args(m, n, k, DT[dtype], (m,))
    consts = {name: v for name, v in args["template"] if name != "DT"}
    path = tmp_path / "k.cu"
    path.write_text(_cuda_unit(dtype, consts, _NVCC_PRELUDE))
    proc = subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "-o", str(tmp_path / "k.cubin"), "-Xptxas", "-v", str(path)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    spills = [int(v) for v in re.findall(r"(\d+) bytes spill stores", proc.stderr)]
    stack = [int(v) for v in re.findall(r"(\d+) bytes stack frame", proc.stderr)]
    assert spills and max(spills) == 0 and max(stack) == 0, proc.stderr[-2000:]


# ---- the engine's dispatch (no GPU needed: the kernel is faked) --------------------------------


class _FakeKernel:
    def __init__(self):
        self.calls = []

    def __call__(self, x, w, prepared):
        assert prepared[0]["output_shapes"] == [(*x.shape[:-1], w.shape[0])]
        self.calls.append((tuple(x.shape), tuple(w.shape)))
        return x @ w.T + 1000.0  # recognisably not the plain path


@pytest.fixture
def fake_gpu(monkeypatch):
    fake = _FakeKernel()
    monkeypatch.setattr(skinny, "_on_gpu", lambda: True)
    monkeypatch.setattr(skinny._sk, "launch", fake)
    monkeypatch.setattr(skinny, "_PLAN", {})
    return fake


def test_dispatch_rule(fake_gpu):
    lin = nn.Linear(64, 48)
    assert skinny.install(lin, force=True) == 1 and type(lin) is skinny.SkinnyLinear
    plain = lambda x: x @ lin.weight.T + lin.bias  # noqa: E731
    for shape, fused in [((1, 64), False), ((2, 64), True), ((skinny.MAX_ROWS, 64), True),
                         ((skinny.MAX_ROWS + 1, 64), False), ((2, 3, 64), skinny.MAX_ROWS >= 6), ((64,), False)]:
        x = mx.random.normal(shape)
        y = lin(x)
        assert y.shape == (*shape[:-1], 48)
        off = float(mx.max(mx.abs(y - plain(x))))
        assert (off > 500) == fused, (shape, off)
    # mixed dtypes take the plain matmul
    n = len(fake_gpu.calls)
    lin(mx.random.normal((4, 64)).astype(mx.bfloat16))
    assert len(fake_gpu.calls) == n


def test_tied_embedding_dispatch(fake_gpu):
    emb = nn.Embedding(100, 32)
    assert skinny.install(emb, force=True) == 1 and type(emb) is skinny.SkinnyEmbedding
    x = mx.random.normal((4, 32))
    assert float(mx.min(emb.as_linear(x) - x @ emb.weight.T)) > 500
    ids = mx.array([[1, 2, 3]])
    assert mx.array_equal(emb(ids), emb.weight[ids])  # the lookup is unchanged


def test_install_leaves_quantized_and_subclasses(monkeypatch):
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(64, 64)
            self.q = nn.QuantizedLinear(64, 64, group_size=32, bits=4)
            self.e = nn.Embedding(10, 64)

    b = Block()
    assert skinny.install(b) == 0  # CPU: a no-op unless forced
    assert type(b.a) is nn.Linear
    assert skinny.install(b, force=True) == 2
    assert type(b.a) is skinny.SkinnyLinear and type(b.q) is nn.QuantizedLinear
    assert type(b.e) is skinny.SkinnyEmbedding
    assert set(dict(b.parameters())) == {"a", "q", "e"}
    assert skinny.uninstall(b) == 2 and type(b.a) is nn.Linear
    monkeypatch.setenv("MLXD_SKINNY", "0")
    assert not skinny.enabled()
    monkeypatch.delenv("MLXD_SKINNY")
    assert not skinny.enabled()  # opt-in: slower than cuBLASLt on the H200 (engine/skinny.py)


def test_warm_up_builds_each_variant_once(monkeypatch, tinycoder_path):
    from mlx_lm.utils import load_model

    model, _ = load_model(tinycoder_path)
    model.set_dtype(mx.bfloat16)
    assert skinny.install(model, force=True, warm=False) > 0
    calls = []
    monkeypatch.setattr(skinny._sk, "skinny_matmul", lambda x, w: calls.append((x.shape, w.shape)) or x @ w.T)
    n = skinny.warm_up(model, range(2, 5))
    # tinycoder: K = 384 (U = 2) and K = 1024 (U = 4) rows at R = 1, the 8192-row lm_head at R = 4
    assert n == len(calls) == 3 * 3
    assert {c[0][0] for c in calls} == {2, 3, 4}


def test_install_falls_back_when_the_kernel_fails(monkeypatch):
    lin = nn.Linear(64, 32)

    def broken(x, w):
        raise RuntimeError("Failed to compile kernel")

    monkeypatch.setattr(skinny._sk, "skinny_matmul", broken)
    with pytest.warns(UserWarning, match="warm-up failed"):
        assert skinny.install(lin, force=True, warm=True) == 0
    assert type(lin) is nn.Linear


def test_installed_model_on_cpu_is_unchanged(tinycoder_path):
    """install(force) on the CPU: every call takes the plain matmul, logits bit-identical."""
    from mlx_lm.utils import load_model

    model, _ = load_model(tinycoder_path)
    tokens = mx.array([[5, 17, 99, 3], [8, 1, 2, 300]])
    ref = model(tokens)
    assert skinny.install(model, force=True) > 0
    assert mx.array_equal(model(tokens), ref)


# ---- GPU: the real kernel ---------------------------------------------------------------------

gpu = pytest.mark.gpu


def _cuda():
    if not (mx.default_device() == mx.gpu and hasattr(mx, "cuda") and mx.cuda.is_available()):
        pytest.skip("needs the CUDA backend")


TOL = {"float32": 1e-4, "float16": 4e-3, "bfloat16": 2e-2}
GPU_SHAPES = [(37, 96), (5, 8), (131, 384), (384, 384), (1000, 1032), (8192, 384), (4096, 4096), (3, 4104)]


def _check(y: mx.array, x: mx.array, w: mx.array, dtype: str):
    with mx.stream(mx.cpu):
        ref = np.array(x.astype(mx.float32) @ w.astype(mx.float32).T)
    assert y.dtype == DT[dtype] and y.shape == (*x.shape[:-1], w.shape[0])
    got = np.array(y.astype(mx.float32))
    np.testing.assert_allclose(got, ref, rtol=TOL[dtype], atol=TOL[dtype] * max(1e-6, np.abs(ref).max()))
    # and the plain-MLX twin on the GPU (cuBLASLt / gemv) agrees as well; MLX-CUDA's float32
    # cuBLASLt matmul runs in TF32 (10-bit mantissa), so the twin gets TF32's tolerance there
    plain = np.array((x @ w.T).astype(mx.float32))
    tol = 2e-3 if dtype == "float32" else 2 * TOL[dtype]
    np.testing.assert_allclose(got, plain, rtol=tol, atol=tol * max(1e-6, np.abs(ref).max()))


# bfloat16 (the engine's dtype): most M on every shape, the rest on two; float16 / float32 on
# fewer. Each distinct (M, R, U, dtype) is one NVRTC compile (~0.5 s), so the list stays short.
GPU_CASES = (
    [(m, n, k, "bfloat16") for m in (2, 3, 4, 5, 8, 16) for n, k in GPU_SHAPES]
    + [(m, n, k, "bfloat16") for m in (1, 6, 7) for n, k in ((37, 96), (4096, 4096))]
    + [(m, n, k, dt) for dt in ("float16", "float32") for m in (2, 7) for n, k in GPU_SHAPES[::2]]
    + [(4, n, k, dt) for dt in ("float16", "float32") for n, k in GPU_SHAPES[1::2]]
)


@gpu
@pytest.mark.parametrize("m,n,k,dtype", GPU_CASES)
def test_cuda_kernel_equals_plain(m, n, k, dtype):
    _cuda()
    x = mx.random.normal((m, k), key=mx.random.key(m + n)).astype(DT[dtype])
    w = (mx.random.normal((n, k), key=mx.random.key(k)) / k**0.5).astype(DT[dtype])
    _check(sk.skinny_matmul(x, w), x, w, dtype)


@gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cuda_leading_dims_views_and_offsets(dtype):
    _cuda()
    k, n = 384, 131
    w = (mx.random.normal((n, k), key=mx.random.key(1)) / k**0.5).astype(DT[dtype])
    x3 = mx.random.normal((2, 3, k), key=mx.random.key(2)).astype(DT[dtype])
    _check(sk.skinny_matmul(x3, w), x3, w, dtype)  # leading dims
    wide = mx.random.normal((4, 2 * k), key=mx.random.key(3)).astype(DT[dtype])
    xs = wide[:, ::2]  # not row-contiguous: MLX copies it for the kernel
    _check(sk.skinny_matmul(xs, w), xs, w, dtype)
    xt = mx.random.normal((k, 5), key=mx.random.key(4)).astype(DT[dtype]).T  # transposed view
    _check(sk.skinny_matmul(xt, w), xt, w, dtype)
    flat = mx.random.normal((1 + 3 * k,), key=mx.random.key(5)).astype(DT[dtype])
    xo = flat[1:].reshape(3, k)  # one element into its buffer: not 16-byte aligned
    _check(sk.skinny_matmul(xo, w), xo, w, dtype)
    wflat = (mx.random.normal((3 + n * k,), key=mx.random.key(6)) / k**0.5).astype(DT[dtype])
    wo = wflat[3:].reshape(n, k)
    _check(sk.skinny_matmul(xo, wo), xo, wo, dtype)


@gpu
def test_cuda_modules_equal_plain():
    _cuda()
    lin = nn.Linear(384, 1000, bias=True)
    lin.set_dtype(mx.bfloat16)
    ref_lin = nn.Linear(384, 1000, bias=True)
    ref_lin.update(lin.parameters())
    emb = nn.Embedding(8192, 384)
    emb.set_dtype(mx.bfloat16)
    ref_emb = nn.Embedding(8192, 384)
    ref_emb.update(emb.parameters())
    assert skinny.install(lin) == 1 and skinny.install(emb) == 1  # on CUDA without force
    for m in (1, 2, 4, 8):
        x = mx.random.normal((m, 384), key=mx.random.key(m)).astype(mx.bfloat16)
        a, b = np.array(lin(x).astype(mx.float32)), np.array(ref_lin(x).astype(mx.float32))
        np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-2 * np.abs(b).max())
        a, b = np.array(emb.as_linear(x).astype(mx.float32)), np.array(ref_emb.as_linear(x).astype(mx.float32))
        np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-2 * np.abs(b).max())


@gpu
def test_cuda_model_logits_close(tinycoder_path):
    """The bundled model in bfloat16, 4 rows: logits with the kernel close to those without."""
    _cuda()
    from mlx_lm.utils import load_model

    model, _ = load_model(tinycoder_path)
    model.set_dtype(mx.bfloat16)
    tokens = mx.random.randint(3, 8000, (4, 1), key=mx.random.key(0))
    ref = model(tokens).astype(mx.float32)
    assert skinny.install(model) > 0
    got = model(tokens).astype(mx.float32)
    scale = float(mx.max(mx.abs(ref)))
    assert float(mx.max(mx.abs(got - ref))) < 5e-2 * scale
    skinny.uninstall(model)


@gpu
def test_cuda_engine_loader_installs(monkeypatch):
    """engine.loader.load_model (target and draft models go through it) installs the dispatch
    when asked (MLXD_SKINNY=1), and leaves the model alone by default."""
    _cuda()
    from engine.loader import load_model

    kinds = {type(m) for _, m in load_model(None, dtype="bfloat16").model.named_modules()}
    assert skinny.SkinnyLinear not in kinds and nn.Linear in kinds
    monkeypatch.setenv("MLXD_SKINNY", "1")
    loaded = load_model(None, dtype="bfloat16")
    kinds = {type(m) for _, m in loaded.model.named_modules()}
    assert skinny.SkinnyLinear in kinds and nn.Linear not in kinds
    tokens = mx.array([[5, 17], [99, 3], [8, 1]])
    assert np.isfinite(np.array(loaded.model(tokens).astype(mx.float32))).all()
