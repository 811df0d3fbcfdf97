"""Pure array kernels (trellis-quantized matmul: Metal, CUDA and a plain-MLX reference twin)."""

from mlxd import blas as _blas

_blas.load()
