"""The engine: one thread owns MLX; continuous batching over KV layouts.

Importing `engine` loads the optimised BLAS first (`kernels.device`), so it must happen before
anything imports `mlx`. It also keeps MLX-CUDA's compiled kernels where a restart finds them:
MLX-CUDA compiles its JIT kernels on first use (about two minutes of a first start-up on an
H200) and caches them under the temporary directory, which a reboot empties; unless
`MLX_PTX_CACHE_DIR` is set, mlxd points it at `$XDG_CACHE_HOME/mlxd/ptx/<mlx version>`
(`~/.cache/...` by default).
"""

import os as _os
from importlib import metadata as _metadata
from pathlib import Path as _Path

from kernels import device as _device

_device.load()


def _ptx_cache_dir() -> str:
    base = _os.environ.get("XDG_CACHE_HOME") or str(_Path.home() / ".cache")
    try:
        version = _metadata.version("mlx")
    except _metadata.PackageNotFoundError:
        version = "unknown"
    return str(_Path(base) / "mlxd" / "ptx" / version)


_os.environ.setdefault("MLX_PTX_CACHE_DIR", _ptx_cache_dir())
