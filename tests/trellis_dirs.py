"""Helpers for tests elsewhere (e.g. the HTTP end-to-end test): a trellis model dir, quickly.

``quick_quantized_dir(src, dst)`` quantizes only the Linear layers of the first ``num_blocks``
transformer blocks, at K = 4 and a short L = 8 trellis (256 states: ~16x faster to encode than
L = 12), so a tinycoder-16m dir takes seconds on a CPU. It is a real trellis model dir in every
other respect (config.json, safetensors layout, load path); use ``mlxd quantize`` for real ones.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any


def quick_quantized_dir(
    src: Path | str,
    dst: Path | str,
    *,
    bits: int = 4,
    L: int = 8,
    num_blocks: int | None = 1,
    code: str = "1mad",
) -> dict[str, Any]:
    """Write a trellis-quantized copy of ``src`` to ``dst``; returns its "quantization" entry.

    num_blocks: quantize layers.0 .. layers.{num_blocks-1} only (None: every block).
    """
    from mlx_lm.utils import load_model

    from kernels.trellis.linear import quantize_model, save_model

    model, config = load_model(Path(src))

    def only(path: str) -> bool:
        if num_blocks is None:
            return True
        m = re.search(r"layers\.(\d+)\.", path)
        return m is not None and int(m.group(1)) < num_blocks

    qconfig = quantize_model(model, bits, L, code=code, only=only)
    config["quantization"] = qconfig
    save_model(model, config, dst, src)
    return qconfig
