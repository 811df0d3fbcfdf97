"""Memory accounting: what a layout costs per token and what a request will cost.

    fp = measure_footprint(model, kv_bits=8)      # one 1-token probe forward, one-row layouts
    fp.bytes_per_token()                          # marginal bytes per token (unbounded layers)
    fp.row_bytes(num_tokens)                      # one row holding num_tokens tokens
    fp.batch_bytes(num_rows, longest)             # a batch: rows are padded to the longest row
    fp.max_rows(budget_bytes, num_tokens)         # how many such rows fit
budget = MemoryBudget.for_model(model, None, {})  # weights + KV + prefill transient

Costs per layer kind: full layouts grow with every token; rings stop at `window + slack`
tokens; recurrent layers cost a fixed state per row. Batches allocate columns in steps of
`KVLayout.step` (256) up to the longest row, for every row.

Admission (`MemoryBudget`, the policy in engine.scheduler): weights + the KV every admitted
row will allocate at its longest + the prefix cache + a step's activations stay inside
`budget`. KV is counted as it is allocated: the rows form one batch whose rows are all as wide
as the longest, in steps of 256 columns, so a row reserves `kv_bytes` of the batch it joins, not
its own exact tokens. Worked example (a full layer, 100 bytes per token): rows that will reach
300 and 20 tokens allocate 2 x 512 columns = 102,400 bytes, not 32,000. A request that could not
fit even alone (weights + its KV + its prefill chunk's activations) is refused at once (413);
one that fits alone but not now waits in the queue, or is admitted at once if evicting
prefix-cache blocks makes room.

Activations (`transient`): per token of a forward, the hidden states and MLP (`4 * 8 * hidden`)
and the logits row (`4 * vocab`), plus attention scores over every key of a full-attention
layer (`6 * heads` bytes per query x key), plus, for a forward of 512 tokens or more on CUDA
and 128 on the CPU (16 without its C++ kernel), two dense copies of the largest quantized
weight (kernels/affine/linear.py, `DEQUANTIZE_ROWS`); with quantized KV, attention also reads a
layer's codes through a contiguous copy, and about two layers' worth are alive at a step's peak
(`read_bytes`: 8-bit KV, 8 full layers of 1,024 tokens x 8 rows: 2.7 of 10.5 MB). Measured on tinycoder-16m (float32, 6 heads) with
MLX's peak memory around one prefill forward: a 240-token chunk costs 9.7 MB at 240 keys and
29.1 MB at 3,120 (the estimate: 12.9 and 37.8 MB); four rows x 512 tokens at 3,584 keys, 259 MB
(estimate 357 MB); 8-bit KV about 5 % less.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx
from mlx.utils import tree_flatten

from engine.kv.attention import KVLayout
from engine.kv.recurrent import RecurrentLayout
from kernels.affine import linear as affine_linear


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

    def layer_batch_bytes(self, num_rows: int, longest: int, step: int = KVLayout.step) -> int:
        """Allocated bytes of the costliest layer of such a batch."""
        cols = _round_up(max(longest, 1), step)
        return num_rows * max((f.row_bytes(cols) for f in self.layers), default=0)

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
    """Weights + allocated KV + a step's activations against `budget` bytes (module docstring)."""

    budget: int
    weights: int
    footprint: ModelFootprint
    prefill_bytes_per_token: int = 0  # activations per token of a forward (hidden, MLP, logits)
    score_bytes: int = 0  # attention scores per query token x key of a full-attention layer
    max_draft: int = 0  # columns a speculative verify step writes past a row's last token
    read_copies: int = 0  # layers' KV copied while attention reads them (quantized KV: 2)
    # dense copies of quantized weights alive in a forward of at least `dense_from` tokens (on
    # CUDA and the CPU such products dequantize the weight for a dense matmul: kernels/affine)
    dense_bytes: int = 0
    dense_from: int = 0
    # what other engines sharing `budget` hold (engine.pool: the other models' weights and KV);
    # admission counts it, a request's `fits_alone` does not (it may wait for them, never 413)
    others: int = 0
    # what this engine's side work holds between its turns (engine.score: a prompt being scored
    # keeps its one-row KV from chunk to chunk); admission counts it as it counts `others`
    side: int = 0

    @classmethod
    def for_model(cls, model: Any, budget: int | None, kv_kwargs: dict[str, Any]) -> MemoryBudget:
        """`budget` None: 75 % of the device's memory."""
        params = cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
        weights = sum(int(p.nbytes) for _, p in params)
        footprint = measure_footprint(model, **kv_kwargs)
        if budget is None:
            budget = int(device_memory_bytes() * 0.75)
        args = getattr(model, "args", None)
        hidden = int(getattr(args, "hidden_size", 4096) or 4096)
        vocab = int(getattr(args, "vocab_size", 32000) or 32000)
        heads = int(getattr(args, "num_attention_heads", 32) or 32)
        quantized = int(kv_kwargs.get("kv_bits") or 16) < 16
        return cls(budget, weights, footprint, 4 * (8 * hidden + vocab), 6 * heads,
                   read_copies=2 if quantized else 0,
                   dense_bytes=affine_linear.dequantized_peak_bytes(model),
                   dense_from=affine_linear.dequantize_rows() or 0)

    def row_tokens(self, num_prompt_tokens: int, max_new_tokens: int) -> int:
        """Columns a row may reach: prompt + generation + a verify step's drafts."""
        return num_prompt_tokens + max_new_tokens + self.max_draft

    def kv_bytes(self, row_tokens: Sequence[int]) -> int:
        """Allocated KV of one batch of rows that reach these token counts: every row padded
        to the longest, in steps of `KVLayout.step` columns (rings: at most their size)."""
        if not row_tokens:
            return 0
        return self.footprint.batch_bytes(len(row_tokens), max(row_tokens))

    def row_bytes(self, num_prompt_tokens: int, max_new_tokens: int) -> int:
        """Allocated KV of one request alone, at its longest."""
        return self.kv_bytes([self.row_tokens(num_prompt_tokens, max_new_tokens)])

    def transient(self, tokens: int, context: int = 0) -> int:
        """Activations of a forward over `tokens` query tokens (rows x columns) whose rows
        attend to at most `context` keys."""
        dense = self.dense_bytes if tokens >= self.dense_from else 0
        return tokens * (self.prefill_bytes_per_token + self.score_bytes * context) + dense

    def read_bytes(self, row_tokens: Sequence[int]) -> int:
        """Copies of the KV that attention makes while it reads a batch of such rows (quantized
        KV is read through contiguous copies of a layer's buffers: `read_copies` layers)."""
        if not row_tokens or not self.read_copies:
            return 0
        return self.read_copies * self.footprint.layer_batch_bytes(len(row_tokens), max(row_tokens))

    def alone_bytes(self, num_prompt_tokens: int, max_new_tokens: int, chunk: int) -> int:
        """What a request needs to run alone with the prefix cache emptied: the weights, its
        KV at its longest, and the activations of its costliest step: its last prefill chunk
        (at most `chunk` of its prompt's tokens, attending to the whole prompt)
        and a decode step at its longest."""
        longest = self.row_tokens(num_prompt_tokens, max_new_tokens)
        cols = max(1, min(num_prompt_tokens, chunk))
        steps = self.transient(cols, num_prompt_tokens) + self.transient(1, longest)
        return self.weights + self.kv_bytes([longest]) + self.read_bytes([longest]) + steps

    def fits_alone(self, num_prompt_tokens: int, max_new_tokens: int, chunk: int) -> bool:
        """Whether the request can ever run: `alone_bytes` within the budget."""
        return self.alone_bytes(num_prompt_tokens, max_new_tokens, chunk) <= self.budget
