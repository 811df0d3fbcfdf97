"""Run a module with a shared library loaded RTLD_GLOBAL first.

    python -m bench.preload /usr/lib/x86_64-linux-gnu/libopenblas.so.0 mlx_lm server --model M

MLX's Linux CPU wheel calls `cblas_sgemm` through the dynamic linker; loading an optimised CBLAS
into the global scope before `mlx.core` is imported makes those calls resolve to it. This is how
the benchmark gives mlx_lm.server the same BLAS that mlxd loads, so that engine meets engine.
"""

from __future__ import annotations

import ctypes
import runpy
import sys


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise SystemExit("usage: python -m bench.preload LIBRARY MODULE [ARGS...]")
    lib, module, *rest = argv
    assert "mlx.core" not in sys.modules, "mlx was imported before the BLAS preload"
    ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
    sys.argv = [module, *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
