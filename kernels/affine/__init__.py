"""MLX affine-quantized weights on CUDA: a fused few-row matmul kernel and the layer that uses it.

See docs/kernels.md. Public entry points:

- ``affine_qmm`` (the CUDA kernel, 1..16 rows), ``takes`` (whether it applies) and ``twin``
  (MLX's ``mx.quantized_matmul``, the reference).
- ``FewRowQuantizedLinear`` / ``install(model)``: QuantizedLinear swapped to the layer that sends
  each call where ``ROUTE`` says on CUDA (the kernel for 2..16 rows, MLX's otherwise).
"""

from __future__ import annotations

from .linear import (
    ROUTE,
    FewRowQuantizedEmbedding,
    FewRowQuantizedLinear,
    install,
    uninstall,
)
from .qmm import MAX_ROWS, LaunchConfig, affine_qmm, pick_config, takes, twin

__all__ = [
    "MAX_ROWS",
    "ROUTE",
    "FewRowQuantizedEmbedding",
    "FewRowQuantizedLinear",
    "LaunchConfig",
    "affine_qmm",
    "install",
    "pick_config",
    "takes",
    "twin",
    "uninstall",
]
