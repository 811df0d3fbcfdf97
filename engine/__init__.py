"""The engine: one thread owns MLX; continuous batching over KV layouts.

Importing `engine` loads the optimised BLAS first (see `mlxd.blas`), so it must happen before
anything imports `mlx`.
"""

from mlxd import blas as _blas

_blas.load()
