"""Fused trellis mat-vec == the plain-MLX reference.

- CPU (CI): the kernel's shared body, compiled with g++ behind a one-lane-at-a-time prelude.
- CUDA (``-m gpu`` on the GPU machine): the real kernel through mx.fast.cuda_kernel.
- Metal: the same tests run on a Mac (no Metal machine is available to this project).
"""

from __future__ import annotations

import itertools
import os

# Under pytest-xdist every worker compiles kernels: give each its own MLX cubin cache, so that no
# worker reads a cache file another one is still writing (MLX reads the variable at first compile).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("MLX_PTX_CACHE_DIR", f"/tmp/mlx-ptx-{os.environ['PYTEST_XDIST_WORKER']}")

import mlx.core as mx
import numpy as np
import pytest

from kernels.trellis import kernel_source as ks
from kernels.trellis import matvec
from kernels.trellis.matvec import SMEM, LaunchConfig
from kernels.trellis.quantizer import TrellisWeight, dequantize_rotated_ref

# (n_out, n_in, block): odd row counts, row lengths that are 3/5/7 x a power of two.
SHAPES = [
    (37, 96, 32),
    (131, 384, 128),
    (8, 160, 32),
    (300, 1024, 256),
    (5, 224, 32),
    (1, 512, 256),
    (19, 2560, 256),  # 80 groups: three 1024-column chunks, the last one partial
    (64, 14336, 256),  # a Llama-3-8B down_proj row
]


def random_weight(n_out: int, n_in: int, bits: int, L: int, block: int, code: str, seed: int = 0) -> TrellisWeight:
    """Uniformly random codes (every bit pattern is a valid tail-biting stream) and scales."""
    rng = np.random.default_rng(seed)
    packed = rng.integers(0, 2**32, size=(n_out, n_in * bits // 32), dtype=np.uint64).astype(np.uint32)
    scales = rng.uniform(0.5, 2.0, size=n_out).astype(np.float16)
    return TrellisWeight(mx.array(packed), mx.array(scales), mx.ones((n_in,), mx.int8), bits, L, block, code)


def reference(x: mx.array, w: TrellisWeight) -> np.ndarray:
    with mx.stream(mx.cpu):
        y = x.astype(mx.float32) @ dequantize_rotated_ref(w).T
        return np.array(y)


# ---- CPU: the shared body through the C++ prelude ---------------------------------------------

needs_cxx = pytest.mark.skipif(matvec.cpu_compiler() is None, reason="no C++ compiler for the CPU harness")

CPU_CASES = [
    # (shape index, batch, bits, L, code)
    (0, 1, 2, 12, "1mad"),
    (1, 3, 3, 16, "3inst"),
    (2, 8, 4, 12, "1mad"),
    (4, 5, 3, 12, "1mad"),
    (3, 2, 2, 16, "3inst"),
    (6, 4, 3, 16, "1mad"),
]


@needs_cxx
@pytest.mark.parametrize("shape_i,batch,bits,L,code", CPU_CASES)
def test_kernel_body_on_cpu_equals_reference(shape_i, batch, bits, L, code):
    n_out, n_in, block = SHAPES[shape_i]
    w = random_weight(n_out, n_in, bits, L, block, code, seed=shape_i)
    x = mx.random.normal((batch, n_in), key=mx.random.key(batch))
    got = matvec.trellis_matvec_cpu_harness(
        np.array(x), np.array(w.packed), np.array(w.scales.astype(mx.float32)), bits=bits, L=L, block=block, code=code
    )
    ref = reference(x, w)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


# The register-resident body: odd shapes, every batch it takes, both decodes (DEN=1 is CUDA's
# denormal decode, DEN=0 Metal's arithmetic), several launch layouts (chunks, partial threadgroups).
XREG_CPU_CASES = [
    # (shape index, batch, bits, L, code, config)
    (0, 1, 3, 16, "1mad", LaunchConfig("xreg", 2, 4, 1, 2, 1)),
    (0, 1, 3, 16, "1mad", LaunchConfig("xreg", 2, 4, 1, 2, 0)),
    (1, 3, 3, 16, "3inst", LaunchConfig("xreg", 1, 2, 3, 1, 1)),
    (2, 4, 4, 12, "1mad", LaunchConfig("xreg", 1, 2, 2, 2, 1)),
    (6, 2, 2, 16, "1mad", LaunchConfig("xreg", 2, 4, 2, 1, 1)),
    (4, 4, 3, 12, "1mad", LaunchConfig("xreg", 1, 8, 1, 1, 0)),
    (3, 1, 2, 16, "3inst", LaunchConfig("xreg", 2, 8, 2, 2, 1)),
    (7, 1, 3, 16, "1mad", LaunchConfig("xreg", 2, 4, 2, 1, 1)),
    (5, 4, 4, 16, "1mad", LaunchConfig("xreg", 1, 1, 1, 1, 1)),
    # the grid covers the shape exactly (no bounds checks compiled in), and rows only
    (7, 1, 3, 16, "1mad", LaunchConfig("xreg", 1, 4, 2, 1, 1)),
    (6, 2, 3, 12, "1mad", LaunchConfig("xreg", 1, 1, 1, 1, 1)),
]


@needs_cxx
@pytest.mark.parametrize("shape_i,batch,bits,L,code,config", XREG_CPU_CASES)
def test_xreg_body_on_cpu_equals_reference(shape_i, batch, bits, L, code, config):
    n_out, n_in, block = SHAPES[shape_i]
    w = random_weight(n_out, n_in, bits, L, block, code, seed=shape_i)
    x = mx.random.normal((batch, n_in), key=mx.random.key(batch))
    got = matvec.trellis_matvec_cpu_harness(
        np.array(x), np.array(w.packed), np.array(w.scales.astype(mx.float32)),
        bits=bits, L=L, block=block, code=code, config=config,
    )
    ref = reference(x, w)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_every_backend_runs_the_same_body():
    for backend, variant in [("cuda", "dp4a"), ("cuda", "portable"), ("metal", "portable")]:
        source, header = matvec.kernel_sources(backend, variant, "smem")
        assert ks.BODY in source and ks.SHARED_HELPERS in header
        source, header = matvec.kernel_sources(backend, variant, "xreg")
        assert ks.BODY_XREG in source and ks.SHARED_HELPERS in header
    assert ks.BODY in ks.cpu_harness_source(matvec.kernel_constants(8, 32, 1, 2, 12, 32, "1mad"))
    xreg = matvec.kernel_constants(8, 32, 1, 2, 12, 32, "1mad", LaunchConfig())
    assert ks.BODY_XREG in ks.cpu_xreg_harness_source(xreg)
    # the per-backend parts stay thin
    assert len(ks.CUDA_PROLOGUE) + len(ks.CUDA_EPILOGUE) < len(ks.BODY)
    assert len(ks.METAL_PROLOGUE) + len(ks.METAL_EPILOGUE) < len(ks.BODY)
    assert len(ks.CUDA_XREG_PROLOGUE) + len(ks.CUDA_XREG_EPILOGUE) < len(ks.BODY_XREG) / 4
    assert len(ks.METAL_XREG_PROLOGUE) + len(ks.METAL_XREG_EPILOGUE) < len(ks.BODY_XREG) / 4


def test_kernel_name_carries_both_dtypes():
    """MLX caches compiled kernels by name + template values: x's dtype must be part of them."""
    a = matvec._launch_args(64, 512, 1, 3, 16, 256, "1mad", mx.bfloat16, LaunchConfig(), (1,), mx.float32)
    b = matvec._launch_args(64, 512, 1, 3, 16, 256, "1mad", mx.bfloat16, LaunchConfig(), (1,), mx.bfloat16)
    c = matvec._launch_args(64, 512, 1, 3, 16, 256, "1mad", mx.bfloat16, LaunchConfig(), (1,), mx.bfloat16, mx.float32)
    assert a["template"] != b["template"] != c["template"]
    assert a["template"][-1] == b["template"][-1] == ("DT", mx.bfloat16)


def test_default_layouts():
    assert matvec.default_config(4096, 4096, 1, "cuda").body == "xreg"
    assert matvec.default_config(4096, 4096, 8, "cuda") == SMEM
    # Metal never takes the denormal decode (it flushes denormals)
    assert matvec.default_config(4096, 4096, 1, "metal").den == 0
    for n_out, n_in, batch in itertools.product((1, 37, 4096, 14336), (32, 96, 4096, 14336), range(1, 9)):
        cfg = matvec.default_config(n_out, n_in, batch, "cuda")
        consts = matvec.kernel_constants(n_out, n_in, batch, 3, 16, 32, "1mad", cfg)
        if cfg.body == "xreg":
            assert 32 * consts["WC"] * cfg.rs <= 1024 and consts["NP"] <= 32
            assert matvec.xreg_fits(cfg, n_in, batch)
    # 14 warps of 128 x registers cannot share one multiprocessor's 64K registers
    assert matvec.default_config(4096, 14336, 4, "cuda") == SMEM
    # the tuned table was swept at 3 bits: its 14-warp-column layout for 4096x14336 batch 1 fits
    # there, not at 4 bits (more words a row in registers), where the heuristic takes over
    for bits in (2, 3, 4):
        cfg = matvec.default_config(4096, 14336, 1, "cuda", bits)
        assert cfg.body == "smem" or matvec.xreg_fits(cfg, 14336, 1, bits), (bits, cfg)
    assert matvec.default_config(4096, 14336, 1, "cuda", 3).body == "xreg"
    assert matvec.default_config(4096, 14336, 1, "cuda", 4) == SMEM


def test_tuned_table_loads_and_fits():
    table = matvec.load_tuned()
    assert table, "kernels/trellis/tuned_cuda.json is missing or empty"
    for (n_out, n_in, batch), cfg in table.items():
        assert cfg.body in ("xreg", "smem")
        if cfg.body == "xreg":
            assert batch <= matvec.XREG_MAX_BATCH and matvec.xreg_fits(cfg, n_in, batch, 3)
        assert matvec.default_config(n_out, n_in, batch, "cuda", 3) == cfg  # swept at 3 bits
        metal = matvec.default_config(n_out, n_in, batch, "metal")
        assert metal.body == "smem" or metal.den == 0


# ---- GPU: the real kernels --------------------------------------------------------------------

GPU_CASES = (
    # every batch size 1..8 on one odd shape
    [(0, b, 3, 16, "1mad", mx.float32) for b in range(1, 9)]
    # every dtype on every shape
    + [(i, 1 + i % 4, 2 + i % 3, 12 if i % 2 else 16, "1mad", dt)
       for i, dt in itertools.product(range(len(SHAPES)), (mx.float16, mx.bfloat16, mx.float32))]
    # both codes, all bit widths
    + [(1, 4, k, 16, code, mx.bfloat16) for k, code in itertools.product((2, 3, 4), ("1mad", "3inst"))]
    # batch 8 over several chunks
    + [(7, 8, 3, 16, "1mad", mx.bfloat16), (6, 8, 4, 12, "3inst", mx.float16)]
)
TOL = {mx.float32: 1e-4, mx.float16: 4e-3, mx.bfloat16: 2e-2}


def _gpu_case(backend: str, shape_i, batch, bits, L, code, dtype, config=None):
    if matvec.fused_backend() != backend:
        pytest.skip(f"needs the {backend} backend (have {matvec.fused_backend()})")
    n_out, n_in, block = SHAPES[shape_i]
    w = random_weight(n_out, n_in, bits, L, block, code, seed=shape_i * 7 + batch)
    x = mx.random.normal((batch, n_in), key=mx.random.key(shape_i + batch)).astype(dtype)
    y = matvec.trellis_matvec(x, w.packed, w.scales, bits=bits, L=L, block=block, code=code, config=config)
    assert y.dtype == dtype and y.shape == (batch, n_out)
    ref = reference(x, w)
    got = np.array(y.astype(mx.float32))
    np.testing.assert_allclose(got, ref, rtol=TOL[dtype], atol=TOL[dtype] * np.abs(ref).max())


@pytest.mark.gpu
@pytest.mark.parametrize("shape_i,batch,bits,L,code,dtype", GPU_CASES)
def test_cuda_kernel_equals_reference(shape_i, batch, bits, L, code, dtype):
    _gpu_case("cuda", shape_i, batch, bits, L, code, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("shape_i,batch,bits,L,code,dtype", [c for c in GPU_CASES if c[1] <= 4][:12])
def test_cuda_smem_body_equals_reference(shape_i, batch, bits, L, code, dtype):
    """The shared-memory body (what batches of 5-8 take) at small batches too."""
    _gpu_case("cuda", shape_i, batch, bits, L, code, dtype, SMEM)


@pytest.mark.gpu
@pytest.mark.parametrize("shape_i,batch,bits,L,code,config", XREG_CPU_CASES)
def test_cuda_xreg_layouts_equal_reference(shape_i, batch, bits, L, code, config):
    _gpu_case("cuda", shape_i, batch, bits, L, code, mx.float32, config)


@pytest.mark.gpu
@pytest.mark.parametrize("shape_i,batch,bits,L,code,dtype", GPU_CASES[:12])
def test_metal_kernel_equals_reference(shape_i, batch, bits, L, code, dtype):
    _gpu_case("metal", shape_i, batch, bits, L, code, dtype)


@pytest.mark.gpu
def test_cuda_portable_variant_equals_reference():
    """The bit-trick byte sum (what Metal runs) on CUDA too, whichever variant was chosen."""
    if matvec.fused_backend() != "cuda":
        pytest.skip("needs the cuda backend")
    n_out, n_in, block = SHAPES[1]
    w = random_weight(n_out, n_in, 3, 16, block, "1mad", seed=11)
    x = mx.random.normal((3, n_in), key=mx.random.key(11))
    ref = reference(x, w)
    for cfg in (SMEM, LaunchConfig("xreg", 1, 2, 2, 1, 0)):
        y = matvec._launch("cuda", "portable", x, w.packed, w.scales, 3, 16, block, "1mad", cfg)
        np.testing.assert_allclose(np.array(y), ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


# ---- the CUDA and Metal sources parse as C++ under stub preludes (CPU CI) ----------------------

_CUDA_STUBS = r"""
#include <cstdint>
#include <cstring>
#define __device__
#define __forceinline__ inline
#define __shared__
inline void __syncthreads() {}
struct __half { unsigned short b; __half() {} __half(float) {} operator float() const { return 0.f; } };
struct __nv_bfloat16 { unsigned short b; __nv_bfloat16() {} __nv_bfloat16(float) {} operator float() const { return 0.f; } };
inline float __uint_as_float(unsigned int b) { float f; std::memcpy(&f, &b, 4); return f; }
inline __half __ushort_as_half(unsigned short b) { __half h; h.b = b; return h; }
inline float __half2float(__half h) { return (float)h; }
inline unsigned int __dp4a(unsigned int, unsigned int, unsigned int c) { return c; }
inline float __shfl_xor_sync(unsigned int, float v, int) { return v; }
struct dim3_blk { unsigned int x, y, z; };
struct float4 { float x, y, z, w; };
static dim3_blk blockDim;
struct dim3_stub { unsigned int x, y, z; };
static dim3_stub threadIdx, blockIdx;
"""

_METAL_STUBS = r"""
#include <cstring>
typedef unsigned int uint;
typedef unsigned short ushort;
struct half { ushort b; half() {} half(float) {} operator float() const { return 0.f; } };
struct bfloat16_t { ushort b; bfloat16_t() {} bfloat16_t(float) {} operator float() const { return 0.f; } };
template <class T, class U> T as_type(U u) { T t; std::memcpy(&t, &u, sizeof(T)); return t; }
inline float simd_sum(float v) { return v; }
#define threadgroup
#define device
#define thread
namespace mem_flags { enum flags { mem_threadgroup }; }
inline void threadgroup_barrier(mem_flags::flags) {}
struct uint3_stub { uint x, y, z; };
"""


def _syntax_check(tmp_path, text: str) -> None:
    import subprocess

    src = tmp_path / "k.cpp"
    src.write_text(text)
    proc = subprocess.run(
        [matvec.cpu_compiler(), "-std=c++17", "-fsyntax-only", "-Wno-unknown-pragmas", str(src)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


@needs_cxx
@pytest.mark.parametrize("body", ["smem", "xreg"])
@pytest.mark.parametrize("variant", ["dp4a", "portable"])
@pytest.mark.parametrize("dtype", ["float", "__half", "__nv_bfloat16"])
def test_cuda_source_parses(tmp_path, body, variant, dtype):
    source, header = matvec.kernel_sources("cuda", variant, body)
    cfg = SMEM if body == "smem" else LaunchConfig("xreg", 2, 4, 2, 2, 1)
    consts = "".join(f"  constexpr int {k} = {v};\n" for k, v in matvec.kernel_constants(37, 96, 3, 3, 16, 32, "1mad", cfg).items())
    text = (
        _CUDA_STUBS
        + header
        + "namespace mlx { namespace core { namespace cu {\n"
        + f"void k(const uint32_t* packed, const __half* scales, const {dtype}* x, {dtype}* y) {{\n"
        + consts
        + f"  using DT = {dtype};\n"
        + source
        + "}\n}}}\n"
    )
    _syntax_check(tmp_path, text)


@needs_cxx
@pytest.mark.parametrize("body", ["smem", "xreg"])
@pytest.mark.parametrize("dtype", ["float", "half", "bfloat16_t"])
def test_metal_source_parses(tmp_path, body, dtype):
    source, header = matvec.kernel_sources("metal", "portable", body)
    cfg = SMEM if body == "smem" else LaunchConfig("xreg", 1, 2, 2, 2, 0)
    consts = "".join(f"  constexpr int {k} = {v};\n" for k, v in matvec.kernel_constants(37, 96, 3, 3, 16, 32, "3inst", cfg).items())
    text = (
        _METAL_STUBS
        + header
        + f"void k(const uint32_t* packed, const half* scales, const {dtype}* x, {dtype}* y,\n"
        + "       uint thread_index_in_simdgroup, uint3_stub threadgroup_position_in_grid,\n"
        + "       uint3_stub thread_position_in_threadgroup, uint3_stub threads_per_threadgroup,\n"
        + "       uint simdgroup_index_in_threadgroup) {\n"
        + consts
        + f"  using DT = {dtype};\n"
        + source
        + "}\n"
    )
    _syntax_check(tmp_path, text.replace("uint32_t", "uint"))


def test_launch_geometry_covers_every_row():
    for n_out in (1, 15, 16, 17, 4096, 14336):
        args = matvec._launch_args(n_out, 512, 3, 3, 16, 256, "1mad", mx.bfloat16)
        threads = args["threadgroup"][0]
        assert threads == 32 * matvec.ROWS_PER_GROUP and args["grid"][0] % threads == 0
        rows_covered = args["grid"][0] // 32
        assert n_out <= rows_covered < n_out + matvec.ROWS_PER_GROUP
        assert args["output_shapes"] == [(3, n_out)] and args["template"][-1] == ("DT", mx.bfloat16)
        assert dict(args["template"][:-3])["N_OUT"] == n_out
        for n_in in (96, 512, 4096, 14336):
            cfg = LaunchConfig("xreg", 2, 4, 3, 2, 1)
            args = matvec._launch_args(n_out, n_in, 2, 3, 16, 32, "1mad", mx.bfloat16, cfg)
            consts = dict(args["template"][:-3])
            threads = args["threadgroup"][0]
            assert threads == 32 * consts["WC"] * cfg.rs and args["grid"][0] % threads == 0
            rows_per_group = cfg.rs * cfg.rwu * cfg.nch
            rows_covered = args["grid"][0] // threads * rows_per_group
            assert n_out <= rows_covered < n_out + rows_per_group
            assert consts["WC"] * 32 * 32 * cfg.gpl >= n_in > (consts["WC"] - 1) * 32 * 32 * cfg.gpl


# ---- the CUDA source compiles for the H200 (sm_90) with nvcc, where nvcc is installed -----------

_NVCC_PRELUDE = "#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n#include <cstdint>\n"


@pytest.mark.skipif(__import__("shutil").which("nvcc") is None, reason="no nvcc")
@pytest.mark.parametrize("n_out,n_in,batch", [(4096, 4096, 1), (4096, 14336, 1), (14336, 4096, 4), (37, 96, 3), (8, 160, 8)])
def test_cuda_source_compiles_for_sm90_without_spills(tmp_path, n_out, n_in, batch):
    """What MLX's NVRTC gets (minus its own device header), built by nvcc for sm_90: no errors,
    no register spills for the default layouts."""
    import re
    import subprocess

    cfg = matvec.default_config(n_out, n_in, batch, "cuda")
    source, header = matvec.kernel_sources("cuda", "dp4a", cfg.body)
    consts = matvec.kernel_constants(n_out, n_in, batch, 3, 16, 256 if n_in % 256 == 0 else 32, "1mad", cfg)
    text = (
        _NVCC_PRELUDE
        + header
        + "namespace mlx { namespace core { namespace cu {\n"
        + "__global__ void k(const uint32_t* packed, const __half* scales, const float* x, __nv_bfloat16* y) {\n"
        + "".join(f"  constexpr int {k} = {v};\n" for k, v in consts.items())
        + "  using DT = __nv_bfloat16;\n"
        + source
        + "}\n}}}\n"
    )
    src = tmp_path / "k.cu"
    src.write_text(text)
    proc = subprocess.run(
        ["nvcc", "-arch=sm_90", "-cubin", "-o", str(tmp_path / "k.cubin"), "-Xptxas", "-v", str(src)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    spills = [int(v) for v in re.findall(r"(\d+) bytes spill stores", proc.stderr)]
    assert spills and max(spills) == 0, proc.stderr[-2000:]


@pytest.mark.gpu
def test_cuda_kernel_reads_x_views_at_any_offset():
    """x can be a view 3 floats into a buffer (not 16-byte aligned): the vector loads step aside."""
    if matvec.fused_backend() != "cuda":
        pytest.skip("needs the cuda backend")
    n_out, n_in, block = SHAPES[1]
    w = random_weight(n_out, n_in, 3, 16, block, "1mad", seed=5)
    flat = mx.random.normal((3 + 2 * n_in,), key=mx.random.key(5))
    x = flat[3:].reshape(2, n_in)
    y = matvec.trellis_matvec(x, w.packed, w.scales, bits=3, L=16, block=block, code="1mad")
    ref = reference(x, w)
    np.testing.assert_allclose(np.array(y), ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_repeat_calls_take_the_cached_launch(monkeypatch):
    """The second call of a shape is one dict lookup and the same kernel call (no GPU needed)."""
    calls = []

    class FakeKernel:
        def __call__(self, inputs, **args):
            calls.append(args)
            return [inputs[2]]

    monkeypatch.setattr(matvec, "_kernel", lambda *a: FakeKernel())
    monkeypatch.setattr(matvec, "_CALLS", {})
    monkeypatch.setitem(matvec._chosen, "cuda", "dp4a")
    x = mx.zeros((1, 1, 512))
    packed, scales = mx.zeros((64, 48), dtype=mx.uint32), mx.zeros((64,), dtype=mx.float16)
    for _ in range(3):
        matvec.trellis_matvec(x, packed, scales, bits=3, L=16, block=256, backend="cuda", out_dtype=mx.bfloat16)
    assert len(matvec._CALLS) == 1 and len(calls) == 3 and calls[0] == calls[1] == calls[2]
    assert calls[0]["output_shapes"] == [(1, 1, 64)] and calls[0]["output_dtypes"] == [mx.bfloat16]


# ---- TrellisLinear's fused decode through mx.compile (matvec.COMPILED_BACKENDS) -----------------


def _twin(calls=None):
    """A plain-MLX stand-in with trellis_matvec's signature (the fused kernel cannot run on a CPU)."""

    def run(x_rot, packed, scales, *, bits, L, block, code, backend, out_dtype, config=None):
        if calls is not None:
            calls.append(x_rot.shape)
        w = TrellisWeight(packed, scales, mx.ones((x_rot.shape[-1],), mx.int8), bits, L, block, code)
        return matvec.matmul_rotated(x_rot, w, use_fused=False).astype(out_dtype)

    return run


def _signs(n: int, seed: int) -> mx.array:
    return mx.array(np.random.default_rng(seed).choice([-1.0, 1.0], size=n).astype(np.float32))


@pytest.mark.parametrize(
    "shape_i,lead,dtype,bias",
    [(1, (1, 1), mx.float16, False), (3, (2, 3), mx.bfloat16, True), (0, (8,), mx.float32, False), (6, (4, 1), mx.float16, True)],
)
def test_compiled_decode_equals_uncompiled_with_a_stand_in(shape_i, lead, dtype, bias):
    """The compiled function gives the uncompiled one's bits, traces once per shape, and sees new
    weights of the same shape (they are inputs, not captured constants)."""
    n_out, n_in, block = SHAPES[shape_i]
    calls: list = []
    plain = matvec.fused_decode(3, 16, block, "1mad", "cuda", bias, False, _twin())
    comp = matvec.fused_decode(3, 16, block, "1mad", "cuda", bias, True, _twin(calls))
    signs = _signs(n_in, shape_i)
    b = [mx.random.normal((n_out,), key=mx.random.key(9))] if bias else []
    for seed in (0, 1):  # a second weight of the same shape: no retrace, new values
        w = random_weight(n_out, n_in, 3, 16, block, "1mad", seed=seed)
        for i in range(3):
            x = mx.random.normal((*lead, n_in), key=mx.random.key(10 * seed + i)).astype(dtype)
            ref = plain(x, signs, w.packed, w.scales, *b)
            got = comp(x, signs, w.packed, w.scales, *b)
            assert got.dtype == dtype and got.shape == (*lead, n_out)
            np.testing.assert_array_equal(np.array(got.astype(mx.float32)), np.array(ref.astype(mx.float32)))
    assert len(calls) == 1, calls  # traced once: later calls replay the graph


@pytest.mark.parametrize("bias", [False, True])
def test_trellis_linear_compiled_path_on_cpu(monkeypatch, bias):
    """TrellisLinear's wiring: fused path (faked backend, stand-in kernel) compiled == uncompiled
    == the dense fallback's arithmetic; matvec.COMPILED_BACKENDS picks which runs."""
    import mlx.nn as nn

    from kernels import trellis as tr

    calls: list = []
    monkeypatch.setattr(matvec, "trellis_matvec", _twin(calls))
    monkeypatch.setitem(matvec._chosen, "cuda", "dp4a")
    matvec.fused_decode.cache_clear()
    lin = nn.Linear(96, 40, bias=bias)
    layer = tr.TrellisLinear.from_linear(lin, tr.TrellisSpec(bits=3, L=10))
    x = mx.random.normal((2, 1, 96)).astype(mx.bfloat16)
    dense = layer(x)  # CPU: the dequantized fallback
    monkeypatch.setattr(tr.linear, "fused_backend", lambda: "cuda")
    outs = {}
    try:
        for compiled in (False, True):
            monkeypatch.setattr(matvec, "COMPILED_BACKENDS", frozenset({"cuda"} if compiled else ()))
            calls.clear()
            outs[compiled] = [np.array(layer(x).astype(mx.float32)) for _ in range(3)]
            # uncompiled: the kernel runs each call; compiled: traced once, then replayed
            assert len(calls) == (1 if compiled else 3), (compiled, calls)
    finally:
        matvec.fused_decode.cache_clear()
    for o in outs[True] + outs[False][1:]:
        np.testing.assert_array_equal(o, outs[False][0])
    np.testing.assert_allclose(outs[False][0], np.array(dense.astype(mx.float32)), rtol=2e-2, atol=2e-2)


def test_decode_is_compiled_on_cuda_only():
    assert matvec.compile_decode("cuda") and not matvec.compile_decode("metal")
    assert not matvec.compile_decode(None)


def test_trellis_reads_no_environment_switches():
    """Compiling the decode, the tuned layouts and the CPU's dense cache are fixed choices:
    the environment variables that once switched them change nothing."""
    import subprocess
    import sys

    env = dict(os.environ, MLXD_TRELLIS_COMPILE="0", MLXD_TRELLIS_DENSE_CACHE="0",
               MLXD_TRELLIS_TUNED="/nonexistent.json")
    code = (
        "import engine, mlx.core as mx\n"
        "from kernels.trellis import matvec, TrellisLinear\n"
        "mx.set_default_device(mx.cpu)\n"
        "print(matvec.compile_decode('cuda'), bool(matvec.TUNED), TrellisLinear(64, 8, 3, 10).cache_dense)"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "True", "True"]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape_i,lead,dtype,bias",
    [
        (3, (1, 1), mx.float16, False),  # xreg, batch 1
        (7, (1, 1), mx.bfloat16, False),  # 14336 wide: smem
        (1, (4, 1), mx.float16, True),  # xreg batch 4, bias
        (3, (2, 4), mx.float32, False),  # smem, batch 8
        (6, (3,), mx.bfloat16, True),
    ],
)
def test_gpu_trellis_linear_compiled_equals_uncompiled(monkeypatch, shape_i, lead, dtype, bias):
    """On the real kernel: TrellisLinear through mx.compile gives the uncompiled path's bits."""
    if matvec.fused_backend() != "cuda":
        pytest.skip("needs the cuda backend")
    from kernels import trellis as tr

    n_out, n_in, block = SHAPES[shape_i]
    w = random_weight(n_out, n_in, 3, 16, block, "1mad", seed=shape_i)
    layer = tr.TrellisLinear(n_in, n_out, 3, 16, "1mad", block, bias=bias)
    layer.packed, layer.scales = w.packed, w.scales
    layer.signs = mx.array(np.random.default_rng(shape_i).choice([-1, 1], size=n_in).astype(np.int8))
    if bias:
        layer.bias = mx.random.normal((n_out,), key=mx.random.key(3))
    xs = [mx.random.normal((*lead, n_in), key=mx.random.key(i)).astype(dtype) for i in range(3)]
    outs = {}
    for setting in (False, True):
        monkeypatch.setattr(matvec, "COMPILED_BACKENDS", frozenset({"cuda"} if setting else ()))
        ys = [layer(x) for x in xs] + [layer(xs[0])]
        mx.eval(ys)
        outs[setting] = [np.array(y.astype(mx.float32)) for y in ys]
        assert all(y.dtype == dtype and y.shape == (*lead, n_out) for y in ys)
    for a, b in zip(outs[True], outs[False], strict=True):
        assert np.isfinite(a).all()
        np.testing.assert_array_equal(a, b)


def test_a_layout_over_the_register_file_is_refused_not_launched():
    """MLX's kernels carry no launch bounds: an xreg threadgroup whose registers exceed one
    multiprocessor's would not launch and leave y as allocated, so the CUDA path refuses it."""
    cfg = LaunchConfig("xreg", 1, 4, 2, 2, 1)  # 14 x 2 warps of ~184 registers at batch 3
    assert not matvec.xreg_fits(cfg, 14336, 3, 3)
    x = mx.zeros((3, 14336), mx.float32)
    packed = mx.zeros((8, 14336 * 3 // 32), mx.uint32)
    with pytest.raises(ValueError, match="does not fit"):
        matvec._launch("cuda", "dp4a", x, packed, mx.ones((8,), mx.float16), 3, 16, 256, "1mad", cfg)
