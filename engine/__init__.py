"""The engine: one thread owns MLX; continuous batching over KV layouts.

Importing `engine` loads the optimised BLAS first (`kernels.device`), so it must happen before
anything imports `mlx`.
"""

import os as _os

from kernels import device as _device

_device.load()
# MLX-CUDA's cuDNN attention aborted speculative runs on the H200 (std::terminate in
# `cudaStreamEndCapture`): off unless the user set it; MLX reads it at its first attention call.
_os.environ.setdefault("MLX_CUDA_USE_CUDNN_SDPA", "0")
