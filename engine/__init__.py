"""The engine: one thread owns MLX; continuous batching over KV layouts.

Importing `engine` loads the optimised BLAS first (`kernels.device`), so it must happen before
anything imports `mlx`.
"""

from kernels import device as _device

_device.load()
