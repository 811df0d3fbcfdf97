"""MLX affine-quantized weights on CUDA: a fused few-row matmul kernel and the layer that uses it.

See docs/kernels.md. Public entry points:

- ``affine_qmm`` (the CUDA kernel, 1..16 rows) and ``quantized_matmul`` (kernel or MLX's twin).
- ``FewRowQuantizedLinear`` / ``install(model)``: QuantizedLinear swapped to the kernel on CUDA.
- ``fuse_siblings(model)``: q/k/v and gate/up projections in one launch.
"""

from __future__ import annotations

from .linear import (
    FewRowQuantizedEmbedding,
    FewRowQuantizedLinear,
    fuse_siblings,
    install,
    uninstall,
)
from .qmm import MAX_ROWS, LaunchConfig, affine_qmm, pick_config, quantized_matmul, takes, twin

__all__ = [
    "MAX_ROWS",
    "FewRowQuantizedEmbedding",
    "FewRowQuantizedLinear",
    "LaunchConfig",
    "affine_qmm",
    "fuse_siblings",
    "install",
    "pick_config",
    "quantized_matmul",
    "takes",
    "twin",
    "uninstall",
]
