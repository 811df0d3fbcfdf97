"""y = x @ w.T for a few rows of x: the fused CUDA kernel, its launch layout and its CPU harness.

``skinny_matmul(x, w)`` runs the kernel (kernels/skinny/source.py) for x[..., K] with 1..16 rows
in all and w[N, K] of the same dtype (float32, float16, bfloat16), K a multiple of 8; output
x's dtype. ``supported(x, w)`` says whether it takes a call; callers fall back to ``x @ w.T``
otherwise. ``skinny_matmul_cpu_harness`` runs the same body on the CPU (g++), for CI.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx
import numpy as np

from kernels.common import compile_cpu_library, cpu_compiler  # noqa: F401 (cpu_compiler: tests)

from . import source as src

MAX_ROWS = 16  # rows of x the kernel takes (R * M <= 32 sums a warp)
WARPS_PER_BLOCK = 4
# ~16 warps a multiprocessor on an H200 (132 SMs): enough loads in flight
TARGET_WARPS = int(os.environ.get("MLXD_SKINNY_TARGET_WARPS", "2048"))
DTYPES = (mx.bfloat16, mx.float16, mx.float32)


@dataclass(frozen=True)
class Layout:
    """R rows of w a warp, U 16-byte vectors of each row in flight a lane, NP = pow2(R * M)."""

    m: int
    r: int
    u: int
    np: int


def _pow2(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


def layout(m: int, n: int, k: int, itemsize: int) -> Layout:
    """Rows a warp: 4 while that still leaves TARGET_WARPS warps (fewer x reads per w byte; the
    x traffic through L1 is M / R times the w traffic), else 2, else 1; R * M <= 32. U: 8 / R
    vectors a row in flight (8 loads a lane), fewer when the row is shorter than that."""
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"the skinny kernel takes 1..{MAX_ROWS} rows, got {m}")
    r = 1
    for cand in (4, 2):
        if cand * m <= 32 and -(-n // cand) >= TARGET_WARPS:
            r = cand
            break
    vectors = max(1, k * itemsize // 16)
    u = max(1, min(8 // r, -(-vectors // 32)))
    return Layout(m, r, u, _pow2(r * m))


def supported(x: mx.array, w: mx.array) -> bool:
    """Whether skinny_matmul takes this call (else use x @ w.T)."""
    if w.ndim != 2 or x.ndim < 1 or x.dtype != w.dtype or x.dtype not in DTYPES:
        return False
    k = w.shape[1]
    if x.shape[-1] != k or k % 8 or k == 0 or w.shape[0] == 0:
        return False
    return 1 <= x.size // k <= MAX_ROWS


def kernel_source() -> tuple[str, str]:
    """(source, header) of the CUDA kernel."""
    return src.CUDA_PROLOGUE + src.BODY, src.CUDA_HEADER


@lru_cache(maxsize=1)
def _kernel():
    source, header = kernel_source()
    # The name carries a hash of the text: MLX caches compiled kernels by name (in memory).
    name = "skinny_gemm_" + hashlib.sha1((source + header).encode()).hexdigest()[:12]
    return mx.fast.cuda_kernel(name=name, input_names=["w", "x", "dims"], output_names=["y"],
                               source=source, header=header)


@lru_cache(maxsize=256)
def _dims(n: int, k: int) -> mx.array:
    d = mx.array([n, k], dtype=mx.int32)
    mx.eval(d)
    return d


@lru_cache(maxsize=1024)
def launch_args(m: int, n: int, k: int, dtype: mx.Dtype, lead: tuple[int, ...], lay: Layout | None = None) -> dict:
    """Keyword arguments of one kernel call, built once per shape (dispatch is latency-bound).
    lay: another layout than ``layout``'s (for sweeps; R * M <= 32, NP = pow2(R * M))."""
    lay = lay or layout(m, n, k, dtype.size)
    if lay.m != m or lay.r * m > 32 or lay.np != _pow2(lay.r * m) or lay.u < 1:
        raise ValueError(f"bad layout {lay} for {m} rows")
    warps = -(-n // lay.r)
    blocks = -(-warps // WARPS_PER_BLOCK)
    threads = 32 * WARPS_PER_BLOCK
    return {
        "template": [("M", m), ("R", lay.r), ("U", lay.u), ("NP", lay.np), ("DT", dtype)],
        "grid": (blocks * threads, 1, 1),
        "threadgroup": (threads, 1, 1),
        "output_shapes": [(*lead, n)],
        "output_dtypes": [dtype],
    }


def prepare(x: mx.array, w: mx.array) -> tuple:
    """What a call of this shape needs (launch arguments, the dims array), built once per shape."""
    n, k = w.shape
    return launch_args(x.size // k, n, k, x.dtype, tuple(x.shape[:-1])), _dims(n, k)


def launch(x: mx.array, w: mx.array, prepared: tuple) -> mx.array:
    args, dims = prepared
    return _kernel()(inputs=[w, x, dims], **args)[0]


_CALLS: dict[tuple, tuple] = {}


def skinny_matmul(x: mx.array, w: mx.array, lay: Layout | None = None) -> mx.array:
    """x[..., K] @ w[N, K].T in one kernel launch (see ``supported`` for what it takes).
    lay: force a launch layout (bench sweeps); default ``layout(...)``."""
    key = (x.shape, x.dtype, w.shape, lay)
    hit = _CALLS.get(key)
    if hit is None:
        if not supported(x, w):
            raise ValueError(f"skinny kernel does not take x {x.shape} {x.dtype} @ w {w.shape} {w.dtype}")
        n, k = w.shape
        hit = (launch_args(x.size // k, n, k, x.dtype, tuple(x.shape[:-1]), lay), _dims(n, k))
        if len(_CALLS) < 4096:
            _CALLS[key] = hit
    return launch(x, w, hit)


# ---- the shared body on the CPU, compiled with a C++ compiler (for CI without a GPU) ------------


@lru_cache(maxsize=64)
def _cpu_library(source: str) -> ctypes.CDLL:
    return compile_cpu_library(source, "skinny", flags=("-O1", "-pthread"))


_NP_DTYPES = {"float32": np.float32, "bfloat16": np.uint16, "float16": np.uint16}


def skinny_matmul_cpu_harness(x: np.ndarray, w: np.ndarray, dtype: str, *, r: int | None = None,
                              u: int | None = None, offset: int = 0) -> np.ndarray:
    """The kernel's body on the CPU, one thread per lane. x (M, K) and w (N, K): float32 arrays,
    or for bfloat16/float16 the raw 16-bit patterns (uint16). Returns y (M, N) float32 (the
    sums before rounding to the output dtype). r / u override the layout; offset (elements)
    places x and w that far into their buffers, so the unaligned load path runs."""
    m, k = x.shape
    n = w.shape[0]
    itemsize = 4 if dtype == "float32" else 2
    lay = layout(m, n, k, itemsize)
    r = r or lay.r
    u = u or lay.u
    consts = {"M": m, "R": r, "U": u, "NP": _pow2(r * m)}
    lib = _cpu_library(src.cpu_harness_source(consts, dtype))
    npt = _NP_DTYPES[dtype]

    def placed(a: np.ndarray) -> np.ndarray:
        buf = np.zeros(a.size + offset + 8, dtype=npt)
        start = offset + (-(buf.ctypes.data // itemsize) % (16 // itemsize))  # 16-byte aligned + offset
        view = buf[start : start + a.size]
        view[:] = a.reshape(-1).astype(npt, copy=False)
        return view

    w_c, x_c = placed(w), placed(x)
    dims = np.array([n, k], dtype=np.int32)
    y = np.full((m, n), np.nan, dtype=np.float32)
    warps = -(-n // r)
    ptr = ctypes.c_void_p
    lib.skinny_run(ptr(w_c.ctypes.data), ptr(x_c.ctypes.data), ptr(dims.ctypes.data), ptr(y.ctypes.data),
                   ctypes.c_uint32(warps))
    return y
