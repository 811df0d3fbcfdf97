"""The one place where architectures differ: which KV layout each layer gets.

The per-layer shape comes from the model itself (`model.make_cache()`, i.e. mlx-lm's own
choice of KVCache / RotatingKVCache / ArraysCache per layer), mapped onto our batched layouts:

    KVCache                      -> PlainLayout | QuantizedLayout
                                    (RotatingLayout with `keep` sinks when max_kv_size is set)
    RotatingKVCache(size, keep)  -> RotatingLayout(window=size, keep, slack=max_draft)
                                    | QuantizedRotatingLayout
    ArraysCache(n)               -> RecurrentLayout(n)

`ARCHITECTURES` lists what is tested (batched == alone, tests/test_kv_models.py) and what an
architecture cannot do (e.g. quantized KV where the model's attention bypasses mlx-lm's
quantized SDPA). Unlisted architectures get the generic mapping and `tested=False`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlx_lm.models import cache as mlc

from engine.kv.attention import (
    PlainLayout,
    QuantizedLayout,
    QuantizedRotatingLayout,
    RotatingLayout,
)
from engine.kv.recurrent import RecurrentLayout, install_stepping, is_stepping


@dataclass(frozen=True, slots=True)
class ArchSpec:
    name: str  # mlx-lm module name (mlx_lm.models.<name>)
    layers: str  # what the layers hold, for the docs
    can_quantize: bool = True
    why_not_quantized: str = ""
    mixer_attr: str | None = None  # recurrent mixer attribute on a decoder layer
    tested: bool = True


_NO_Q_SINKS = "attention sinks: mlx-lm's quantized SDPA has no sinks"
_NO_Q_MLA = "MLA attends over the raw latent (embed_q/unembed_out), not through quantized SDPA"
_NO_Q_SHARED = "KV-shared layers call attention with cache=None, bypassing the quantized path"

ARCHITECTURES: dict[str, ArchSpec] = {
    s.name: s
    for s in [
        ArchSpec("llama", "full; sliding-window layers where config.layer_types says so"),
        ArchSpec(
            "gemma3_text",
            "sliding window on 5 of every 6 layers (sliding_window_pattern), full on the rest",
        ),
        ArchSpec(
            "gemma4_text",
            "sliding / full per layer_types; the last num_kv_shared_layers read an earlier layer's KV (no cache of their own)",
            can_quantize=False,
            why_not_quantized=_NO_Q_SHARED,
        ),
        ArchSpec(
            "gpt_oss",
            "alternating sliding window (128) and full attention, both with learned attention sinks",
            can_quantize=False,
            why_not_quantized=_NO_Q_SINKS,
        ),
        ArchSpec(
            "qwen3_next",
            "gated-DeltaNet recurrent state (conv + state) on 3 of every 4 layers, full attention on the 4th",
            mixer_attr="linear_attn",
        ),
        ArchSpec(
            "qwen3_5",
            "gated-DeltaNet recurrent state on 3 of every 4 layers, full attention on the 4th",
            mixer_attr="linear_attn",
        ),
        ArchSpec("qwen3_moe", "full attention (MoE MLP)"),
        ArchSpec(
            "deepseek_v3",
            "MLA: one latent 'head' (kv_lora_rank) + a shared RoPE key per token, full attention",
            can_quantize=False,
            why_not_quantized=_NO_Q_MLA,
        ),
    ]
}


class UnsupportedArchitecture(ValueError):
    """The model's architecture cannot be served exactly by our layouts (raised at load)."""


_KV_SHARING = (
    "KV-shared layers read another layer's cache through cache.keys_and_values / cache.state, "
    "which our batched layouts do not provide"
)

_EMPTY_AFTER_FORWARD = (
    "a layer's cache is still empty after a forward, which the engine's memory probe refuses"
)

# architectures whose output through our batched layouts would be wrong or fail mid-request,
# with the reason (measured by `python -m bench models`; docs/models.md says what would fix each)
UNSUPPORTED: dict[str, str] = {
    "afm7": _KV_SHARING,
    "gemma3n": _KV_SHARING,
    "gemma2": "its attention broadcasts the mask against 5-D grouped scores, which fails for a "
    "batch of rows with their own masks",
    "gpt_bigcode": "it computes positions from one scalar cache offset for the whole batch; "
    "batched rows sit at different offsets",
    "mamba": _EMPTY_AFTER_FORWARD,
    "nemotron-nas": _EMPTY_AFTER_FORWARD + " (its no-op attention layers never write KV)",
}

# recurrent mixers made stepping (speculative rollback) on architectures the registry does not
# list: the decoder-layer attribute holding the mixer; installed only on modules called as
# (x, mask, cache)
MIXERS: dict[str, str] = {
    "bailing_moe_v3": "attention",
    "granitemoehybrid": "mamba",
    "kimi_k3": "self_attn",
    "kimi_linear": "self_attn",
    "lfm2": "conv",
    "lfm2-vl": "conv",
    "lfm2_moe": "conv",
    "mamba2": "mixer",
    "nemotron_h": "mixer",
    "olmo_hybrid": "linear_attn",
}


def arch_name(model: Any) -> str:
    return type(model).__module__.rsplit(".", 1)[-1]


def _inner_names(model: Any) -> list[str]:
    """The model's architecture name, then those of the text models it wraps (`language_model`)."""
    names: list[str] = []
    seen = model
    while seen is not None and len(names) < 4:
        names.append(arch_name(seen))
        seen = getattr(seen, "language_model", None)
    return names


def _is_mla(model: Any) -> bool:
    args = getattr(model, "args", None)
    text = getattr(args, "text_config", None)
    for a in (args, text):
        value = a.get("kv_lora_rank") if isinstance(a, dict) else getattr(a, "kv_lora_rank", None)
        if value:
            return True
    return False


def spec_for(model: Any) -> ArchSpec:
    """What the registry knows about `model`'s architecture; UnsupportedArchitecture for one
    that mlxd cannot serve (a clear error at load instead of wrong output). A multimodal
    checkpoint's wrapper (gemma3, qwen3_vl, ...) gets the spec of the text model it wraps."""
    names = _inner_names(model)
    for name in names:
        if name in UNSUPPORTED:
            raise UnsupportedArchitecture(
                f"architecture {names[0]} is not supported: {UNSUPPORTED[name]}"
            )
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    name = names[0]
    if _is_mla(model):
        return ArchSpec(name, "MLA (generic mapping)", can_quantize=False,
                        why_not_quantized=_NO_Q_MLA, mixer_attr=MIXERS.get(name), tested=False)
    return ArchSpec(name, "generic mapping of make_cache()", mixer_attr=MIXERS.get(name),
                    tested=False)


def _model_layers(model: Any) -> list[Any]:
    layers = getattr(model, "layers", None)
    return list(layers) if layers is not None else []


# the mlx-lm caches a layer may ask for that we have a batched layout for
_MAPPED = (mlc.KVCache, mlc.QuantizedKVCache, mlc.RotatingKVCache, mlc.ArraysCache)

_CACHE_WHY = {
    "CacheList": "several caches per layer (e.g. attention KV plus a convolution or indexer "
    "state)",
    "ChunkedKVCache": "chunked local attention (the KV resets at every chunk boundary)",
}


def check_supported(model: Any) -> None:
    """UnsupportedArchitecture unless every layer's cache has a batched layout here."""
    name = arch_name(model)
    spec_for(model)  # the architectures listed as unsupported
    odd = sorted({type(t).__name__ for t in layer_templates(model) if type(t) not in _MAPPED})
    if odd:
        why = "; ".join(_CACHE_WHY.get(t, t) for t in odd)
        raise UnsupportedArchitecture(
            f"architecture {name} is not supported: its layers keep {', '.join(odd)} caches "
            f"({why}), which have no batched KV layout yet"
        )


def prepare_model(model: Any) -> ArchSpec:
    """One-time model setup for our layouts: refuse what they cannot serve exactly
    (UnsupportedArchitecture), make recurrent mixers stepping (for rollback)."""
    check_supported(model)
    spec = spec_for(model)
    if spec.mixer_attr is not None:
        for layer in _model_layers(model):
            mixer = getattr(layer, spec.mixer_attr, None)
            if mixer is not None and _called_as_x_mask_cache(mixer):
                install_stepping(mixer)
    return spec


def speculation_blocker(model: Any) -> str | None:
    """Why speculative decoding cannot run on `model` (after `prepare_model`, which makes the
    mixers it can stepping), or None: a rejected draft rolls recurrent state back to the
    accepted length, which needs every recurrent layer's mixer fed a verified chunk one token
    at a time."""
    recurrent = sum(isinstance(t, mlc.ArraysCache) for t in layer_templates(model))
    if not recurrent:
        return None
    attr = spec_for(model).mixer_attr
    stepping = 0 if attr is None else sum(
        is_stepping(getattr(layer, attr, None)) for layer in _model_layers(model))
    if stepping >= recurrent:
        return None
    return (f"speculative decoding is not supported for architecture {arch_name(model)}: "
            "rolling back a rejected draft needs its recurrent mixers fed one token at a time, "
            "and they take arguments mlxd's stepping wrapper does not forward; serve it "
            "without --spec")


def _called_as_x_mask_cache(module: Any) -> bool:
    import inspect

    params = list(inspect.signature(type(module).__call__).parameters)[1:4]
    return len(params) == 3 and params[1:] == ["mask", "cache"]


def layer_templates(model: Any) -> list[Any]:
    """mlx-lm's own single-sequence cache per layer (what the model file asks for)."""
    if hasattr(model, "make_cache"):
        return model.make_cache()
    return [mlc.KVCache() for _ in _model_layers(model)]


def make_batch_layouts(
    model: Any,
    num_rows: int = 0,
    *,
    kv_bits: int = 16,
    kv_group_size: int = 64,
    max_kv_size: int | None = None,
    max_draft: int = 0,
    sink_tokens: int = 4,
) -> list[Any]:
    """Per-layer batched layouts for `model`, `num_rows` empty rows each.

    kv_bits: 16 = full precision, 8 / 4 = MLX affine quantized (group `kv_group_size`).
    max_kv_size: cap full-attention layers to a ring of that many tokens (`sink_tokens` sinks).
    max_draft: the most draft tokens a speculative round appends (ring slack for rollback).
    """
    check_supported(model)
    spec = spec_for(model)
    quant = kv_bits < 16
    if quant and not spec.can_quantize:
        raise ValueError(f"{spec.name}: quantized KV is not supported ({spec.why_not_quantized})")
    out: list[Any] = []
    for tmpl in layer_templates(model):
        out.append(
            _layout_for(
                tmpl, num_rows, quant, kv_bits, kv_group_size, max_kv_size, max_draft, sink_tokens
            )
        )
    return out


def _layout_for(
    tmpl: Any,
    num_rows: int,
    quant: bool,
    bits: int,
    group: int,
    max_kv_size: int | None,
    max_draft: int,
    sink_tokens: int,
) -> Any:
    if isinstance(tmpl, mlc.RotatingKVCache):
        ring = dict(window=tmpl.max_size, keep=tmpl.keep, slack=max_draft)
        if quant:
            return QuantizedRotatingLayout(num_rows, bits=bits, group_size=group, **ring)
        return RotatingLayout(num_rows, **ring)
    if isinstance(tmpl, mlc.KVCache | mlc.QuantizedKVCache):
        if max_kv_size is not None:
            ring = dict(window=max_kv_size, keep=min(sink_tokens, max_kv_size - 1), slack=max_draft)
            if quant:
                return QuantizedRotatingLayout(num_rows, bits=bits, group_size=group, **ring)
            return RotatingLayout(num_rows, **ring)
        return (
            QuantizedLayout(num_rows, bits=bits, group_size=group)
            if quant
            else PlainLayout(num_rows)
        )
    if isinstance(tmpl, mlc.ArraysCache):
        return RecurrentLayout(num_rows, size=len(tmpl.cache))
    raise NotImplementedError(f"no batched layout for {type(tmpl).__name__} yet")
