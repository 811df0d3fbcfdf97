"""Memory accounting: what a layout costs per token and what a request will cost.

    fp = measure_footprint(model, kv_bits=8)      # one 1-token probe forward, one-row layouts
    fp.bytes_per_token()                          # marginal bytes per token (unbounded layers)
    fp.row_bytes(num_tokens)                      # one row holding num_tokens tokens
    fp.batch_bytes(num_rows, longest)             # a batch: rows are padded to the longest row
    fp.max_rows(budget_bytes, num_tokens)         # how many such rows fit

Costs per layer kind: full layouts grow with every token; rings stop at `window + slack`
tokens; recurrent layers cost a fixed state per row. Batches allocate columns in steps of
`KVLayout.step` (256) up to the longest row, for every row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from engine.kv.attention import KVLayout
from engine.kv.recurrent import RecurrentLayout


def _round_up(x: int, step: int) -> int:
    return (x + step - 1) // step * step


@dataclass(frozen=True, slots=True)
class LayerFootprint:
    kind: str
    bytes_per_token: int  # 0 for recurrent layers
    max_tokens: int | None  # ring size; None = grows without bound
    bytes_per_row: int  # fixed per-row state (recurrent)

    def tokens_held(self, num_tokens: int) -> int:
        return num_tokens if self.max_tokens is None else min(num_tokens, self.max_tokens)

    def row_bytes(self, num_tokens: int) -> int:
        return self.tokens_held(num_tokens) * self.bytes_per_token + self.bytes_per_row


@dataclass(frozen=True, slots=True)
class ModelFootprint:
    layers: tuple[LayerFootprint, ...]

    def bytes_per_token(self) -> int:
        """Marginal bytes of one more token at long context (rings and states are full)."""
        return sum(f.bytes_per_token for f in self.layers if f.max_tokens is None)

    def bytes_per_token_by_kind(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for f in self.layers:
            out[f.kind] = out.get(f.kind, 0) + f.bytes_per_token
        return out

    def row_bytes(self, num_tokens: int) -> int:
        """Exact bytes of one row holding `num_tokens` tokens (no allocation rounding)."""
        return sum(f.row_bytes(num_tokens) for f in self.layers)

    def batch_bytes(self, num_rows: int, longest: int, step: int = KVLayout.step) -> int:
        """Allocated bytes of a batch whose longest row has `longest` tokens."""
        cols = _round_up(max(longest, 1), step)
        return num_rows * sum(f.row_bytes(cols) for f in self.layers)

    def request_bytes(self, num_prompt_tokens: int, max_new_tokens: int, max_draft: int = 0) -> int:
        """KV bytes a request will need at its longest (prompt + generation + draft columns)."""
        return self.row_bytes(num_prompt_tokens + max_new_tokens + max_draft)

    def max_rows(self, budget_bytes: int, num_tokens: int) -> int:
        per_row = self.row_bytes(num_tokens)
        return budget_bytes // per_row if per_row else 0


def layer_footprint(layout: Any) -> LayerFootprint:
    """Footprint of a layout that has been written at least once."""
    if isinstance(layout, RecurrentLayout):
        per_row = layout.bytes_per_row()
        if per_row is None:
            raise ValueError("recurrent layout has no state yet: run a forward first")
        return LayerFootprint(layout.kind, 0, 0, per_row)
    per_token = layout.bytes_per_token()
    if per_token is None:
        raise ValueError("KV layout has no buffers yet: run a forward first")
    return LayerFootprint(layout.kind, per_token, layout.ring_size, 0)


def measure_footprint(model: Any, **layout_kwargs: Any) -> ModelFootprint:
    """Probe the model once (one token, one row) and read each layer's cost off its buffers."""
    from engine.models import make_batch_layouts

    layouts = make_batch_layouts(model, 1, **layout_kwargs)
    out = model(mx.array([[0]], dtype=mx.int32), cache=layouts)
    mx.eval(out, [lay.state for lay in layouts])
    return ModelFootprint(tuple(layer_footprint(lay) for lay in layouts))
