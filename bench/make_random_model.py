"""Write a random-weight model directory of a known shape (for benchmarks on machines without
hub access), with the bundled tinycoder tokenizer (vocabulary 8,192).

    python -m bench.make_random_model --shape llama-3.2-1b --bits 4 OUT_DIR
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import engine  # noqa: F401  (BLAS before mlx)
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxd import DEFAULT_MODEL_DIR

SHAPES = {
    # Llama-3.2-1B's dimensions (hidden 2048, 16 layers, 32/8 heads, MLP 8192), our vocabulary.
    "llama-3.2-1b": dict(
        model_type="llama", hidden_size=2048, num_hidden_layers=16, intermediate_size=8192,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=500000.0, tie_word_embeddings=True, max_position_embeddings=4096,
    ),
    "tiny": dict(
        model_type="llama", hidden_size=256, num_hidden_layers=4, intermediate_size=512,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=True, max_position_embeddings=4096,
    ),
}


def make(shape: str, out: Path, bits: int | None, group_size: int = 64, seed: int = 0) -> Path:
    from mlx_lm.models import llama

    cfg = dict(SHAPES[shape], vocab_size=8192, architectures=["LlamaForCausalLM"],
               eos_token_id=[2, 0], bos_token_id=None)
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    p.add_argument("--bits", type=int, default=4, help="affine quantization bits (0 = bf16)")
    p.add_argument("--group-size", type=int, default=64)
    a = p.parse_args(argv)
    path = make(a.shape, a.out, a.bits or None, a.group_size)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
