"""Constrained decoding: plain-data specs → per-row grammar matchers → a batched token mask.

A request asks for structure with `SamplingParams.constraint`, a plain dict (so the server never
touches the grammar engine)::

    {"type": "json_schema", "schema": {...}}          # strict: unsupported keywords are errors
    {"type": "json_object"}                           # any JSON object
    {"type": "regex", "pattern": "[0-9]{3}-[0-9]{4}"}
    {"type": "lark", "grammar": "start: ..."}         # llguidance's Lark dialect
    {"type": "tool_calls", "tools": [{"name": ..., "parameters": {...}}, ...],
     "format": {"call_open": "<tool_call>\\n", "call_close": "\\n</tool_call>", ...},
     "parallel": true, "max_calls": 4}                # one to max_calls (at most 32) calls

`compile_constraint(spec, tokenizer, vocab_size, eos_ids)` returns a `Constraint` (one per row;
it raises `ConstraintError` with a short reason a person can act on, also for the grammar engine's
resource limits, which it meets by running the grammar's first step). Each decode step the runner asks
`fill_masks` for the allowed-token bitmask of every constrained row at once ([B, ceil(V/32)]
int32, bit set = allowed; free rows all ones) and `allowed_from_bitmask` unpacks it into a [B, V]
bool array with one MLX op chain (a verify step asks `fill_draft_masks` for each row's mask at
its current state and after each of its drafts). After the draw the scheduler calls
`consume(token)`; when `is_done()` the grammar is complete (or, for tool calls, a call
repeated an earlier one) and the row finishes with "stop".

The grammar engine is llguidance (see bench/grammar_engines.py for the measurements that chose it).
"""

from __future__ import annotations

from engine.constrain.base import Constraint, ConstraintError, allowed_from_bitmask, new_bitmask
from engine.constrain.llg import compile_constraint, fill_draft_masks, fill_masks

__all__ = [
    "Constraint",
    "ConstraintError",
    "allowed_from_bitmask",
    "compile_constraint",
    "fill_draft_masks",
    "fill_masks",
    "new_bitmask",
]
