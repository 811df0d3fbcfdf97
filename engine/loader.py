"""Find, download and load a model: a local directory or a Hugging Face repo id.

(The CLI package `mlxd` maps "no --model" to its bundled model's directory before calling here.)
`resolve_model_path` never touches the network for a local path; for a repo
id it calls `huggingface_hub.snapshot_download`, which shows a progress bar, uses the standard
cache (HF_HOME / HF_HUB_CACHE) and honours HF_HUB_OFFLINE=1 (cache only).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from engine import cuda_guard, fewrow, lora
from kernels.affine import linear as affine_linear

_ALLOW_PATTERNS = [
    "*.json",
    "*.safetensors",
    "*.py",
    "tokenizer.model",
    "*.tiktoken",
    "*.txt",
    "*.jinja",
]


def resolve_model_path(model: str, revision: str | None = None) -> tuple[Path, str]:
    """Return (local directory, model id). `model` is a directory or a repo id."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path.resolve(), path.name
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise FileNotFoundError(
            f"model {model!r} is neither a local model directory nor a Hugging Face repo id"
        )
    from huggingface_hub import snapshot_download

    local = snapshot_download(repo_id=model, revision=revision, allow_patterns=_ALLOW_PATTERNS)
    return Path(local), model


def pick_dtype(requested: str, device: mx.Device | None = None) -> mx.Dtype | None:
    """The compute dtype: `auto` is float32 on a CPU (bf16/fp16 matmuls skip BLAS there and are
    slow), else the checkpoint's own dtype (None = leave as loaded)."""
    table = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
    if requested in table:
        return table[requested]
    if requested != "auto":
        raise ValueError(f"unknown dtype {requested!r}; choose auto, float32, bfloat16 or float16")
    device = device or mx.default_device()
    return mx.float32 if device.type == mx.cpu else None


@dataclass(slots=True)
class LoadedModel:
    model: nn.Module
    tokenizer: Any  # transformers tokenizer
    config: dict[str, Any]
    path: Path
    model_id: str
    eos_token_ids: tuple[int, ...]
    context_length: int
    chat_template: str | None
    dtype: str
    vocab_size: int
    extra: dict[str, Any] = field(default_factory=dict)


def _context_length(config: dict[str, Any], tokenizer: Any) -> int:
    for key in ("max_position_embeddings", "max_sequence_length", "seq_length", "n_ctx"):
        value = config.get(key) or (config.get("text_config") or {}).get(key)
        if isinstance(value, int) and value > 0:
            return value
    value = getattr(tokenizer, "model_max_length", None)
    if isinstance(value, int) and 0 < value < 10**8:
        return value
    return 4096


@dataclass(slots=True)
class ModelFiles:
    """What a model directory says without its weights: config, tokenizer, template, limits.
    Reading it touches no MLX, so it may run on any thread (engine.pool reads it off the engine
    thread)."""

    path: Path
    model_id: str
    config: dict[str, Any]
    tokenizer: Any  # transformers tokenizer
    eos_token_ids: tuple[int, ...]
    context_length: int
    chat_template: str | None
    vocab_size: int


def read_model_files(model: str, *, chat_template: str | None = None,
                     revision: str | None = None) -> ModelFiles:
    """`model` (a directory or repo id) → its config and tokenizer (FileNotFoundError when the
    directory or its config.json is missing)."""
    from mlx_lm.utils import load_config, load_tokenizer

    path, model_id = resolve_model_path(model, revision)
    config = load_config(path)
    wrapper = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    hf_tok = wrapper._tokenizer
    template = chat_template
    if template is not None and Path(template).is_file():
        template = Path(template).read_text()
    eos = tuple(sorted(int(t) for t in wrapper.eos_token_ids))
    vocab = int(config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size") or len(hf_tok))
    return ModelFiles(path, model_id, config, hf_tok, eos, _context_length(config, hf_tok), template,
                      vocab)


def build_model(files: ModelFiles, *, dtype: str = "auto",
                adapters: Sequence[tuple[str, str]] = (),
                prepare: Callable[[nn.Module], None] | None = None) -> LoadedModel:
    """The model of `files` with its parameters not yet read: `mx.eval` them (all at once, or a
    slice at a time as engine.pool does) before the first forward. Trellis dirs are read here.
    `prepare` (sharding) runs on the lazily built model, before anything is read."""
    from mlx_lm.utils import load_model as mlx_load_model

    config = files.config
    quant = config.get("quantization") or {}
    if isinstance(quant, dict) and quant.get("method") == "trellis":
        # a weight format mlx-lm does not know: the kernels plugin builds the model
        from kernels.trellis import load_model as trellis_load

        if prepare is not None:
            raise ValueError("trellis-quantized models cannot be sharded across ranks")
        net, config = trellis_load(files.path)
    else:
        net, config = mlx_load_model(files.path, lazy=True)
        if prepare is not None:
            prepare(net)
    want = pick_dtype(dtype)
    if want is not None:
        net.set_dtype(want)
    fewrow.install(net)  # CUDA only: 3..16-row matmuls as one gathered gemv, engine/fewrow.py
    cuda_guard.install(net)  # CUDA only: RoPE modules that slice inputs MLX-CUDA cannot launch
    cuda_guard.install_attention(net)  # CUDA: 2..33-query attention on plain ops; CPU: NumPy softmax
    affine_linear.install(net, lazy=True)  # CUDA, CPU: few-row, joined and prefill-sized quantized matmuls
    served = lora.load(net, adapters)  # after the dtype and the swaps: wraps the final classes
    params = [p for _, p in cast(list[tuple[str, mx.array]], tree_flatten(net.parameters()))]
    dtypes = sorted({str(p.dtype) for p in params if mx.issubdtype(p.dtype, mx.floating)})
    return LoadedModel(
        model=net,
        tokenizer=files.tokenizer,
        config=config,
        path=files.path,
        model_id=files.model_id,
        eos_token_ids=files.eos_token_ids,
        context_length=files.context_length,
        chat_template=files.chat_template,
        dtype=",".join(d.replace("mlx.core.", "") for d in dtypes),
        vocab_size=files.vocab_size,
        extra={"loaded_at": int(time.time()), "config": json.loads(json.dumps(config, default=str)),
               "adapters": list(served.names) if served is not None else []},
    )


def load_model(
    model: str,
    *,
    dtype: str = "auto",
    chat_template: str | None = None,
    revision: str | None = None,
    adapters: Sequence[tuple[str, str]] = (),
    prepare: Callable[[nn.Module], None] | None = None,
) -> LoadedModel:
    """Load `model` (a directory or repo id) in `dtype`; `adapters` are (name, directory)
    pairs of mlx-lm LoRA adapters served on top of it (engine/lora.py; a misfit raises
    `engine.lora.AdapterError`). `prepare` is called on the model before its weights are read
    (tensor or pipeline sharding, engine/distributed.py): only what it keeps is loaded."""
    files = read_model_files(model, chat_template=chat_template, revision=revision)
    loaded = build_model(files, dtype=dtype, adapters=adapters, prepare=prepare)
    mx.eval(loaded.model.parameters())
    return loaded
