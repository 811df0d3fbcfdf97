"""Fine-tuning inside a block while it is being quantized (QuIP#/QTIP's first fine-tuning stage).

QuIP# (arXiv 2402.04396, section 5) and QTIP (arXiv 2406.11235, which reuses that recipe) tune in
two stages: while quantizing a transformer block, after each linear is quantized, the block's
remaining unquantized weights (and the quantized ones' continuous parameters) are tuned to
reproduce the original block's output; then the whole model is tuned end to end. This module is
the first stage, written for ``sequential.quantize_sequential``:

- The *target* of block i (``BlockTune.target == "own"``, the default) is the float block's own
  output on the block's captured inputs (the outputs of the already-quantized blocks < i), taken
  before any layer of block i is quantized. So each block only repairs its own error; the
  end-to-end stage (``finetune.py``) comes after.
- With ``target="float"`` it is the float model's hidden state after block i instead, while the
  block's inputs stay the captured ones: each block also learns to repair the error it inherits
  from the blocks before it. The float hidden states are carried forward block by block
  (``float_targets``: float block i, before any of its weights changes, on the float inputs of
  block i gives the target of block i and the float inputs of block i + 1; it replaces the
  "own" target's run on the captured inputs), so this costs one more set of hidden states, not a
  float model copy.
  It needs the blocks to form a simple chain (``sequential.py`` checks that).
- After each group of Linears is quantized (q/k/v, o, gate/up, down), Adam runs ``steps`` steps
  on the relative squared error ||block(x) - target||^2 / ||target||^2, one captured call (a
  batch of calibration windows) a step. Trained: every not-yet-quantized target Linear of the
  block (as W0 + rms_row(W0) * D, so one learning rate fits weights of any scale), the row gain
  and real-valued signs of every already-quantized one (``TunedTrellisLinear``), and the block's
  norm weights. The trained values are folded back after each stage, so the next group's Hessian
  and encoding see the tuned weights.

Nothing new is stored: gains fold into the float16 row scales and the signs become float16, as
after end-to-end fine-tuning (the format of ``finetune.py``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_unflatten

from .finetune import TunedTrellisLinear
from .linear import TrellisLinear

TARGETS = ("own", "float", "auto")


@dataclass(frozen=True, slots=True)
class BlockTune:
    """Settings of the in-block tuning: Adam ``steps`` after each quantized group, at ``lr``."""

    steps: int = 16
    lr: float = 1e-3
    train_signs: bool = True
    # "own": the float block's output on its captured (quantized-prefix) inputs; "float": the float
    # model's hidden state after the block (see the module doc); "auto": "float" where the blocks
    # form a simple chain, else "own" (sequential.py falls back, with a warning, where "float"
    # raises)
    target: str = "own"
    # also tune after the block's last group, when only gains, signs and norms are left (measured
    # on tinycoder at L = 8: down_proj's stage lowered the block error by < 1 %; the end-to-end
    # stage trains the same values)
    tune_last: bool = False

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise ValueError(f"BlockTune.target must be one of {TARGETS}, not {self.target!r}")


@dataclass(slots=True)
class BlockTuneLog:
    """Per stage (block, group): relative output error before and after tuning, seconds."""

    stages: list[dict] = field(default_factory=list)


class DeltaLinear(nn.Module):
    """A float Linear under tuning: W = W0 + rms_row(W0) * D, D trained from zero."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w0 = linear.weight.astype(mx.float32)
        self.w0 = w0
        self.rms = mx.sqrt(mx.mean(mx.square(w0), axis=1, keepdims=True)) + 1e-12
        self.delta = mx.zeros_like(w0)
        if "bias" in linear:
            self.bias = linear.bias
        self.freeze(keys=["w0", "rms"] + (["bias"] if "bias" in linear else []), recurse=False)
        object.__setattr__(self, "linear", linear)

    def weight(self) -> mx.array:
        return self.w0 + self.rms * self.delta

    def __call__(self, x: mx.array) -> mx.array:
        y = x.astype(mx.float32) @ self.weight().T
        if "bias" in self:
            y = y + self.bias
        return y.astype(x.dtype)

    def folded(self) -> nn.Linear:
        """The original Linear object, its weight replaced by the tuned one (same dtype)."""
        self.linear.weight = self.weight().astype(self.linear.weight.dtype)
        return self.linear


def block_output(out: object) -> mx.array:
    """A block's hidden-state output (the first element if the block returns a tuple)."""
    return out[0] if isinstance(out, (tuple, list)) else out  # type: ignore[return-value]


def block_targets(block: nn.Module, calls: list) -> list[mx.array]:
    """The block's outputs on its captured calls (before any of its layers is quantized)."""
    outs = []
    for args, kwargs in calls:
        outs.append(mx.stop_gradient(block_output(block(*args, **kwargs))))
        mx.eval(outs[-1])
    return outs


def float_targets(block: nn.Module, calls: list, hidden: list[mx.array], name: str = "block") -> list[mx.array]:
    """The float model's hidden states after ``block``, given those before it (``target="float"``).

    ``block`` must still be float. Each captured call runs with ``hidden[j]`` in place of its first
    positional argument (the hidden state; the other arguments, masks and positions, are the
    captured ones). ``hidden[j]`` is replaced by the output in place, so the float hidden states
    take one set of arrays; returns ``hidden``.
    """
    if len(hidden) != len(calls):
        raise RuntimeError(f"{name}: {len(calls)} captured calls, {len(hidden)} float hidden states (is the block called more than once a forward?)")
    for j, (args, kwargs) in enumerate(calls):
        if not args or not isinstance(args[0], mx.array) or args[0].shape != hidden[j].shape:
            raise RuntimeError(f"{name}: target='float' needs the hidden state as the block's first positional argument")
        out = block(hidden[j], *args[1:], **kwargs)
        if not isinstance(out, mx.array) or out.shape != hidden[j].shape:
            raise RuntimeError(f"{name}: target='float' needs a block that returns one hidden state of its input's shape")
        hidden[j] = mx.stop_gradient(out)
        mx.eval(hidden[j])
    return hidden


def _rel_err(block: nn.Module, calls: list, targets: list[mx.array]) -> float:
    num = den = 0.0
    for (args, kwargs), t in zip(calls, targets, strict=True):
        y = block_output(block(*args, **kwargs))
        num += float(mx.sum(mx.square(y - t)))
        den += float(mx.sum(mx.square(t)))
    return num / max(den, 1e-30)


def tune_block(
    block: nn.Module,
    block_path: str,
    float_paths: Sequence[str],
    quantized_paths: Sequence[str],
    calls: list,
    targets: list[mx.array],
    cfg: BlockTune,
    seed: int = 0,
) -> dict:
    """Tune ``block`` (the module at ``block_path``) in place towards ``targets``; see module doc.

    float_paths / quantized_paths: full model paths of the block's not-yet-quantized target
    Linears and of its TrellisLinears. Returns {"err_before", "err_after", "seconds", "trainable"}
    (the relative output error on the first captured call, before and after tuning).
    """
    t0 = time.perf_counter()
    pre = block_path + "."
    modules = dict(block.named_modules())
    wrapped: list[tuple[str, nn.Module]] = []
    for p in float_paths:
        wrapped.append((p[len(pre) :], DeltaLinear(modules[p[len(pre) :]])))
    for p in quantized_paths:
        layer = modules[p[len(pre) :]]
        assert isinstance(layer, TrellisLinear), p
        wrapped.append((p[len(pre) :], TunedTrellisLinear(layer, cfg.train_signs)))
    block.update_modules(tree_unflatten(wrapped))
    block.freeze()
    wrapped_ids = {id(m) for _, m in wrapped}
    for _, m in wrapped:
        if isinstance(m, DeltaLinear):
            m.unfreeze(keys=["delta"], recurse=False)
        else:
            m.unfreeze(keys=["gain"] + (["signs"] if cfg.train_signs else []), recurse=False)
    for _, m in block.named_modules():  # norm weights: 1-D float parameters outside the Linears
        if id(m) in wrapped_ids or isinstance(m, (nn.Linear, nn.Embedding, TrellisLinear, TunedTrellisLinear)):
            continue
        keys = [k for k, v in m.items() if isinstance(v, mx.array) and v.ndim == 1 and mx.issubdtype(v.dtype, mx.floating)]
        if keys:
            m.unfreeze(keys=keys, recurse=False)
    trainable = sum(v.size for _, v in cast(list[tuple[str, mx.array]], tree_flatten(block.trainable_parameters())))

    def loss_fn(blk: nn.Module, args: tuple, kwargs: dict, target: mx.array) -> mx.array:
        y = block_output(blk(*args, **kwargs)).astype(mx.float32)
        return mx.sum(mx.square(y - target)) / mx.sum(mx.square(target))

    err_before = _rel_err(block, calls[:1], targets[:1])  # one batch: a log, not a criterion
    try:
        if cfg.steps > 0 and trainable > 0:
            opt = optim.Adam(learning_rate=optim.cosine_decay(cfg.lr, cfg.steps))
            step_fn = nn.value_and_grad(block, loss_fn)
            order = cast(list[int], mx.random.permutation(len(calls), key=mx.random.key(seed)).tolist())
            for step in range(cfg.steps):
                i = order[step % len(order)]
                args, kwargs = calls[i]
                loss, grads = step_fn(block, args, kwargs, targets[i])
                opt.update(block, grads)
                mx.eval(loss, block.trainable_parameters(), opt.state)
        err_after = _rel_err(block, calls[:1], targets[:1])
    finally:
        block.update_modules(tree_unflatten([(p, m.folded()) for p, m in wrapped]))
        block.unfreeze()
    return {
        "err_before": err_before,
        "err_after": err_after,
        "seconds": time.perf_counter() - t0,
        "trainable": int(trainable),
    }
