"""y = x~ W~^T for a trellis-quantized matrix: fused GPU kernels and the plain-MLX fallback.

``fused_backend()`` says which fused kernel can run here ("cuda", "metal" or None);
``trellis_matvec`` runs it for up to ``MAX_FUSED_BATCH`` rows of x~ (already rotated), and
``matmul_rotated`` picks the fused kernel or the dequantize-then-matmul fallback.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import mlx.core as mx
import numpy as np

from . import kernel_source as ks
from .codes import CODES
from .quantizer import TrellisWeight, dequantize_rotated

MAX_FUSED_BATCH = 8
ROWS_PER_GROUP = 16  # SIMD groups (output rows) per threadgroup: 512 threads share a staged x
METAL_MAX_BATCH = 7  # 8 staged rows of x (33.8 KB) exceed Metal's 32 KB of threadgroup memory


def fused_backend() -> str | None:
    """'cuda' or 'metal' when the default device is a GPU with that backend, else None."""
    if mx.default_device() != mx.gpu:
        return None
    if hasattr(mx, "cuda") and mx.cuda.is_available():
        return "cuda"
    if mx.metal.is_available():
        return "metal"
    return None


VARIANTS = {"cuda": ("dp4a", "portable"), "metal": ("portable",)}
_chosen: dict[str, str] = {}


def kernel_sources(backend: str, variant: str) -> tuple[str, str]:
    """(source, header) of the fused kernel for a backend; the body is the same for all."""
    if backend == "cuda":
        return ks.CUDA_PROLOGUE + ks.BODY + ks.CUDA_EPILOGUE, ks.cuda_header(portable=variant == "portable")
    if backend == "metal":
        return ks.METAL_PROLOGUE + ks.BODY + ks.METAL_EPILOGUE, ks.METAL_HEADER
    raise ValueError(f"no fused trellis kernel for backend {backend!r}")


@lru_cache(maxsize=8)
def _kernel(backend: str, variant: str):
    source, header = kernel_sources(backend, variant)
    # The name carries a hash of the text: MLX caches compiled kernels by name (on disk for CUDA).
    name = "trellis_matvec_" + hashlib.sha1((source + header).encode()).hexdigest()[:12]
    make = mx.fast.cuda_kernel if backend == "cuda" else mx.fast.metal_kernel
    return make(name=name, input_names=["packed", "scales", "x"], output_names=["y"], source=source, header=header)


def kernel_variant(backend: str) -> str:
    """The first variant that compiles and runs here (probed once on a tiny problem)."""
    if backend in _chosen:
        return _chosen[backend]
    errors = []
    for variant in VARIANTS[backend]:
        try:
            x = mx.ones((1, 32), dtype=mx.float32)
            packed = mx.zeros((8, 4), dtype=mx.uint32)
            y = _launch(backend, variant, x, packed, mx.ones((8,), dtype=mx.float16), 4, 12, 32, "1mad")
            mx.eval(y)
            _chosen[backend] = variant
            return variant
        except Exception as exc:  # compile errors surface at eval time
            errors.append(f"{variant}: {exc}")
    raise RuntimeError("no fused trellis kernel variant works here: " + " | ".join(errors))


def kernel_constants(n_out: int, n_in: int, batch: int, bits: int, L: int, block: int, code: str) -> dict[str, int]:
    return {
        "K": bits,
        "L": L,
        "TB": block,
        "N_IN": n_in,
        "N_OUT": n_out,
        "BATCH": batch,
        "CODE": CODES.index(code),
        "ROWS": ROWS_PER_GROUP,
    }


def trellis_matvec(
    x_rot: mx.array,
    packed: mx.array,
    scales: mx.array,
    *,
    bits: int,
    L: int,
    block: int,
    code: str = "1mad",
    backend: str | None = None,
) -> mx.array:
    """Fused y (M, n_out) = x_rot (M, n_in) @ W~^T for M <= 8; output in x_rot's dtype."""
    backend = backend or fused_backend()
    if backend is None:
        raise RuntimeError("no GPU backend for the fused trellis kernel")
    m = x_rot.shape[0]
    if not 1 <= m <= MAX_FUSED_BATCH:
        raise ValueError(f"fused kernel takes 1..{MAX_FUSED_BATCH} rows, got {m}")
    if backend == "metal" and m > METAL_MAX_BATCH:
        half = m // 2
        parts = [x_rot[:half], x_rot[half:]]
        variant = kernel_variant(backend)
        return mx.concatenate([_launch(backend, variant, p, packed, scales, bits, L, block, code) for p in parts], axis=0)
    return _launch(backend, kernel_variant(backend), x_rot, packed, scales, bits, L, block, code)


@lru_cache(maxsize=1024)
def _launch_args(n_out: int, n_in: int, m: int, bits: int, L: int, block: int, code: str, dtype: mx.Dtype) -> dict:
    """Keyword arguments of one kernel call, built once per shape (dispatch is latency-bound)."""
    consts = kernel_constants(n_out, n_in, m, bits, L, block, code)
    groups = -(-n_out // ROWS_PER_GROUP)
    return {
        "template": [*consts.items(), ("DT", dtype)],
        "grid": (groups * 32 * ROWS_PER_GROUP, 1, 1),
        "threadgroup": (32 * ROWS_PER_GROUP, 1, 1),
        "output_shapes": [(m, n_out)],
        "output_dtypes": [dtype],
    }


def _launch(backend, variant, x_rot, packed, scales, bits, L, block, code) -> mx.array:
    m, n_in = x_rot.shape
    args = _launch_args(int(packed.shape[0]), n_in, m, bits, L, block, code, x_rot.dtype)
    (y,) = _kernel(backend, variant)(inputs=[packed, scales, x_rot], **args)
    return y


def matmul_rotated(x_rot: mx.array, w: TrellisWeight, use_fused: bool | None = None) -> mx.array:
    """x_rot (..., n_in) float -> (..., n_out) float32, fused for small batches on a GPU."""
    lead = x_rot.shape[:-1]
    x2 = x_rot.reshape(-1, x_rot.shape[-1])
    backend = fused_backend()
    if use_fused is None:
        use_fused = backend is not None and x2.shape[0] <= MAX_FUSED_BATCH
    if use_fused:
        y = trellis_matvec(x2, w.packed, w.scales, bits=w.bits, L=w.L, block=w.block, code=w.code)
        y = y.astype(mx.float32)
    else:
        y = x2.astype(mx.float32) @ dequantize_rotated(w).T
    return y.reshape(*lead, -1)


# ---- the shared body on the CPU, compiled with a C++ compiler (for CI without a GPU) ------------


def cpu_compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")


@lru_cache(maxsize=32)
def _cpu_library(source: str) -> ctypes.CDLL:
    cxx = cpu_compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler for the CPU harness")
    digest = hashlib.sha1(source.encode()).hexdigest()[:16]
    root = Path(tempfile.gettempdir()) / "mlxd-trellis-harness"
    root.mkdir(exist_ok=True)
    lib = root / f"trellis_{digest}.so"
    if not lib.exists():
        src = root / f"trellis_{digest}.cpp"
        src.write_text(source)
        tmp = root / f"trellis_{digest}.{os.getpid()}.so"
        subprocess.run([cxx, "-O2", "-std=c++17", "-shared", "-fPIC", str(src), "-o", str(tmp)], check=True)
        tmp.replace(lib)
    return ctypes.CDLL(str(lib))


def trellis_matvec_cpu_harness(
    x_rot: np.ndarray, packed: np.ndarray, scales: np.ndarray, *, bits: int, L: int, block: int, code: str = "1mad"
) -> np.ndarray:
    """The fused kernel's shared body run on the CPU, one lane at a time; returns y (M, n_out)."""
    m, n_in = x_rot.shape
    n_out = packed.shape[0]
    consts = kernel_constants(n_out, n_in, m, bits, L, block, code)
    lib = _cpu_library(ks.cpu_harness_source(consts))
    packed_c = np.ascontiguousarray(packed, dtype=np.uint32)
    scales_c = np.ascontiguousarray(scales, dtype=np.float32)
    x_c = np.ascontiguousarray(x_rot, dtype=np.float32)
    partial = np.zeros((n_out, 32, m), dtype=np.float32)
    ptr = ctypes.c_void_p
    lib.trellis_lane_partials(
        ptr(packed_c.ctypes.data), ptr(scales_c.ctypes.data), ptr(x_c.ctypes.data), ptr(partial.ctypes.data)
    )
    return partial.sum(axis=1).T
