"""Fine-tuning after quantization (QTIP section 5 / QuIP#'s end-to-end step), in plain MLX.

The trellis codes stay fixed. What is trained:

- a gain per output row of every ``TrellisLinear`` (folded into its float16 ``scales``),
- the incoherence sign vector of every ``TrellisLinear``, as real numbers (QuIP# trains its sign
  vectors this way); they are stored as float16 afterwards (``p.signs`` float16 instead of int8:
  8 more bits per input column, +0.02 bits per weight on a 384-wide row),
- the model's norm weights (every 1-D parameter outside the trellis layers, e.g. RMSNorm),
  unless ``train_norms=False``.

Embeddings and any unquantized Linear stay frozen, so the float part of the model is the same one
that the affine baselines keep. The loss is the KL divergence from the float teacher's next-token
distribution (distillation), not cross-entropy on the text, so the tuning recovers the float
model rather than adapting to the calibration text's domain. The teacher is either a float model,
run on each batch (no memory beyond the model: many windows cost nothing to hold), or its
log-probabilities precomputed once per window (``teacher_logprobs``; windows x length x vocab
values, float16 halves them).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_unflatten

from .linear import TrellisLinear, trellis_layers
from .quantizer import TrellisWeight, dequantize_rotated, rotate


class TunedTrellisLinear(nn.Module):
    """A TrellisLinear during fine-tuning: fixed unit-scale codes, trainable row gain and signs."""

    def __init__(self, layer: TrellisLinear, train_signs: bool = True) -> None:
        super().__init__()
        w = layer.trellis_weight()
        ones = mx.ones(w.scales.shape, dtype=mx.float16)
        unit = TrellisWeight(w.packed, ones, w.signs, w.bits, w.L, w.block, w.code)
        self.codes = dequantize_rotated(unit)  # (n_out, n_in) float32 code values, frozen
        self.scales = layer.scales.astype(mx.float32)  # frozen: the quantizer's scales
        self.gain = mx.ones(self.scales.shape, dtype=mx.float32)
        self.signs = layer.signs.astype(mx.float32)
        mx.eval(self.codes, self.scales, self.signs)  # else every step decodes the codes again
        if "bias" in layer:
            self.bias = layer.bias
        frozen = ["codes", "scales"] + ([] if train_signs else ["signs"]) + (["bias"] if "bias" in layer else [])
        self.freeze(keys=frozen, recurse=False)
        object.__setattr__(self, "layer", layer)
        object.__setattr__(self, "train_signs", train_signs)

    def __call__(self, x: mx.array) -> mx.array:
        y = (rotate(x, self.signs) @ self.codes.T) * (self.scales * self.gain)
        if "bias" in self:
            y = y + self.bias
        return y.astype(x.dtype)

    def folded(self) -> TrellisLinear:
        """The TrellisLinear with the trained gains folded into its scales (and trained signs)."""
        layer = self.layer
        layer.scales = (self.scales * self.gain).astype(mx.float16)
        if self.train_signs:
            layer.signs = self.signs.astype(mx.float16)
        return layer


@dataclass
class FinetuneResult:
    steps: int
    loss_first: float  # mean KL over the first 10 % of steps
    loss_last: float  # mean KL over the last 10 % of steps
    seconds: float
    trainable: int
    holdout_kl: list[tuple[int, float]] = field(default_factory=list)  # (step, KL on the held-out windows)


Teacher = nn.Module | mx.array


def _kl(student_logits: mx.array, teacher_logp: mx.array) -> mx.array:
    logq = student_logits - mx.logsumexp(student_logits, axis=-1, keepdims=True)
    teacher_logp = teacher_logp.astype(mx.float32)
    return mx.mean(mx.sum(mx.exp(teacher_logp) * (teacher_logp - logq), axis=-1))


def _logprobs(model: nn.Module, x: mx.array) -> mx.array:
    logits = model(x).astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def teacher_logprobs(teacher: nn.Module, windows: mx.array, batch: int = 4, dtype: mx.Dtype = mx.float32) -> mx.array:
    """The teacher's next-token log-probabilities over ``windows``: (n, length, vocab) of ``dtype``."""
    parts = []
    for lo in range(0, windows.shape[0], batch):
        parts.append(_logprobs(teacher, windows[lo : lo + batch]).astype(dtype))
        mx.eval(parts[-1])
    return mx.concatenate(parts, axis=0)


def teacher_for(
    teacher: nn.Module, windows: mx.array, steps: int, batch: int, budget_bytes: int = 1 << 30
) -> Teacher:
    """What ``finetune`` should get as its teacher: the float16 log-probabilities over ``windows``
    when they fit in ``budget_bytes`` and the steps visit a window more than once on average
    (one teacher forward per window instead of one per visit), else the model itself (run per batch).
    """
    n, length = windows.shape
    vocab = _logprobs(teacher, windows[:1, :1]).shape[-1]
    if n * length * vocab * 2 <= budget_bytes and steps * batch > n:
        return teacher_logprobs(teacher, windows, batch, mx.float16)
    return teacher


def _teacher_batch(teacher: Teacher, windows: mx.array, idx: mx.array | slice) -> mx.array:
    if isinstance(teacher, mx.array):
        return teacher[idx]
    return mx.stop_gradient(_logprobs(teacher, windows[idx]))


def finetune(
    model: nn.Module,
    teacher: nn.Module | mx.array,
    windows: mx.array,
    *,
    steps: int = 200,
    batch: int = 4,
    lr: float = 1e-3,
    train_signs: bool = True,
    train_norms: bool = True,
    seed: int = 0,
    progress: Callable[[int, float], None] | None = None,
    holdout: tuple[mx.array, Teacher] | None = None,
    holdout_every: int = 0,
) -> FinetuneResult:
    """Tune a trellis model in place to match ``teacher`` on token ``windows`` (n, length).

    teacher: the float model (run on each batch), or its log-probabilities over ``windows``
    (``teacher_logprobs``). The model should be float32 (as the calibration forward): the trained
    values are stored in float16 afterwards. Adam with a cosine decay from ``lr``; every trained
    value starts near 1 (gains, signs, norms), so one learning rate fits all. progress(step, loss)
    after each step. holdout: (windows, teacher) kept out of the training windows; their KL is
    measured before the first step, every ``holdout_every`` steps (0: only then) and after the
    last, into ``FinetuneResult.holdout_kl``, to watch for overfitting.
    """
    import time

    t0 = time.perf_counter()
    teacher_lp = teacher
    layers = trellis_layers(model)
    tuned = [(p, TunedTrellisLinear(m, train_signs)) for p, m in layers]
    model.update_modules(tree_unflatten(tuned))
    tuned_ids = {id(t) for _, t in tuned}
    model.freeze()
    for _, t in tuned:
        t.unfreeze(keys=["gain"] + (["signs"] if train_signs else []), recurse=False)
    if train_norms:
        for _, m in model.named_modules():
            if id(m) in tuned_ids or isinstance(m, (nn.Linear, nn.Embedding, TrellisLinear)):
                continue
            keys = [k for k, v in m.items() if isinstance(v, mx.array) and v.ndim == 1 and mx.issubdtype(v.dtype, mx.floating)]
            if keys:
                m.unfreeze(keys=keys, recurse=False)
    trainable = sum(v.size for _, v in cast(list[tuple[str, mx.array]], tree_flatten(model.trainable_parameters())))

    def loss_fn(mdl: nn.Module, x: mx.array, target: mx.array) -> mx.array:
        return _kl(mdl(x).astype(mx.float32), target)

    opt = optim.Adam(learning_rate=optim.cosine_decay(lr, max(1, steps)))
    step_fn = nn.value_and_grad(model, loss_fn)
    rng = mx.random.key(seed)
    n = windows.shape[0]
    losses = []
    held: list[tuple[int, float]] = []
    if holdout is not None:
        held.append((0, model_kl(model, holdout[1], holdout[0], batch)))
    try:
        for step in range(steps):
            rng, sub = mx.random.split(rng)
            idx = mx.random.permutation(n, key=sub)[: min(batch, n)]
            loss, grads = step_fn(model, windows[idx], _teacher_batch(teacher_lp, windows, idx))
            opt.update(model, grads)
            mx.eval(loss, model.trainable_parameters(), opt.state)
            losses.append(float(loss))
            if progress is not None:
                progress(step + 1, losses[-1])
            if holdout is not None and (step + 1 == steps or (holdout_every > 0 and (step + 1) % holdout_every == 0)):
                held.append((step + 1, model_kl(model, holdout[1], holdout[0], batch)))
    finally:
        model.update_modules(tree_unflatten([(p, t.folded()) for p, t in tuned]))
        model.unfreeze()
    k = max(1, math.ceil(len(losses) / 10)) if losses else 1
    return FinetuneResult(
        steps=steps,
        loss_first=sum(losses[:k]) / k if losses else float("nan"),
        loss_last=sum(losses[-k:]) / k if losses else float("nan"),
        seconds=time.perf_counter() - t0,
        trainable=int(trainable),
        holdout_kl=held,
    )


def model_kl(model: nn.Module, teacher: Teacher, windows: mx.array, batch: int = 4) -> float:
    """Mean KL(teacher || model) per token over ``windows``; teacher: a model or its log-probs."""
    total = 0.0
    for lo in range(0, windows.shape[0], batch):
        x = windows[lo : lo + batch]
        target = _teacher_batch(teacher, windows, slice(lo, lo + batch))
        total += float(_kl(model(x).astype(mx.float32), target)) * x.shape[0]
    return total / windows.shape[0]
