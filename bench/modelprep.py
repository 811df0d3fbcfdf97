"""Model copies a peer needs to be compared engine with engine.

mlxd computes in float32 on a CPU (bfloat16 matmuls do not go through BLAS there). mlx_lm.server
computes in the checkpoint's dtype (bfloat16 for tinycoder-16m), so preloading OpenBLAS alone
changes nothing for it. `float32_copy` writes a float32 copy of the checkpoint (cached by source
path and mtime) so that the BLAS-preloaded peer runs the same arithmetic as mlxd.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

CACHE = Path.home() / ".cache" / "mlxd-bench"


def float32_copy(model_dir: str | Path, cache: Path = CACHE) -> Path:
    src = Path(model_dir).resolve()
    stamp = "|".join(f"{p.name}:{p.stat().st_mtime_ns}" for p in sorted(src.iterdir()))
    key = hashlib.sha1(f"{src}|{stamp}".encode()).hexdigest()[:12]
    dst = cache / f"{src.name}-float32-{key}"
    if (dst / ".complete").exists():
        return dst
    import mlx.core as mx

    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for p in sorted(src.iterdir()):
        if p.suffix == ".safetensors":
            weights = mx.load(str(p))
            assert isinstance(weights, dict)
            cast = {k: (v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v)
                    for k, v in weights.items()}
            mx.save_safetensors(str(tmp / p.name), cast, metadata={"format": "mlx"})
        elif p.name == "config.json":
            cfg = json.loads(p.read_text())
            cfg["torch_dtype"] = "float32"
            (tmp / p.name).write_text(json.dumps(cfg, indent=2))
        elif p.is_file():
            shutil.copy2(p, tmp / p.name)
    (tmp / ".complete").write_text("ok\n")
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)
    return dst
