"""`python -m bench models`: every text architecture mlx-lm ships, checked in mlxd on a tiny model.

    python -m bench models [--arch llama,qwen3] [--jobs 2] [--timeout 300] [--out DIR]

For each `mlx_lm/models/<arch>.py` with a `ModelArgs`, a tiny random-weight config is derived
from the dataclass's fields (hidden 128, 4 heads of 32, 2 KV heads, 4 layers, 4 experts of which
2 per token, vocabulary 256, sliding windows of 8, ...; `derive_config`), the model is built in
float32 on the CPU and put through these checks (greedy, exact tier):

    load      mlxd's layout registry accepts the model; which KV layouts its layers get
    batched   rows prefilled together, joining mid-decode and leaving at different lengths, with
              prompts longer than any sliding window, each equal to mlx-lm's own greedy decoding
              of that prompt alone (its own caches) and to mlxd serving it alone
    prefix    a second request sharing a prompt prefix reuses the cached blocks and still
              equals mlx-lm's greedy output
    ngram     n-gram speculation (forced on every step) equals plain greedy, batched
    kv8       8-bit KV: batched equals alone (and equals mlx-lm's QuantizedKVCache where every
              layer is full attention); where the architecture cannot quantize, the engine must
              refuse it with a clear error

Each architecture runs in its own subprocess under a time limit, so a crash or a hang in one
never stops the sweep. Results: <out>/models.json and <out>/models.md (the table in
docs/models.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from bench.common import add_out_arg, out_dir

# -- tiny dimensions -----------------------------------------------------------------------

HIDDEN = 128
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 32  # the smallest head MLX's 8-bit KV quantizes (group size 32)
LAYERS = 4
FFN = 128
EXPERT_FFN = 64
EXPERTS = 4
TOP_K = 2
VOCAB = 256
WINDOW = 8
STATE = 16
CONV = 4
RANK = 32
KV_GROUP = 32

# field name -> tiny value (ints); applied when the field exists in ModelArgs
_INT_RULES: tuple[tuple[int, tuple[str, ...]], ...] = (
    (HIDDEN, ("hidden_size", "d_model", "n_embd", "model_dim", "hidden_dim", "block_dim")),
    (HEADS, (
        "num_attention_heads", "n_head", "n_heads", "num_heads", "num_query_heads",
        "num_swa_attention_heads", "swa_num_attention_heads", "mamba_n_heads",
        "mamba_num_heads", "linear_num_value_heads",
    )),
    (KV_HEADS, (
        "num_key_value_heads", "n_kv_heads", "num_kv_heads", "num_global_key_value_heads",
        "num_swa_key_value_heads", "swa_num_key_value_heads", "linear_num_key_heads",
        "index_n_heads", "num_attention_groups",
    )),
    (HEAD_DIM, (
        "head_dim", "swa_head_dim", "kv_channels", "hidden_size_per_head", "mamba_d_head",
        "mamba_head_dim", "index_head_dim", "linear_key_head_dim", "linear_value_head_dim",
        "v_head_dim", "swa_v_head_dim", "qk_nope_head_dim", "qk_head_dim",
    )),
    (2 * HEAD_DIM, ("global_head_dim", "q_lora_rank", "kv_lora_rank", "o_lora_rank")),
    (LAYERS, ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "num_transformer_layers")),
    (FFN, (
        "intermediate_size", "ffn_hidden_size", "n_inner", "block_ff_dim", "ff_intermediate_size",
        "intermediate_size_mlp",
    )),
    (EXPERT_FFN, (
        "moe_intermediate_size", "expert_ffn_hidden_size", "shared_expert_intermediate_size",
        "moe_shared_expert_intermediate_size", "shared_intermediate_size", "share_expert_dim",
        "moe_latent_size",
    )),
    (EXPERTS, ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")),
    (TOP_K, (
        "num_experts_per_tok", "moe_topk", "moe_k", "top_k_experts", "moe_top_k",
        "num_experts_per_token",
    )),
    (1, (
        "n_shared_experts", "num_shared_experts", "num_shared_expert", "moe_num_shared_experts",
        "n_group", "num_expert_group", "topk_group", "n_groups", "mamba_n_groups",
        "decoder_sparse_step", "moe_layer_freq", "first_k_dense_replace", "num_dense_layers",
        "expert_layer_offset", "attn_layer_offset",
    )),
    (VOCAB, ("vocab_size", "num_vocab", "vocab_size_per_layer_input")),
    (WINDOW, (
        "sliding_window", "sliding_window_size", "attention_window_size", "window_size",
        "loop_window_size", "index_topk",
    )),
    (STATE, ("state_size", "ssm_state_size", "mamba_d_state", "qk_rope_head_dim", "rotary_dim")),
    (CONV, ("mamba_d_conv", "conv_kernel", "conv1d_width", "linear_conv_kernel_dim")),
    (RANK // 2, (
        "a_low_rank_dim", "decay_low_rank_dim", "gate_low_rank_dim", "v_low_rank_dim",
        "time_step_rank", "mamba_dt_rank", "hidden_size_per_layer_input",
    )),
    (2, (
        "sliding_window_pattern", "full_attention_interval", "attn_layer_period",
        "expert_layer_period", "layer_group_size", "dense_attention_every_n_layers",
        "no_rope_layer_interval", "num_kv_shared_layers", "cla_share_factor",
    )),
)
_SWA = ["sliding_attention", "full_attention"] * (LAYERS // 2)
RULES: dict[str, int] = {name: v for v, names in _INT_RULES for name in names}
_EXPERT_COUNTS = next(names for v, names in _INT_RULES if v == EXPERTS and "num_experts" in names)

# Architectures whose file is not a text model mlxd can serve; the reason goes in the table.
SKIPPED: dict[str, str] = {
    "bitnet": "its ternary linear layers run a custom Metal kernel (no CPU or CUDA path): "
    "not checkable on this machine",
    "muse_spark": "its attention runs custom Metal kernels (no CPU or CUDA path): not checkable "
    "on this machine",
    "prism_hadamard_qwen35": "a 2-bit Hadamard-rotated weight pack of qwen3_5 (needs the pack's "
    "module manifest, no random weights); its layers are qwen3_5's",
    "olmo": "needs the `ai2-olmo` package (mlx-lm exits at import without it); OLMo 2/3 "
    "checkpoints use olmo2 / olmo3",
}

# wrappers of a text model inside a multimodal checkpoint: `text_config` is derived from the
# inner text model's arguments (mlx-lm ships no vision/audio towers; their weights are dropped)
TEXT_CONFIG_OF: dict[str, str] = {
    "gemma3": "gemma3_text:ModelArgs",
    "gemma3n": "gemma3n:TextConfig",
    "gemma4": "gemma4_text:ModelArgs",
    "kimi_k25": "deepseek_v3:ModelArgs",
    "kimi_k3": "kimi_k3:TextArgs",
    "kimi_vl": "kimi_vl:TextArgs",
    "lfm2-vl": "lfm2:ModelArgs",
    "llama4": "llama4:TextArgs",
    "minimax_m3_vl": "minimax_m3_vl:TextArgs",
    "mistral3": "llama:ModelArgs",
    "muse_spark": "muse_spark:TextArgs",
    "pixtral": "llama:ModelArgs",
    "qwen2_vl": "qwen2:ModelArgs",
    "qwen3_5": "qwen3_5:TextModelArgs",
    "qwen3_5_moe": "qwen3_5:TextModelArgs",
    "qwen3_vl": "qwen3:ModelArgs",
    "qwen3_vl_moe": "qwen3_moe:ModelArgs",
}

_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
_KDA = {"kda_layers": [1, 3], "num_heads": HEADS, "head_dim": HEAD_DIM,
        "short_conv_kernel_size": CONV}
_YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}

# where the rules are not enough: applied after them (the text config's keys for wrappers)
OVERRIDES: dict[str, dict[str, Any]] = {
    "afm7": {"num_kv_reuse_layers": 2},
    "afmoe": {"layer_types": _SWA},
    "baichuan_m1": {"sliding_window_layers": [0, 2], "conv_window": 2},
    "bailing_hybrid": {"group_norm_size": 2},
    "bailing_moe_linear": {"group_norm_size": 2},
    "dbrx": {"ffn_config": {"ffn_hidden_size": EXPERT_FFN, "moe_num_experts": EXPERTS,
                            "moe_top_k": TOP_K},
             "attn_config": {"kv_n_heads": KV_HEADS, "clip_qkv": 8.0, "rope_theta": 10000.0}},
    "deepseek_v2": {"rope_scaling": _YARN},
    "exaone4": {"rope_scaling": None, "sliding_window_pattern": "LG"},
    "exaone_moe": {"layer_types": _SWA, "is_moe_layer": [False, True, True, True]},
    "gear": {"layer_types": _SWA},
    "gemma3n": {"layer_types": _SWA, "activation_sparsity_pattern": [0.0] * LAYERS,
                "altup_num_inputs": 2, "altup_coef_clip": 120.0, "altup_correct_scale": True,
                "altup_active_idx": 0, "laurel_rank": 16, "final_logit_softcapping": 30.0,
                "rope_local_base_freq": 10000.0},
    "glm_moe_dsa": {"topk_method": "noaux_tc", "scoring_func": "sigmoid",
                    "rope_parameters": _ROPE},
    "hunyuan": {"rope_scaling": {"alpha": 1.0, "factor": 1.0, "type": "dynamic"}},
    "jamba": {"mamba_expand": 2, "attn_layer_period": 2, "attn_layer_offset": 1,
              "expert_layer_period": 2, "expert_layer_offset": 1},
    "kimi_k3": {"rope_scaling": None, "linear_attn_config": _KDA},
    "kimi_linear": {"linear_attn_config": _KDA, "num_experts_per_token": TOP_K},
    "lfm2": {"conv_L_cache": 3, "block_multiple_of": 16, "block_ffn_dim_multiplier": 1.0,
             "block_auto_adjust_ff_dim": False, "full_attn_idxs": [1, 3], "conv_bias": False},
    "lfm2-vl": {"conv_L_cache": 3, "block_multiple_of": 16, "block_ffn_dim_multiplier": 1.0,
                "block_auto_adjust_ff_dim": False, "full_attn_idxs": [1, 3], "conv_bias": False},
    "lfm2_moe": {"conv_L_cache": 3, "full_attn_idxs": [1, 3], "conv_bias": False},
    "lille-130m": {"block_size": 4096},
    "llama4": {"num_experts_per_tok": 1, "attention_chunk_size": WINDOW, "interleave_moe_layer_step": 2,
               "rope_scaling": None, "use_qk_norm": True},
    "llama4_text": {"no_rope_layers": [1, 1, 1, 0]},
    "longcat_flash": {"attention_method": "MLA", "zero_expert_type": "identity",
                      "zero_expert_num": 1, "mla_scale_q_lora": True, "mla_scale_kv_lora": True},
    "longcat_flash_ngram": {"zero_expert_num": 1, "zero_expert_type": "identity"},
    "mamba2": {"time_step_limit": [0.0, float("inf")]},
    "mellum": {"layer_types": _SWA,
               "rope_parameters": {"sliding_attention": _ROPE, "full_attention": _ROPE}},
    "mimo_v2_flash": {"topk_method": "noaux_tc", "scoring_func": "sigmoid",
                      "partial_rotary_factor": 1, "hybrid_layer_pattern": [1, 0, 1, 0],
                      "moe_layer_freq": [0, 1, 1, 1]},
    "minimax_m3_vl": {"moe_layer_freq": [0, 1, 1, 1]},
    "minicpm3": {"rope_scaling": {"original_max_position_embeddings": 1024,
                                  "short_factor": 1.0, "long_factor": 1.0}},
    "minimax": {"rotary_dim": HEAD_DIM},
    "ministral3": {"rope_parameters": {**_ROPE, "llama_4_scaling_beta": 0.1,
                                       "original_max_position_embeddings": 1024}},
    "mistral4": {"rope_parameters": {**_ROPE, "llama_4_scaling_beta": 0.1,
                                     "original_max_position_embeddings": 1024}},
    "muse_spark": {"rope_parameters": _ROPE, "moe_hidden_size": EXPERT_FFN,
                   "num_shared_experts": 0, "mlp_layer_types": ["sparse"] * LAYERS,
                   "layer_types": _SWA, "layer_rope_theta": [10000.0] * LAYERS},
    "nemotron": {"hidden_act": "relu2"},
    "nemotron-nas": {"block_configs": [
        {"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 1.0}},
        {"attention": {"no_op": True}, "ffn": {"ffn_mult": 1.0}},
        {"attention": {"replace_with_linear": True}, "ffn": {"no_op": True}},
        {"attention": {"n_heads_in_group": 4}, "ffn": {"replace_with_linear": True}},
    ]},
    "nemotron_h": {"hybrid_override_pattern": ["M", "*", "E", "-"],
                   "routed_scaling_factor": 1.0},
    "granitemoehybrid": {"layer_types": ["mamba", "attention"] * (LAYERS // 2)},
    "openelm": {"ffn_dim_divisor": 16, "ffn_multipliers": [1.0] * LAYERS,
                "num_query_heads": [HEADS] * LAYERS, "num_kv_heads": [KV_HEADS] * LAYERS},
    "plamo": {"n_shared_head": 2},
    "qwen3": {"rope_theta": 10000.0},
    "qwen3_vl": {"rope_theta": 10000.0},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"], "logits_soft_cap": 30.0},
    "spark2_5": {"rope_parameters": {"sliding_attention": _ROPE, "full_attention": _ROPE}},
}


def architectures(models_dir: Path | None = None) -> list[str]:
    """Every mlx-lm model file with a ModelArgs (found by reading, not importing, the files)."""
    if models_dir is None:
        import mlx_lm.models

        models_dir = Path(mlx_lm.models.__file__).parent
    return sorted(
        p.stem for p in models_dir.glob("*.py") if "class ModelArgs" in p.read_text()
    )


def _import(arch: str) -> Any:
    try:
        return importlib.import_module(f"mlx_lm.models.{arch}")
    except SystemExit as exc:  # a model file that exits when an optional package is missing
        raise ImportError(f"mlx_lm.models.{arch} exited at import ({exc})") from None


def _args_class(spec: str) -> Any:
    mod, _, cls = spec.partition(":")
    return getattr(_import(mod), cls)


def _shrink_list(values: Sequence[Any], n: int) -> list[Any]:
    """A per-layer list cut to `n` layers, keeping every kind of entry it had."""
    out = list(values[:n])
    missing = [v for v in dict.fromkeys(values) if v not in out]
    for i, v in enumerate(missing[: n - 1]):
        out[n - 1 - i] = v
    return out


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _tiny_args(args_cls: Any) -> dict[str, Any]:
    """Field-name rules over a ModelArgs dataclass: {field: tiny value}."""
    fields = {f.name: f for f in dataclasses.fields(args_cls)}
    default_layers = next(
        (d for n in RULES if RULES[n] == LAYERS and n in fields
         for d in [_default(fields[n])] if isinstance(d, int)),
        None,
    )
    source = Path(sys.modules[args_cls.__module__].__file__ or "").read_text()
    swa = '"sliding_attention"' in source
    out: dict[str, Any] = {}
    for name, f in fields.items():
        default = _default(f)
        if name in RULES:
            value = RULES[name]
            if isinstance(default, list | tuple) and default and isinstance(default[0], int):
                out[name] = [value] * LAYERS  # per-layer counts (e.g. openelm)
            else:
                out[name] = value
        elif (
            isinstance(default, list | tuple)
            and default_layers is not None
            and len(default) == default_layers
        ):
            out[name] = _shrink_list(default, LAYERS)
        elif "theta" in name and default is None and "ist" not in str(f.type):
            out[name] = 10000.0
        elif name == "layer_types" and default in (None, dataclasses.MISSING) and swa:
            out[name] = list(_SWA)
        elif default is dataclasses.MISSING and name != "model_type":
            value = _required_value(name, f.type)
            if value is not dataclasses.MISSING:
                out[name] = value
    return out


_POSITIONS = ("max_position_embeddings", "n_positions", "n_ctx", "model_max_length",
              "original_max_position_embeddings")


def _required_value(name: str, annotation: Any) -> Any:
    """A neutral value for a field a real config always sets (norm epsilons, RoPE bases, flags)."""
    kind = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    kind = kind.replace("typing.", "")
    if name in _POSITIONS:
        return 4096
    if "eps" in name:
        return 1e-5
    if "theta" in name or name.endswith("_base"):
        return 10000.0
    if kind.startswith(("Optional", "None")) or kind.endswith("| None"):
        return None
    if kind == "bool":
        return False
    if kind == "float":
        return 1.0
    if kind.startswith(("list", "List")):
        return []
    return dataclasses.MISSING


def derive_config(arch: str) -> dict[str, Any]:
    """A tiny config for mlx-lm architecture `arch` (a config.json's content)."""
    module = _import(arch)
    if arch in TEXT_CONFIG_OF:
        text_cls = _args_class(TEXT_CONFIG_OF[arch])
        text = _tiny_args(text_cls)
        text.setdefault("model_type", _inner_type(TEXT_CONFIG_OF[arch]))
        text.update(OVERRIDES.get(arch, {}))
        outer = {k: v for k, v in _tiny_args(module.ModelArgs).items() if k != "text_config"}
        return {**outer, "model_type": arch, "text_config": text, "vocab_size": VOCAB}
    cfg = _tiny_args(module.ModelArgs)
    cfg["model_type"] = arch
    cfg.update(OVERRIDES.get(arch, {}))
    return cfg


def _inner_type(spec: str) -> str:
    return spec.partition(":")[0]


def missing_fields(arch: str, cfg: dict[str, Any]) -> list[str]:
    """Required ModelArgs fields (no default) the derived config leaves out."""
    module = _import(arch)
    args_cls = _args_class(TEXT_CONFIG_OF[arch]) if arch in TEXT_CONFIG_OF else module.ModelArgs
    src = cfg.get("text_config", cfg) if arch in TEXT_CONFIG_OF else cfg
    return [
        f.name
        for f in dataclasses.fields(args_cls)
        if _default(f) is dataclasses.MISSING and f.name not in src
    ]


def build_model(arch: str, seed: int = 0, config: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
    """The float32 random-weight model of the derived config (weights spread so greedy argmax
    has clear winners)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    cfg = config if config is not None else derive_config(arch)
    module = _import(arch)
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(json.loads(json.dumps(cfg))))
    flat: Any = tree_flatten(model.parameters())
    params = [
        (k, mx.random.normal(v.shape) * 0.3 if v.ndim > 1 and mx.issubdtype(v.dtype, mx.floating) else v)
        for k, v in flat
    ]
    model.update(tree_unflatten(params))
    model.set_dtype(mx.float32)
    model.eval()
    mx.eval(model.parameters())
    return model, cfg


# -- the checks ----------------------------------------------------------------------------

PROMPT_LENGTHS = (21, 13, 26, 11)  # all longer than the tiny sliding windows (8)
MAX_TOKENS = (10, 6, 12, 4)  # rows leave at different steps
PREFILL_CHUNK = 8  # prefill in chunks: a window wraps inside the prompt
WAIT_S = 120.0
NEAR_TIE = 1e-3  # float32 logits this close are a tie whose order rounding may flip


@dataclass(slots=True)
class Check:
    ok: bool | None  # None: not applicable
    reason: str = ""


@dataclass(slots=True)
class ArchResult:
    arch: str
    status: str  # ok | fail | unsupported | skipped
    layouts: str = ""
    traits: list[str] = field(default_factory=list)
    checks: dict[str, Check] = field(default_factory=dict)
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_json(d: dict[str, Any]) -> ArchResult:
        checks = {k: Check(**v) for k, v in d.get("checks", {}).items()}
        return ArchResult(**{**d, "checks": checks})


CHECKS = ("load", "batched", "prefix", "ngram", "kv8")


class _Harness:
    """One tiny model served by fresh engines (float32, CPU, greedy)."""

    def __init__(self, model: Any, cfg: dict[str, Any]) -> None:
        from engine.loader import LoadedModel

        self.model = model
        self.lm = LoadedModel(
            model=model, tokenizer=None, config=cfg, path=Path("."), model_id=cfg["model_type"],
            eos_token_ids=(), context_length=4096, chat_template=None, dtype="float32",
            vocab_size=VOCAB,
        )

    def engine(self, *, spec: Any = None, kv_bits: int = 16, prefix: bool = False) -> Any:
        from engine.core import Engine, EngineConfig
        from engine.scheduler import SchedulerConfig

        cfg = EngineConfig(
            SchedulerConfig(max_num_seqs=8, prefill_chunk=PREFILL_CHUNK),
            prefix_cache_bytes=(1 << 24) if prefix else 0, prefix_block_size=4, spec=spec,
        )
        cfg.kv = dataclasses.replace(cfg.kv, kv_bits=kv_bits, kv_group_size=KV_GROUP)
        eng = Engine.spawn(self.lm, cfg)  # built on its loop's thread (MLX keeps state per thread)
        return eng

    def serve(self, eng: Any, reqs: Sequence[Any], join_after: int | None = None) -> list[_Out]:
        """Submit `reqs`; with `join_after`, the second half joins once the first row has
        produced that many tokens."""
        half = len(reqs) // 2 if join_after is not None else len(reqs)
        outs = [_submit(eng, r) for r in reqs[:half]]
        if join_after is not None:
            deadline = time.monotonic() + WAIT_S
            while len(outs[0].tokens) < join_after and not outs[0].done.is_set():
                if time.monotonic() > deadline:
                    break
                outs[0].done.wait(0.005)
            outs += [_submit(eng, r) for r in reqs[half:]]
        for r, o in zip(reqs, outs, strict=True):
            if not o.done.wait(WAIT_S):
                raise TimeoutError(f"{r.req_id} did not finish in {WAIT_S:.0f} s")
            if o.error:
                raise RuntimeError(f"engine error: {o.error}")
        return outs

    def alone(self, reqs: Sequence[Any], **engine_kw: Any) -> list[list[int]]:
        eng = self.engine(**engine_kw)
        try:
            return [self.serve(eng, [r])[0].tokens for r in reqs]
        finally:
            eng.stop()

    def batched(self, reqs: Sequence[Any], **engine_kw: Any) -> tuple[list[_Out], Any]:
        eng = self.engine(**engine_kw)
        try:
            outs = self.serve(eng, reqs, join_after=3)
            return outs, eng.stats()
        finally:
            eng.stop()


@dataclass(slots=True)
class _Out:
    tokens: list[int] = field(default_factory=list)
    cached: int = 0
    error: str | None = None
    done: Any = None


def _submit(eng: Any, req: Any) -> _Out:
    import threading

    out = _Out(done=threading.Event())

    def sink(events: list[Any]) -> None:
        for ev in events:
            out.tokens.extend(ev.token_ids)
            out.cached = max(out.cached, ev.num_cached_tokens)
            if ev.finish_reason is not None:
                out.error = ev.error
                out.done.set()

    eng.add(req, sink)
    return out


def _request(req_id: str, prompt: list[int], max_tokens: int) -> Any:
    from engine.api import Request, SamplingParams

    return Request(req_id, list(prompt), SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                        ignore_eos=True))


def _prompts(seed: int, lengths: Sequence[int] = PROMPT_LENGTHS) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(1, VOCAB) for _ in range(n)] for n in lengths]


def _repetitive(seed: int, n: int) -> list[list[int]]:
    """Prompts that open with every token of the vocabulary once (shuffled), then repeated
    stretches: a one-token n-gram lookup finds drafts at every step, whatever a random model
    outputs."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        every = list(range(1, VOCAB))
        rng.shuffle(every)
        motif = [rng.randrange(1, VOCAB) for _ in range(rng.randint(4, 7))]
        noise = [rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 6))]
        out.append(every + motif * 3 + noise + motif)
    return out


def mlx_greedy(model: Any, prompt: list[int], n: int, cache: list[Any] | None = None) -> list[int]:
    """mlx-lm's own single-sequence greedy decoding (its own per-layer caches)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = cache if cache is not None else make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[:, -1]
    out: list[int] = []
    while True:
        best: Any = mx.argmax(logits, axis=-1).tolist()
        out.append(int(best[0]))
        if len(out) == n:
            return out
        logits = model(mx.array([[out[-1]]]), cache=cache)[:, -1]


def _near_tie(model: Any, prompt: list[int], got: list[int], want: list[int]) -> str | None:
    """Why `got` (ours) differs from `want` (the reference), or None when the first difference
    is a float32 near-tie and every token of `got` is the model's argmax up to one."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    first = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
    if first is None:
        return None if len(got) == len(want) else f"{len(got)} tokens, expected {len(want)}"
    seq = mx.array([list(prompt) + list(got[:-1])])
    logits = model(seq, cache=make_prompt_cache(model))[0, len(prompt) - 1 :]
    picked = mx.take_along_axis(logits, mx.array(got)[:, None], axis=-1)[:, 0]
    gaps = (logits.max(axis=-1) - picked).tolist()
    if max(gaps[first:]) <= NEAR_TIE:
        return None
    return (f"token {first} is {got[first]}, expected {want[first]} "
            f"(the model's choice by {max(gaps[first:]):.3g} logits)")


def _compare(model: Any, reqs: Sequence[Any], got: Sequence[list[int]],
             want: Sequence[list[int]], what: str) -> str | None:
    for r, g, w in zip(reqs, got, want, strict=True):
        why = _near_tie(model, r.prompt_ids, g, w)
        if why:
            return f"{what}, {r.req_id}: {why}"
    return None


def _guard(fn: Callable[[], Check]) -> Check:
    try:
        return fn()
    except Exception as exc:  # a check that crashes fails with the error, the sweep goes on
        return Check(False, f"{type(exc).__name__}: {_one_line(str(exc))}")


def _one_line(text: str, limit: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def check_batched(h: _Harness, seed: int = 0) -> Check:
    reqs = [_request(f"r{i}", p, n) for i, (p, n) in enumerate(zip(_prompts(seed), MAX_TOKENS, strict=True))]
    ref = [mlx_greedy(h.model, r.prompt_ids, r.params.max_tokens) for r in reqs]
    alone = h.alone(reqs)
    why = _compare(h.model, reqs, alone, ref, "alone vs mlx-lm")
    if why:
        return Check(False, why)
    outs, _ = h.batched(reqs)
    why = _compare(h.model, reqs, [o.tokens for o in outs], alone, "batched vs alone")
    return Check(why is None, why or f"{len(reqs)} rows joining and leaving == alone == mlx-lm")


def check_prefix(h: _Harness, seed: int = 1) -> Check:
    shared, a_tail, b_tail = _prompts(seed, (16, 5, 7))
    reqs = [_request("a", shared + a_tail, 4), _request("b", shared + b_tail, 8),
            _request("a2", shared + a_tail, 6)]
    ref = [mlx_greedy(h.model, r.prompt_ids, r.params.max_tokens) for r in reqs]
    eng = h.engine(prefix=True)
    try:
        outs = [h.serve(eng, [r])[0] for r in reqs]
    finally:
        eng.stop()
    why = _compare(h.model, reqs, [o.tokens for o in outs], ref, "with prefix cache vs mlx-lm")
    if why:
        return Check(False, why)
    if outs[1].cached == 0 or outs[2].cached == 0:
        return Check(False, f"no reuse: {outs[1].cached} / {outs[2].cached} prompt tokens cached")
    return Check(True, f"reused {outs[1].cached} and {outs[2].cached} prompt tokens, same output")


def _refused(h: _Harness, otherwise: str, **engine_args: Any) -> Check:
    """A configuration the registry says cannot work: the engine must refuse it at start-up
    with a clear error (the check passes, with the reason), else it fails with `otherwise`."""
    try:
        h.engine(**engine_args).stop()
    except ValueError as exc:
        return Check(True, f"refused: {_one_line(str(exc))}")
    return Check(False, otherwise)


def check_ngram(h: _Harness, seed: int = 2) -> Check:
    from engine.models import prepare_model, speculation_blocker
    from engine.spec import SpecConfig

    spec = SpecConfig("ngram", num_draft_tokens=3, adaptive=False, ngram_min=1)
    prepare_model(h.model)
    if speculation_blocker(h.model):  # the engine must refuse it at start-up, clearly
        return _refused(h, "speculation was not refused, though its rollback cannot work",
                        spec=spec)
    reqs = [_request(f"s{i}", p, 12) for i, p in enumerate(_repetitive(seed, 3))]
    ref = [mlx_greedy(h.model, r.prompt_ids, r.params.max_tokens) for r in reqs]
    outs, stats = h.batched(reqs, spec=spec)
    why = _compare(h.model, reqs, [o.tokens for o in outs], ref, "speculative vs mlx-lm")
    if why:
        return Check(False, why)
    st = stats.spec
    if st is None or not st.drafted_tokens:
        return Check(False, "no tokens were drafted: the check verified nothing")
    return Check(True, f"{st.drafted_tokens} drafted, acceptance {st.acceptance_rate or 0:.2f}")


def check_kv8(h: _Harness, seed: int = 3) -> Check:
    from mlx_lm.models import cache as mlc

    from engine.models import layer_templates, spec_for

    spec = spec_for(h.model)
    reqs = [_request(f"q{i}", p, n) for i, (p, n) in enumerate(zip(_prompts(seed), MAX_TOKENS, strict=True))]
    if not spec.can_quantize:
        return _refused(h, "8-bit KV was not refused, though the registry says it cannot work",
                        kv_bits=8)
    try:
        h.engine(kv_bits=8).stop()
    except ValueError as exc:  # the engine's start-up probe: a clear error, not wrong output
        return Check(True, f"refused: {_one_line(str(exc))}")
    alone = h.alone(reqs, kv_bits=8)
    templates = layer_templates(h.model)
    if all(type(t) in (mlc.KVCache, mlc.ArraysCache) for t in templates):
        def ref_cache() -> list[Any]:
            return [t if isinstance(t, mlc.ArraysCache)
                    else mlc.QuantizedKVCache(group_size=KV_GROUP, bits=8)
                    for t in layer_templates(h.model)]

        ref = [mlx_greedy(h.model, r.prompt_ids, r.params.max_tokens, ref_cache()) for r in reqs]
        if alone != ref:
            i = next(i for i, (a, b) in enumerate(zip(alone, ref, strict=True)) if a != b)
            return Check(False, f"alone vs mlx-lm QuantizedKVCache differ on {reqs[i].req_id}")
    outs, _ = h.batched(reqs, kv_bits=8)
    got = [o.tokens for o in outs]
    if got != alone:
        i = next(i for i, (a, b) in enumerate(zip(got, alone, strict=True)) if a != b)
        return Check(False, f"batched vs alone differ on {reqs[i].req_id} (8-bit KV)")
    return Check(True, "batched == alone" + (" == mlx-lm" if "ref" in locals() else ""))


# -- one architecture ----------------------------------------------------------------------


def _describe_layouts(model: Any) -> tuple[str, list[str]]:
    from collections import Counter

    from engine.models import make_batch_layouts, prepare_model

    prepare_model(model)
    layouts = make_batch_layouts(model, 1)
    names = []
    for lay in layouts:
        kind = getattr(lay, "kind", type(lay).__name__)
        window = getattr(lay, "window", None)
        names.append(f"{kind}({window})" if kind == "rotating" and window else kind)
    counts = Counter(names)
    return " ".join(f"{k}×{v}" for k, v in counts.items()), names


def _traits(model: Any, cfg: dict[str, Any], names: list[str]) -> list[str]:
    """The layout kinds the CI sample must cover: plain, sliding, recurrent, MLA, MoE, KV-shared."""
    text = cfg.get("text_config") or cfg
    out = []
    if "plain" in names:
        out.append("plain")
    if any(n.startswith("rotating") for n in names):
        out.append("sliding")
    if "recurrent" in names:
        out.append("recurrent")
    if any(text.get(k) for k in ("kv_lora_rank",)):
        out.append("MLA")
    if any(text.get(k) for k in _EXPERT_COUNTS):
        out.append("MoE")
    layers = getattr(getattr(model, "language_model", model), "layers", None)
    if layers is None:
        layers = getattr(model, "layers", None)
    if layers is not None and 0 < len(names) < len(layers):
        out.append("KV-shared")
    return out


def run_one(arch: str, checks: Sequence[str] = CHECKS) -> ArchResult:
    """Every check on one architecture (in this process)."""
    import mlx.core as mx

    from engine.models import UnsupportedArchitecture

    t0 = time.monotonic()
    res = ArchResult(arch, "ok")
    if arch in SKIPPED:
        res.status = "skipped"
        res.checks["load"] = Check(None, SKIPPED[arch])
        return res
    import logging

    logging.getLogger("mlxd").setLevel(logging.CRITICAL)  # failures are reported per check
    mx.set_default_device(mx.cpu)
    mx.disable_compile()  # compiled helpers JIT per shape on a CPU (slow); same answers
    try:
        model, cfg = build_model(arch)
    except Exception as exc:
        res.status = "fail"
        res.checks["load"] = Check(False, f"building the tiny model: {type(exc).__name__}: "
                                          f"{_one_line(str(exc))}")
        return res
    try:
        res.layouts, names = _describe_layouts(model)
        res.traits = _traits(model, cfg, names)
        res.checks["load"] = Check(True, "")
    except UnsupportedArchitecture as exc:
        res.status = "unsupported"
        res.checks["load"] = Check(None, str(exc))
        return res
    except Exception as exc:
        res.status = "fail"
        res.checks["load"] = Check(False, f"{type(exc).__name__}: {_one_line(str(exc))}")
        return res
    h = _Harness(model, cfg)
    table: dict[str, Callable[[_Harness], Check]] = {
        "batched": check_batched, "prefix": check_prefix, "ngram": check_ngram, "kv8": check_kv8,
    }
    for name in checks:
        fn = table.get(name)
        if fn is not None:
            res.checks[name] = _guard(partial(fn, h))
    if any(c.ok is False for c in res.checks.values()):
        res.status = "fail"
    res.seconds = round(time.monotonic() - t0, 1)
    return res


# -- the sweep: each architecture in a forked child under a time limit ---------------------


def _child(arch: str, checks: Sequence[str], conn: Any) -> None:
    try:
        conn.send(run_one(arch, checks).to_json())
    except BaseException as exc:
        conn.send(ArchResult(arch, "fail", checks={"load": Check(
            False, f"{type(exc).__name__}: {_one_line(str(exc))}")}).to_json())
    finally:
        conn.close()


def run_isolated(arch: str, checks: Sequence[str] = CHECKS, timeout: float = 300.0) -> ArchResult:
    """`run_one` in a forked child: a crash or a hang fails this architecture only."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(arch, list(checks), child), daemon=True)
    t0 = time.monotonic()
    proc.start()
    child.close()
    got = parent.poll(timeout)
    try:
        data = parent.recv() if got else None
    except EOFError:  # the child died without an answer
        data = None
    proc.join(5 if got else 0)
    if proc.is_alive():
        proc.kill()
        proc.join()
    if data is not None:
        return ArchResult.from_json(data)
    why = (f"timed out after {timeout:.0f} s" if not got
           else f"crashed (exit code {proc.exitcode})")
    if proc.exitcode is not None and proc.exitcode < 0:
        why = f"crashed (signal {-proc.exitcode})"
    return ArchResult(arch, "fail", checks={"load": Check(False, why)},
                      seconds=round(time.monotonic() - t0, 1))


def sweep(archs: Sequence[str], checks: Sequence[str] = CHECKS, jobs: int = 1,
          timeout: float = 300.0, progress: Callable[[ArchResult], None] | None = None,
          ) -> list[ArchResult]:
    # the BLAS library before MLX (engine's import does it), all of it once, before forking
    for name in ("engine", "mlx.core", "mlx_lm.models.cache", "engine.core"):
        importlib.import_module(name)

    def one(arch: str) -> ArchResult:
        res = run_isolated(arch, checks, timeout)
        if progress is not None:
            progress(res)
        return res

    with ThreadPoolExecutor(max(1, jobs)) as pool:
        return list(pool.map(one, archs))


# -- report --------------------------------------------------------------------------------


def _cell(c: Check | None) -> str:
    if c is None:
        return "—"
    mark = {True: "pass", False: "**FAIL**", None: "n/a"}[c.ok]
    return f"{mark}: {c.reason}" if c.reason and c.ok is not True else mark


def table(results: Sequence[ArchResult]) -> str:
    lines = [
        "| architecture | layouts (one per cached layer) | kinds | load | batched | prefix | ngram | kv8 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        cells = [_cell(r.checks.get(k)) for k in CHECKS]
        if r.status == "skipped":
            cells = [f"skipped: {r.checks['load'].reason}"] + ["—"] * (len(CHECKS) - 1)
        elif r.status == "unsupported":
            cells = [f"not supported: {r.checks['load'].reason}"] + ["—"] * (len(CHECKS) - 1)
        for i, k in enumerate(CHECKS):  # an engine refusing what cannot work is the pass
            c = r.checks.get(k)
            if c is not None and c.ok and c.reason.startswith("refused"):
                cells[i] = "refused (clear error)"
        row = [f"`{r.arch}`", r.layouts.replace("|", "/"), ", ".join(r.traits), *cells]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in row) + " |")
    return "\n".join(lines)


def summary(results: Sequence[ArchResult]) -> dict[str, int]:
    out = {"architectures": len(results)}
    for status in ("ok", "fail", "unsupported", "skipped"):
        out[status] = sum(1 for r in results if r.status == status)
    return out


def summary_line(results: Sequence[ArchResult]) -> str:
    s = summary(results)
    return (f"{s['architectures']} architecture files: {s['ok']} pass every check, "
            f"{s['fail']} fail, {s['unsupported']} refused at load (not supported yet), "
            f"{s['skipped']} skipped")


DOC_BEGIN = "<!-- bench models: begin -->"
DOC_END = "<!-- bench models: end -->"


def write_docs(doc: Path, results: Sequence[ArchResult], command: str) -> None:
    """Replace the generated section of `doc` (between the markers) with this sweep's table."""
    import mlx_lm

    body = (f"{DOC_BEGIN}\n{summary_line(results)} (mlx-lm {mlx_lm.__version__}; made by "
            f"`{command}`).\n\n{table(results)}\n{DOC_END}")
    text = doc.read_text() if doc.exists() else f"{DOC_BEGIN}\n{DOC_END}\n"
    start, end = text.index(DOC_BEGIN), text.index(DOC_END) + len(DOC_END)
    doc.write_text(text[:start] + body + text[end:])


# -- command line --------------------------------------------------------------------------


def add_parsers(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("models", help="every mlx-lm text architecture on a tiny model: "
                                      "load, batched == alone, prefix, n-gram, 8-bit KV")
    p.add_argument("--arch", default="", help="comma list (default: every architecture file)")
    p.add_argument("--checks", default=",".join(CHECKS), help=f"comma list of {', '.join(CHECKS)}")
    p.add_argument("--jobs", type=int, default=1, help="architectures checked at once")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per architecture")
    add_out_arg(p)
    p.add_argument("--docs", default=None,
                   help="also write the table into this markdown file (e.g. docs/models.md)")
    p.set_defaults(func=_cmd)
    return p


def _cmd(args: argparse.Namespace) -> int:
    archs = [a for a in args.arch.split(",") if a] or architectures()
    checks = [c for c in args.checks.split(",") if c]
    out = out_dir(args, "models")
    rest = list(getattr(args, "argv", None) or sys.argv[2:])
    rest = rest[1:] if rest[:1] == ["models"] else rest  # `python -m bench models ...`
    command = "python -m bench models " + " ".join(rest)

    def progress(r: ArchResult) -> None:
        bad = {k: c.reason for k, c in r.checks.items() if c.ok is False}
        print(f"{r.arch:24s} {r.status:11s} {r.seconds:6.1f}s {r.layouts}  {bad or ''}",
              flush=True)

    results = sweep(archs, checks, args.jobs, args.timeout, progress)
    (out / "models.json").write_text(json.dumps(
        {"command": command, "summary": summary(results),
         "results": [r.to_json() for r in results]}, indent=1))
    (out / "models.md").write_text(summary_line(results) + "\n\n" + table(results) + "\n")
    if args.docs:
        write_docs(Path(args.docs), results, command.strip())
    print(summary_line(results))
    print(f"wrote {out / 'models.json'}, {out / 'models.md'}")
    return 1 if any(r.status == "fail" for r in results) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.models", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    add_parsers(sub)
    args = parser.parse_args(["models", *(sys.argv[1:] if argv is None else argv)])
    args.argv = sys.argv[1:] if argv is None else argv
    return int(args.func(args))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
