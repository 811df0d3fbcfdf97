"""Pieces of the fused trellis kernels: the warp reduction's source and the CPU harness's compiler.

`warp_reduce_source` writes the warp reduction of the trellis kernels' xreg body: sum NV values
(NV a power of two <= 32) over a warp in NV - 1 shuffles plus 5 - log2(NV) butterflies. Each halving step trades half of the values with the partner lane
(the lane keeps the half its lane bit selects and adds the partner's copy of it), so after
log2(NV) steps a lane holds one sum, whose index it returns in `idx` (bit b of idx = lane bit
16 >> b), and plain butterflies finish it. Each backend passes its own spelling of the function
qualifier, the unroll pragma and the shuffle, so the text serves CUDA, Metal and the g++ harness.

`gpu_backend` says which GPU backend the default device has ("cuda", "metal" or None).

`mask_5d` lays an attention mask out for grouped-query scores (the plain-op and the CPU
attention share it; MLX or NumPy arrays alike).

`swap_classes` gives a model's modules a subclass in place (the few-row matmuls, the CUDA
guards, the affine kernel's layer).

`compile_cpu_library` builds a kernel body behind a CPU prelude into a shared library (cached
per source digest under the temp dir) for the g++ harnesses that check the arithmetic on CI.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import mlx.core as mx


def warp_reduce_source(name: str, qualifier: str, unroll: str, shfl_xor: str, nv: str = "N") -> str:
    """C++ template `float name<nv>(float* v, u32 lane, u32& idx)`; `shfl_xor` is a format
    string with `{v}` for the value and `o` as the lane offset, e.g. "__shfl_xor_sync(0xffffffffu, {v}, o)"."""
    send = shfl_xor.format(v="send")
    own = shfl_xor.format(v="v[0]")
    return f"""
template <int {nv}>
{qualifier} float {name}(float* v, u32 lane, u32& idx) {{
    int n = {nv};
    int bit = 0;
    idx = 0u;
    {unroll}
    for (int o = 16; o > 0; o >>= 1) {{
        if (n > 1) {{
            const bool up = (lane & (u32)o) != 0u;
            {unroll}
            for (int j = 0; j < {nv} / 2; ++j) {{
                if (j < n / 2) {{
                    const float send = up ? v[2 * j] : v[2 * j + 1];
                    const float keep = up ? v[2 * j + 1] : v[2 * j];
                    v[j] = keep + {send};
                }}
            }}
            idx |= (up ? 1u : 0u) << bit;
            ++bit;
            n >>= 1;
        }} else {{
            v[0] += {own};
        }}
    }}
    return v[0];
}}
"""


def cpu_half_to_float_source(name: str, as_float: str) -> str:
    """C++ `float name(u32 h)`: IEEE binary16 bits to binary32 (zero, subnormal, normal, inf/nan)
    for the CPU harness preludes; `as_float` is the prelude's u32-bits-to-float function."""
    return f"""static inline float {name}(u32 h) {{
    const u32 sign = (h & 0x8000u) << 16;
    const u32 e = (h >> 10) & 0x1Fu;
    const u32 m = h & 0x3FFu;
    if (e == 0) {{
        const float v = (float)m * (1.0f / 16777216.0f);
        return sign ? -v : v;
    }}
    if (e == 31) return {as_float}(sign | 0x7F800000u | (m << 13));
    return {as_float}(sign | ((e + 112u) << 23) | (m << 13));
}}
"""


_GPU_BACKEND: list[str | None] = []


def gpu_backend() -> str | None:
    """'cuda' or 'metal' when the default device is a GPU with that backend, else None."""
    if mx.default_device() != mx.gpu:
        return None
    if not _GPU_BACKEND:  # which GPU backend this process has does not change: ask once
        if hasattr(mx, "cuda") and mx.cuda.is_available():
            _GPU_BACKEND.append("cuda")
        elif mx.metal.is_available():
            _GPU_BACKEND.append("metal")
        else:
            _GPU_BACKEND.append(None)
    return _GPU_BACKEND[0]


def cpu_compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")


def compile_cpu_library(source: str, tag: str, flags: tuple[str, ...] = ("-O2",)) -> ctypes.CDLL:
    """g++ `source` into lib<tag>_<digest>.so under the temp dir (once per source) and load it."""
    cxx = cpu_compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler for the CPU harness")
    digest = hashlib.sha1((source + " ".join(flags)).encode()).hexdigest()[:16]
    root = Path(tempfile.gettempdir()) / f"mlxd-{tag}-harness"
    root.mkdir(exist_ok=True)
    lib = root / f"{tag}_{digest}.so"
    if not lib.exists():
        cpp = root / f"{tag}_{digest}.{os.getpid()}.cpp"
        cpp.write_text(source)
        tmp = root / f"{tag}_{digest}.{os.getpid()}.so"
        subprocess.run([cxx, *flags, "-std=c++17", "-shared", "-fPIC", str(cpp), "-o", str(tmp)], check=True)
        tmp.replace(lib)  # atomic: a parallel test process never loads a half-written library
    return ctypes.CDLL(str(lib))


def mask_5d(mask: Any, heads: int, kv_heads: int) -> Any:
    """A mask of `[L, K]` or `[B|1, 1|H, L, K]` (an MLX or NumPy array) as one broadcastable to
    grouped-query scores `[B, kv_heads, heads / kv_heads, L, K]`."""
    if mask.ndim == 2:
        return mask[None, None, None]
    if mask.shape[1] == heads and heads != 1:
        return mask.reshape(mask.shape[0], kv_heads, heads // kv_heads, *mask.shape[2:])
    return mask[:, :, None]


def swap_classes(model: Any, mapping: dict[type, type]) -> int:
    """Give every module of `model` whose exact type is a key of `mapping` the class it maps
    to (subclasses of a key are left alone); returns how many were swapped. A subclass that
    changes only how a module computes (the few-row matmuls, the CUDA guards, the affine
    kernel's layer) is installed this way, so parameters, names and saving stay as they were."""
    count = 0
    for _, module in model.named_modules():
        new = mapping.get(type(module))
        if new is not None:
            module.__class__ = new
            count += 1
    return count
