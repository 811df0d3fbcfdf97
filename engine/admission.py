"""Memory admission: weights + KV + prefill transient against a budget.

A row reserves the KV it will need at its longest (prompt + max_new_tokens + draft columns,
from `engine.kv.memory`) when it is admitted; rows are admitted while the reservations of all
admitted rows fit. A request that could not fit even alone is refused at once (413); one that
fits alone but not now waits in the queue.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import mlx.core as mx
from mlx.utils import tree_flatten

from engine.kv.memory import ModelFootprint, measure_footprint


def device_memory_bytes() -> int:
    try:
        info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
        size = int(info.get("memory_size", 0))
        if size:
            return size
    except Exception:  # CPU builds have no device info
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def parse_bytes(text: str | int | None) -> int | None:
    """'1GiB', '512MiB', '2e9', 1000 → bytes; None stays None."""
    if text is None or isinstance(text, int):
        return text
    s = text.strip().lower().replace(" ", "")
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
             "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "k": 1 << 10, "m": 1 << 20,
             "g": 1 << 30, "b": 1}
    for unit, mult in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if s.endswith(unit):
            return int(float(s[: -len(unit)]) * mult)
    return int(float(s))


@dataclass(slots=True)
class MemoryBudget:
    budget: int
    weights: int
    footprint: ModelFootprint
    prefill_bytes_per_token: int = 0  # activation transient of a prefill forward

    @classmethod
    def for_model(cls, model, budget: int | None, kv_kwargs: dict, prefill_tokens: int) -> MemoryBudget:
        weights = sum(int(p.nbytes) for _, p in tree_flatten(model.parameters()))
        footprint = measure_footprint(model, **kv_kwargs)
        if budget is None:
            budget = int(device_memory_bytes() * 0.75)
        # hidden states, logits and attention scores of a prefill chunk: a generous estimate
        args = getattr(model, "args", None)
        hidden = int(getattr(args, "hidden_size", 4096) or 4096)
        vocab = int(getattr(args, "vocab_size", 32000) or 32000)
        per_token = 4 * (8 * hidden + vocab)
        return cls(budget, weights, footprint, per_token)

    def row_bytes(self, num_prompt_tokens: int, max_new_tokens: int) -> int:
        return self.footprint.request_bytes(num_prompt_tokens, max_new_tokens)

    def transient(self, prefill_tokens: int) -> int:
        return self.prefill_bytes_per_token * prefill_tokens

    def fits_alone(self, num_prompt_tokens: int, max_new_tokens: int, prefill_tokens: int) -> bool:
        need = self.weights + self.row_bytes(num_prompt_tokens, max_new_tokens)
        return need + self.transient(prefill_tokens) <= self.budget

    def fits(self, reserved: int, extra: int, prefill_tokens: int) -> bool:
        return self.weights + reserved + extra + self.transient(prefill_tokens) <= self.budget
