"""Model directories for tests that load from disk: a tiny random llama (float32 safetensors,
config.json) with the bundled model's tokenizer, and broken ones (no weights, a bad config)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from mlxd import DEFAULT_MODEL_DIR

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

TINY_LLAMA: dict[str, Any] = dict(
    model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
    vocab_size=8192, max_position_embeddings=2048, tie_word_embeddings=True,
    eos_token_id=[2, 0],
)


def _tokenizer(dst: Path) -> None:
    for name in TOKENIZER_FILES:
        shutil.copy(DEFAULT_MODEL_DIR / name, dst / name)


def tiny_model_dir(dst: Path, seed: int = 0, **overrides: Any) -> Path:
    """A tiny random llama in `dst` (weights large enough that greedy paths vary)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    cfg = dict(TINY_LLAMA, **overrides)
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(cfg))
    weights = {k: (mx.random.normal(v.shape) * 0.3 if v.ndim > 1 else v).astype(mx.float32)
               for k, v in tree_flatten(model.parameters())}
    dst.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dst / "model.safetensors"), weights, metadata={"format": "mlx"})
    (dst / "config.json").write_text(json.dumps(cfg))
    _tokenizer(dst)
    return dst


def no_weights_dir(dst: Path) -> Path:
    """A config and tokenizer but no weights."""
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(TINY_LLAMA))
    _tokenizer(dst)
    return dst


def bad_config_dir(dst: Path) -> Path:
    """A config.json that is not JSON."""
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text("{ not json")
    _tokenizer(dst)
    return dst
