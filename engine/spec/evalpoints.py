"""Evaluation points inside a synchronous forward (opt-in, `MLXD_SPEC_EVAL_EVERY=N`).

A plain decode step is pipelined: its graph is built in Python while the device runs the step
before it. A speculative round is not (its input depends on the previous step's tokens, read on
the host), so on a GPU it pays graph building, MLX's encoding and the device's work one after
the other (docs/speculative.md, "Session 7": ~1.3 ms of Python and 2.1 ms of waiting in a
width-9 round on the H200, against a 1.6-1.8 ms plain step). With evaluation points the verify
forward starts the device early: the attention cache of every N-th layer queues
(`mx.async_eval`) the keys it is handed, which launches everything the forward has built up to
that layer, and Python goes on building the later layers while the device runs the earlier ones.

Values do not change (async_eval only starts work that the final eval would run anyway); the
cost is one more launch per point. Only attention layouts (plain, rotating, quantized, and their
`widekv` views) are wrapped: a recurrent layer's cache is indexed, not called.

Measured: on this CPU 0-3 % off a synced width-9 forward of tinycoder-16m (compute-bound); not
yet on a GPU (`python -m bench.step_costs --eval-every ab`).
"""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx

from engine.spec.widekv import LayoutView


def every_from_env() -> int:
    try:
        return max(0, int(os.environ.get("MLXD_SPEC_EVAL_EVERY", "0") or 0))
    except ValueError:
        return 0


def eval_points(caches: list[Any], every: int) -> list[Any]:
    """`caches` with every `every`-th attention cache (layers every-1, 2*every-1, ..., never the
    last layer: its keys are the end of the forward anyway) wrapped in an evaluation point."""
    if every <= 0:
        return caches
    from engine.kv.attention import KVLayout

    out = list(caches)
    for i in range(every - 1, len(out) - 1, every):
        if isinstance(out[i], (KVLayout, LayoutView)):
            out[i] = _EvalPoint(out[i])
    return out


class _EvalPoint(LayoutView):
    """A view whose `update_and_fetch` first queues the keys and values it is handed."""

    __slots__ = ()

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        mx.async_eval(keys, values)
        return self.layout.update_and_fetch(keys, values)
