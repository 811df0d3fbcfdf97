"""Model preparation for the benchmarks, and the `random-model` subcommand.

    python -m bench random-model OUT_DIR [--shape llama-3.2-1b] [--bits 4] [--context 32768]

`random_model` writes a random-weight model directory of a known shape (for speed benchmarks
on machines without hub access), with the bundled tinycoder tokenizer (vocabulary 8,192).

`float32_copy`: mlxd computes in float32 on a CPU (bfloat16 matmuls do not go through BLAS there). mlx_lm.server
computes in the checkpoint's dtype (bfloat16 for tinycoder-16m), so preloading OpenBLAS alone
changes nothing for it. `float32_copy` writes a float32 copy of the checkpoint (cached by source
path and mtime) so that the BLAS-preloaded peer runs the same arithmetic as mlxd.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

CACHE = Path.home() / ".cache" / "mlxd-bench"

SHAPES = {
    # Llama-3.2-1B's dimensions (hidden 2048, 16 layers, 32/8 heads, MLP 8192), our vocabulary.
    "llama-3.2-1b": dict(
        model_type="llama", hidden_size=2048, num_hidden_layers=16, intermediate_size=8192,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=500000.0, tie_word_embeddings=True, max_position_embeddings=4096,
    ),
    # Llama-3-8B's dimensions (hidden 4096, 32 layers, 32/8 heads, MLP 14336), our vocabulary.
    "llama-3-8b": dict(
        model_type="llama", hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
        rope_theta=500000.0, tie_word_embeddings=False, max_position_embeddings=8192,
    ),
    "tiny": dict(
        model_type="llama", hidden_size=256, num_hidden_layers=4, intermediate_size=512,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=True, max_position_embeddings=4096,
    ),
}


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


def random_model(shape: str, out: Path, bits: int | None, group_size: int = 64,
                 seed: int = 0, context: int | None = None) -> Path:
    """A random-weight model of a known shape in `out` (bf16, or affine-quantized to `bits`),
    with the bundled tokenizer."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    import engine  # noqa: F401  (BLAS before mlx)
    from mlxd import DEFAULT_MODEL_DIR

    cfg = dict(SHAPES[shape], vocab_size=8192, architectures=["LlamaForCausalLM"],
               eos_token_id=[2, 0], bos_token_id=None)
    if context:
        cfg["max_position_embeddings"] = context
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(cfg))
    model.set_dtype(mx.bfloat16)
    if bits:
        nn.quantize(model, group_size=group_size, bits=bits)
        cfg["quantization"] = {"group_size": group_size, "bits": bits}
    out.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(DEFAULT_MODEL_DIR / name, out / name)
    return out


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("random-model", help="write a random-weight model of a known shape",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    p.add_argument("--bits", type=int, default=4, help="affine quantization bits (0 = bf16)")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--context", type=int, default=None,
                   help="max_position_embeddings (default: the shape's, 4096)")
    p.set_defaults(func=cmd_random_model)


def cmd_random_model(args: argparse.Namespace) -> int:
    path = random_model(args.shape, args.out, args.bits or None, args.group_size, args.seed,
                        args.context)
    print(f"wrote {path}")
    return 0
