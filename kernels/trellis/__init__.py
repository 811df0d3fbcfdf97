"""Trellis-coded weight quantization (QTIP-style), fused mat-vec kernels and a plain-MLX twin.

See docs/trellis.md. Public entry points:

- ``quantize_model(model, bits, L, ...)``: swap a model's Linear layers for ``TrellisLinear``.
- ``save_model(model, config, dst, src)`` / ``load_model(dir)``: a quantized model directory.
- ``load_hook(model, config, weights_dir) -> model``: for a loader that builds the model itself.
- ``trellis_matvec`` (fused GPU kernel) and ``matmul_ref`` / ``dequantize_rotated_ref`` (reference).
"""

from __future__ import annotations

from .bitshift import block_size_for, pack_symbols, states_from_symbols, unpack_symbols
from .codes import CODES, codebook, decode_states
from .linear import (
    TrellisLinear,
    apply_trellis,
    bits_per_weight,
    is_trellis_config,
    load_hook,
    load_model,
    quantizable_size,
    quantize_model,
    save_model,
    spec_from_config,
    trellis_layers,
)
from .matvec import fused_backend, matmul_rotated, trellis_matvec
from .quantizer import (
    TrellisSpec,
    TrellisWeight,
    dequantize,
    dequantize_rotated,
    dequantize_rotated_ref,
    matmul_ref,
    quantize_weight,
    rotate,
)
from .viterbi import encode_tail_biting, exact_tail_biting

__all__ = [
    "CODES",
    "TrellisLinear",
    "TrellisSpec",
    "TrellisWeight",
    "apply_trellis",
    "bits_per_weight",
    "block_size_for",
    "codebook",
    "decode_states",
    "dequantize",
    "dequantize_rotated",
    "dequantize_rotated_ref",
    "encode_tail_biting",
    "exact_tail_biting",
    "fused_backend",
    "is_trellis_config",
    "load_hook",
    "load_model",
    "matmul_ref",
    "matmul_rotated",
    "pack_symbols",
    "quantizable_size",
    "quantize_model",
    "quantize_weight",
    "rotate",
    "save_model",
    "spec_from_config",
    "states_from_symbols",
    "trellis_layers",
    "trellis_matvec",
    "unpack_symbols",
]
