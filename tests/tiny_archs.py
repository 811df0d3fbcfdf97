"""Tiny random-config models of every registered architecture (float32, for tests).

    model = tiny_model("gemma3_text", seed=0)

Small enough to run a few dozen forwards per second on a laptop CPU, with sliding windows short
enough (8) that rings wrap within a short test.
"""

from __future__ import annotations

import importlib
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map

WINDOW = 8

_ATTN = dict(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=256
)

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(
        _ATTN,
        model_type="llama",
        num_hidden_layers=3,
        intermediate_size=128,
        rms_norm_eps=1e-5,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=WINDOW,
        tie_word_embeddings=True,
    ),
    "gemma3_text": dict(
        _ATTN,
        model_type="gemma3_text",
        num_hidden_layers=3,
        intermediate_size=128,
        query_pre_attn_scalar=16,
        sliding_window=WINDOW,
        sliding_window_pattern=2,
    ),
    "gemma4_text": dict(
        _ATTN,
        model_type="gemma4_text",
        num_hidden_layers=4,
        intermediate_size=128,
        global_head_dim=64,
        num_kv_shared_layers=2,
        vocab_size_per_layer_input=256,
        hidden_size_per_layer_input=8,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    ),
    "gpt_oss": dict(
        _ATTN,
        model_type="gpt_oss",
        num_hidden_layers=2,
        intermediate_size=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "qwen3_next": dict(
        _ATTN,
        model_type="qwen3_next",
        num_hidden_layers=2,
        intermediate_size=128,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        shared_expert_intermediate_size=64,
        mlp_only_layers=[],
        moe_intermediate_size=32,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        partial_rotary_factor=0.5,
        max_position_embeddings=512,
        full_attention_interval=2,
    ),
    "qwen3_5": dict(
        model_type="qwen3_5",
        text_config=dict(
            _ATTN,
            model_type="qwen3_5_text",
            num_hidden_layers=2,
            intermediate_size=128,
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            full_attention_interval=2,
            max_position_embeddings=512,
        ),
    ),
    "qwen3_moe": dict(
        _ATTN,
        model_type="qwen3_moe",
        num_hidden_layers=2,
        intermediate_size=128,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        moe_intermediate_size=32,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        max_position_embeddings=512,
        norm_topk_prob=True,
    ),
    "deepseek_v3": dict(
        model_type="deepseek_v3",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        kv_lora_rank=32,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        v_head_dim=16,
        qk_nope_head_dim=16,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        max_position_embeddings=512,
    ),
}


def tiny_model(name: str, seed: int = 0, **overrides: Any) -> nn.Module:
    """A float32 model of architecture `name` with random weights (deterministic per seed)."""
    config = {**TINY_CONFIGS[name], **overrides}
    module = importlib.import_module(f"mlx_lm.models.{name}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    # spread the random weights a little so greedy argmax has clear winners
    params = tree_map(lambda p: p * 2.0 if p.ndim >= 2 else p, model.parameters())
    model.update(params)
    model.eval()
    mx.eval(model.parameters())
    return model
