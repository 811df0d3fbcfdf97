"""Per-row state of the running (decoding) batch, kept in one place with one take/concat.

Python-side bookkeeping (`RowMeta`: ids, counters, limits, adapter) and device-side arrays (next
input token, sampler state, KV caches, per-row adapter index) always move together through `RunningBatch.take` and
`RunningBatch.concat`, so rows never drift apart.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from engine.api import Request, TokenEvent
from engine.kv import batch as kvb
from engine.sampling import SamplerState

EventSink = Callable[[list[TokenEvent]], None]


@dataclass(slots=True)
class RowMeta:
    request: Request
    num_prompt_tokens: int
    max_new_tokens: int  # already capped by the context length
    stop_ids: frozenset[int]
    num_generated: int = 0
    num_cached_tokens: int = 0
    finished: bool = False  # set once its last event is out (in-flight results are then ignored)
    constraint: Any = None  # engine.constrain.Constraint: the row's grammar state, if any
    # the bitmask its grammar gave at the last state the runner masked it at (after that many
    # generated tokens), and whether the state before gave the same (engine.runner keeps a
    # batch whose grammar rows are all steady on its pipelined path)
    grammar_mask: Any = None
    grammar_mask_at: int = -1
    grammar_steady: bool = False
    output_ids: list[int] = field(default_factory=list)  # tokens emitted so far (drafters read)
    adapter: int = 0  # the row's LoRA adapter (engine.lora index; 0 = none)
    prefix_boundary: int = 0  # the last block boundary the prefix cache captured while decoding
    prefix_node: Any = None  # weakref to the deepest prefix-cache node this row's inserts reached
    queued_at: float = 0.0  # perf_counter when the engine admitted it
    started_at: float = 0.0  # perf_counter when its prefill group formed
    accepted_prediction: int = 0  # drafts copied from its predicted output that were accepted

    @property
    def req_id(self) -> str:
        return self.request.req_id


@dataclass(slots=True)
class RunningBatch:
    rows: list[RowMeta] = field(default_factory=list)
    # [B] int32: each row's next input token (a prefill group's: set by its last chunk)
    next_tokens: mx.array | None = None
    sampler: SamplerState | None = None
    caches: list[Any] | None = None  # per-layer KV layouts (engine.kv)
    spec: Any = None  # engine.spec.SpecRows: per-row speculation state (None: speculation off)
    # [B] uint32: each row's adapter index (engine.lora); None while no row has an adapter
    adapters: mx.array | None = None

    def __post_init__(self) -> None:
        if self.adapters is None:
            self.adapters = _adapter_rows(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def index_of(self, req_id: str) -> int | None:
        for i, row in enumerate(self.rows):
            if row.req_id == req_id:
                return i
        return None

    def take(self, keep: list[int]) -> None:
        """Keep these rows (in this order); the rest are dropped and their KV freed."""
        if len(keep) == len(self.rows):
            return
        if not keep:
            self.rows, self.next_tokens, self.sampler, self.caches = [], None, None, None
            self.spec = self.adapters = None
            return
        idx = mx.array(keep, dtype=mx.int32)
        self.rows = [self.rows[i] for i in keep]
        assert self.sampler is not None and self.caches
        if self.next_tokens is not None:  # None: a prefill group before its first tokens
            self.next_tokens = self.next_tokens[idx]
        self.sampler = self.sampler.take(idx)
        has = any(r.adapter for r in self.rows)
        self.adapters = self.adapters[idx] if has and self.adapters is not None else None
        kvb.filter_rows(self.caches, keep)
        if self.spec is not None:
            self.spec.take(keep)

    def concat(self, other: RunningBatch) -> None:
        """Append `other`'s rows (their caches are extended in with aligned padding)."""
        if not other.rows:
            return
        if not self.rows:
            self.rows, self.next_tokens = other.rows, other.next_tokens
            self.sampler, self.caches = other.sampler, other.caches
            self.spec, self.adapters = other.spec, other.adapters
            return
        assert self.next_tokens is not None and other.next_tokens is not None
        assert self.sampler is not None and other.sampler is not None and other.caches
        if self.adapters is not None or other.adapters is not None:
            self.adapters = mx.concatenate([_or_zeros(self.adapters, len(self.rows)),
                                            _or_zeros(other.adapters, len(other.rows))])
        self.rows = self.rows + other.rows
        self.next_tokens = mx.concatenate([self.next_tokens, other.next_tokens])
        self.sampler = SamplerState.concat([self.sampler, other.sampler])
        self.caches = kvb.extend(self.caches, other.caches)
        if self.spec is not None and other.spec is not None:
            self.spec.concat(other.spec)

    def constrained_rows(self) -> list[tuple[Any, int]]:
        """(constraint, row index) for every row decoding under a grammar."""
        return [(r.constraint, i) for i, r in enumerate(self.rows) if r.constraint is not None]

    def arrays(self) -> list[Any]:
        out: list[Any] = [self.next_tokens]
        if self.caches:
            out.extend(kvb.state_arrays(self.caches))
        return out


def compact_order(num_rows: int, drop: set[int]) -> list[int]:
    """The rows of a batch of `num_rows` that stay when `drop` leave, in the order that moves
    the fewest: rows keep their slots, and each dropped slot below the new length takes a
    staying row from past it (the KV layouts then copy only those rows, `KVLayout.filter`)."""
    size = num_rows - len(drop)
    tail = iter([i for i in range(size, num_rows) if i not in drop])
    return [next(tail) if i in drop else i for i in range(size)]


def _adapter_rows(rows: list[RowMeta]) -> mx.array | None:
    """The rows' adapter indices as a device array, or None when no row has an adapter."""
    if not any(r.adapter for r in rows):
        return None
    return mx.array([r.adapter for r in rows], dtype=mx.uint32)


def _or_zeros(adapters: mx.array | None, num_rows: int) -> mx.array:
    return adapters if adapters is not None else mx.zeros((num_rows,), dtype=mx.uint32)
