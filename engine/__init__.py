"""The engine: one thread owns MLX; continuous batching over KV layouts.

Importing `engine` loads the optimised BLAS first (`kernels.device`), so it must happen before
anything imports `mlx`.

It also turns MLX-CUDA's cuDNN attention off (`MLX_CUDA_USE_CUDNN_SDPA=0`, unless set): with it
on, `bench.spec` died inside MLX on the H200 with `cudaStreamEndCapture ... failed due to a
previous error during capture` (a `std::terminate`: it kills the server) twice in session 5 and in
all three runs of session 6; with it off, both session-6 runs completed, and forced n-gram rounds
went from 0.61x to 1.3-1.4x plain at dev c=4 (docs/speculative.md, "Session 6"). Attention over
several queries then runs MLX's plain-op attention. MLX reads the variable once, at the first
CUDA attention call, so setting it here (before any forward) is early enough.
"""

import os as _os

from kernels import device as _device

_device.load()
_os.environ.setdefault("MLX_CUDA_USE_CUDNN_SDPA", "0")
