"""Device setup that runs before anything imports `mlx`: the optimised CPU BLAS.

The lowest module of mlxd: `kernels`, `engine` and the CLI (`mlxd`) all load the BLAS through it
when they are imported, so whichever comes first binds MLX to it.

MLX's Linux CPU wheel links a bundled reference (netlib) BLAS: a float32 128x768 @ 768x2560 matmul
runs at ~2-4 GFLOP/s on a 2-core x86 machine. Loading an optimised CBLAS (OpenBLAS) into the global
symbol scope *before* `mlx.core` is first imported makes MLX's `cblas_sgemm` calls resolve to it
(~100 GFLOP/s on the same machine). This module must therefore be imported before `mlx`.

Override with ``MLXD_BLAS``: a path to a shared library, or ``none`` to keep MLX's own BLAS.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import sys
import warnings
from dataclasses import dataclass

_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
    "/usr/local/lib/libopenblas.so.0",
)


@dataclass(slots=True)
class BlasInfo:
    """What `load()` did: `path` of the library loaded, or why none was (`reason`)."""

    path: str | None
    reason: str
    loaded_before_mlx: bool


_INFO: BlasInfo | None = None


def _find() -> str | None:
    for cand in _CANDIDATES:
        if os.path.exists(cand):
            return cand
    name = ctypes.util.find_library("openblas")
    return name


def load() -> BlasInfo:
    """Load the optimised BLAS once (idempotent). Safe to call on any platform."""
    global _INFO
    if _INFO is not None:
        return _INFO
    before = "mlx.core" not in sys.modules
    choice = os.environ.get("MLXD_BLAS", "auto").strip()
    if platform.system() != "Linux":
        _INFO = BlasInfo(None, "not Linux: MLX uses Accelerate/Metal", before)
    elif choice.lower() in ("none", "off", "0", "reference"):
        _INFO = BlasInfo(None, "disabled by MLXD_BLAS", before)
    else:
        path = _find() if choice.lower() in ("", "auto") else choice
        if path is None:
            _INFO = BlasInfo(None, "no optimised BLAS found (install libopenblas0-pthread)", before)
        else:
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                reason = "loaded" if before else "loaded after mlx was imported: no effect"
                _INFO = BlasInfo(path, reason, before)
                if not before:  # a script that imported mlx first: silently ~30x slower matmuls
                    warnings.warn(
                        "mlx was imported before mlxd (engine, kernels or mlxd): MLX keeps its "
                        "reference BLAS and float32 matmuls run ~30x slower; import mlxd's "
                        "modules first", RuntimeWarning, stacklevel=2)
            except OSError as exc:
                _INFO = BlasInfo(None, f"failed to load {path}: {exc}", before)
    return _INFO


def info() -> BlasInfo:
    return load()
