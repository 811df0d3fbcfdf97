"""Tiny random-config mlx-lm models (float32) and an engine harness for tests."""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

from engine.api import Request, SamplingParams, TokenEvent
from engine.core import Engine, EngineConfig
from engine.loader import LoadedModel
from engine.scheduler import SchedulerConfig

VOCAB = 512

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(
        model_type="llama", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
        vocab_size=VOCAB, max_position_embeddings=2048, tie_word_embeddings=True,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        sliding_window=24,
    ),
    "gemma3_text": dict(
        model_type="gemma3_text", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=VOCAB,
        sliding_window=24, sliding_window_pattern=2, max_position_embeddings=2048,
        query_pre_attn_scalar=16,
    ),
    "qwen3": dict(
        model_type="qwen3", hidden_size=64, num_hidden_layers=3, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
        vocab_size=VOCAB, max_position_embeddings=2048, tie_word_embeddings=False,
        rope_theta=10000.0,
    ),
}


def tiny_model(arch: str, seed: int = 0, **overrides: Any):
    cfg = dict(TINY_CONFIGS[arch], **overrides)
    module = importlib.import_module(f"mlx_lm.models.{cfg['model_type']}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(cfg))
    # Larger weights than the default init so greedy paths are varied, not one repeated token.
    from mlx.utils import tree_flatten, tree_unflatten

    params = [(k, mx.random.normal(v.shape) * 0.3 if v.ndim > 1 else v) for k, v in tree_flatten(model.parameters())]
    model.update(tree_unflatten(params))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model, cfg


def loaded(model: Any, cfg: dict[str, Any], tokenizer: Any = None, eos: tuple[int, ...] = ()) -> LoadedModel:
    return LoadedModel(
        model=model, tokenizer=tokenizer, config=cfg, path=Path("."), model_id=cfg["model_type"],
        eos_token_ids=eos, context_length=cfg.get("max_position_embeddings", 2048),
        chat_template=None, dtype="float32", vocab_size=cfg["vocab_size"],
    )


@dataclass
class Collected:
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None
    events: list[TokenEvent] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)


def make_engine(lm: LoadedModel, **sched: Any) -> Engine:
    eng = Engine(lm, EngineConfig(SchedulerConfig(**sched)))
    eng.start()
    return eng


def submit(eng: Engine, req: Request) -> Collected:
    out = Collected()

    def sink(events: list[TokenEvent]) -> None:
        for ev in events:
            out.events.append(ev)
            out.tokens.extend(ev.token_ids)
            if ev.finish_reason is not None:
                out.finish = ev.finish_reason
                out.done.set()

    eng.add(req, sink)
    return out


def greedy(req_id: str, prompt: list[int], max_tokens: int, **kw: Any) -> Request:
    return Request(req_id, list(prompt), SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw))


def run_alone(eng: Engine, req: Request, timeout: float = 120) -> Collected:
    c = submit(eng, req)
    assert c.done.wait(timeout), f"{req.req_id} did not finish"
    return c
