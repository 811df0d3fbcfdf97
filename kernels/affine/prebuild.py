"""Build MLX-CUDA's quantized-matmul kernels before serving, in parallel child processes.

MLX-CUDA (0.32) compiles its multi-row quantized matmul (a CUTLASS kernel, through NVRTC) on
first use, once per activation dtype, bits, group size and row tile: x with 8-16, 17-32 and 33-64
rows in all each take their own tile (fewer rows take the one-row kernel, more a kernel built
ahead of time). Each build costs 25-28 s of one CPU core on the H200 machine; a server whose
batch first grows past 16 rows stalled every decoding row for 37 s while it built. The builds
land in MLX's kernel cache on disk (`MLX_PTX_CACHE_DIR`, which mlxd points at its cache
directory), so later starts on the machine only load them.

`prebuild(model)` runs one child process per (kind, tile), all at once (they are independent,
CPU-bound compiles: the wall time is about one build's; with the kernels on disk already, the
children only load them, about a second), then calls each in this process, which loads it from
the disk cache. A child that fails costs nothing but time: the in-process call builds what is
missing itself. CUDA only: elsewhere nothing is compiled.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from kernels.common import gpu_backend

log = logging.getLogger("mlxd.kernels")

TILE_ROWS = (16, 32, 64)  # one row count in each of MLX-CUDA's JIT-built row tiles
_N, _K = 256, 512  # the probe's weight (the kernel does not depend on the shape)

Kind = tuple[str, int, int, str]  # (activation dtype name, bits, group size, mode)


def quant_kinds(model: Any) -> list[Kind]:
    """The (activation dtype, bits, group size, mode) of the model's quantized linear layers and
    quantized embeddings (a tied head multiplies by one): one kernel family each."""
    kinds: set[Kind] = set()
    for _, module in model.named_modules():
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            dtype = str(module["scales"].dtype).rsplit(".", 1)[-1]
            mode = str(getattr(module, "mode", "affine"))
            kinds.add((dtype, int(module.bits), int(module.group_size), mode))
    return sorted(kinds)


def _call(kind: Kind, rows: int) -> None:
    dtype, bits, group, mode = kind
    w = mx.zeros((_N, _K), dtype=getattr(mx, dtype))
    wq, scales, *biases = mx.quantize(w, group_size=group, bits=bits, mode=mode)
    x = mx.zeros((rows, _K), dtype=getattr(mx, dtype))
    mx.eval(mx.quantized_matmul(x, wq, scales, biases[0] if biases else None, transpose=True,
                                group_size=group, bits=bits, mode=mode))


def prebuild(model: Any, rows: tuple[int, ...] = TILE_ROWS, force: bool = False,
             timeout_s: float = 600.0) -> float:
    """Build the model's quantized-matmul kernels for `rows` (module docstring); returns the
    seconds it took. Does nothing (0.0) unless the backend is CUDA or `force`."""
    if not (force or gpu_backend() == "cuda"):
        return 0.0
    kinds = quant_kinds(model)
    if not kinds:
        return 0.0
    t0 = time.perf_counter()
    jobs = [(kind, r) for kind in kinds for r in rows]
    procs = []
    for kind, r in jobs:
        args = json.dumps([*kind, r])
        procs.append(subprocess.Popen([sys.executable, "-m", __name__, args],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    failed = 0
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=max(1.0, timeout_s - (time.perf_counter() - t0)))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            failed += 1
            continue
        if proc.returncode:
            failed += 1
            log.debug("quantized-matmul prebuild child failed: %s", err.decode(errors="replace")[-500:])
    if failed:
        log.warning("%d of %d quantized-matmul kernel builds failed in child processes; "
                    "building them here", failed, len(procs))
    for kind, r in jobs:  # loaded from the disk cache (or built here when a child failed)
        _call(kind, r)
    return time.perf_counter() - t0


if __name__ == "__main__":  # a child: one (kind, rows) call
    *_kind, _rows = json.loads(sys.argv[1])
    _call((str(_kind[0]), int(_kind[1]), int(_kind[2]), str(_kind[3])), int(_rows))
