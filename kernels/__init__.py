"""Pure array kernels (trellis-quantized matmul: Metal, CUDA and a plain-MLX reference twin).

Importing `kernels` loads the optimised CPU BLAS first (`kernels.device`), before `mlx`.
"""

from kernels import device as _device

_device.load()
