"""MLX affine-quantized weights off Metal: few-row matmul kernels and the layer that uses them.

See docs/kernels.md. Public entry points:

- ``affine_qmm`` (the CUDA kernel, 1..16 rows), ``takes`` (whether it applies) and ``twin``
  (MLX's ``mx.quantized_matmul``, the reference); the CPU's C++ kernel is ``cpu.qmm``.
- ``FewRowQuantizedLinear`` / ``install(model)``: QuantizedLinear swapped to the layer that sends
  each call where ``linear.affine_matmul`` says: on CUDA where ``ROUTE`` says (the kernel for
  2..16 rows, MLX's otherwise), on the CPU the C++ kernel below 128 rows; a dense matmul over
  the dequantized weight from ``DEQUANTIZE_ROWS`` rows on.
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
