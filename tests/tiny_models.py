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


def drive(eng: Engine, reqs: list[Request]) -> list[Collected]:
    """Queue `reqs` together, then run the engine's steps on this thread until all finish
    (no engine thread: they are admitted in the same steps)."""
    outs = [submit(eng, r) for r in reqs]
    while not all(o.done.is_set() for o in outs):
        eng.turn()
    return outs


def greedy(req_id: str, prompt: list[int], max_tokens: int, **kw: Any) -> Request:
    return Request(req_id, list(prompt), SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw))


def run_alone(eng: Engine, req: Request, timeout: float = 120) -> Collected:
    c = submit(eng, req)
    assert c.done.wait(timeout), f"{req.req_id} did not finish"
    return c


def on_gpu() -> bool:
    """True when MLX's default device is a CUDA or Metal GPU."""
    from kernels.common import gpu_backend

    return gpu_backend() is not None


def greedy_deviations(model: Any, prompt: list[int], tokens: list[int]) -> tuple[int, float]:
    """Teacher-forced check of a greedy output: one forward of the model over prompt + tokens
    with mlx-lm's own caches. Returns how many emitted tokens are not the argmax of the logits
    at their position, and the largest gap max(logits) - logits[token] among them."""
    from mlx_lm.models.cache import make_prompt_cache

    if not tokens:
        return 0, 0.0
    seq = mx.array([list(prompt) + list(tokens[:-1])])
    logits = model(seq, cache=make_prompt_cache(model))[0, len(prompt) - 1 :].astype(mx.float32)
    picked = mx.take_along_axis(logits, mx.array(tokens)[:, None], axis=-1)[:, 0]
    gaps = (logits.max(axis=-1) - picked).tolist()
    off = [g for g in gaps if g > 0]
    return len(off), max(off, default=0.0)


def assert_same_greedy(
    lm: LoadedModel, req: Request, got: list[int], want: list[int], label: Any = None
) -> None:
    """The exact tier's comparison of a speculative (or batched) greedy output with plain decoding.

    On the CPU the two must be equal token for token. On a GPU a forward of 2+ columns or rows
    runs other kernels than a one-row step (MLX-CUDA: cuBLASLt instead of its gemv, another
    attention kernel), whose rounding differs, so where two logits are tied to within that
    rounding the greedy paths may part. There both outputs must instead be the model's greedy
    choice at every position of a teacher-forced forward, up to near-ties (a gap of at most
    1e-2 in float32, 0.3 in 16-bit), and such ties must be rare: a bug in the KV rollback
    feeds the model a wrong context and shows up as a large gap."""
    label = label if label is not None else req.req_id
    if got == want:
        return
    first = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
    assert on_gpu(), (label, "outputs part at token", first)
    assert len(got) == len(want), (label, len(got), len(want))
    from mlx.utils import tree_flatten

    dtype = tree_flatten(lm.model.parameters())[0][1].dtype
    tol = 1e-2 if dtype == mx.float32 else 0.3
    for name, toks in (("speculative", got), ("plain", want)):
        n_off, gap = greedy_deviations(lm.model, req.prompt_ids, toks)
        assert gap <= tol and n_off <= max(2, len(toks) // 20), (label, name, first, n_off, gap, len(toks))
