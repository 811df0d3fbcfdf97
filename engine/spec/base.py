"""The drafter plugin protocol and its registry.

A drafter proposes up to `k[b]` tokens for every row `b` of the running batch, in one batched
call, from the row's context (prompt + generated tokens, the last of which is the row's next
input token). The target model then verifies every row's proposal in one forward pass
(engine.runner); `observe` tells the drafter how many of each row's drafts were accepted,
so that it can learn and keep any state of its own (a draft model's KV) in step with the target.

Per-row drafter state (a draft model's KV layouts) lives in an object with `take(keep)` and
`concat(other)`, carried by the running batch (`RunningBatch.spec.drafter_state`), so it moves
with the rows like every other per-row array.

    @register_drafter("mine")
    class MyDrafter:
        name = "mine"
        point_mass = True        # proposals are deterministic: q is one-hot at the draft
        catches_up = False       # no state to bring up to date after plain decoding
        def admit(self, contexts, warm, predictions=()): ...  # state for joining rows
        def propose(self, ctx: ProposeContext) -> Proposal: ...
        def observe(self, ctx: ProposeContext, proposal, num_accepted): ...
        def stats(self) -> dict[str, float]: ...       # its own figures (SpecStats.drafter)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx
import numpy as np

from engine.sampling import SamplerState


@dataclass(slots=True)
class ProposeContext:
    """What a drafter sees for one speculative step (B rows)."""

    contexts: list[list[int]]  # per row: prompt + generated; the last id is the next input
    num_drafts: np.ndarray  # [B] int: the most drafts each row may take (0 = none)
    next_tokens: mx.array  # [B] int32, == contexts[b][-1]
    sampler: SamplerState  # the target's sampler state before this step
    state: Any  # the drafter's per-row state for these rows (None if it keeps none)
    # [max_drafts] or None: entry k (k >= 1) is the least that draft k + 1 may add in expected
    # accepted tokens summed over the rows for the round to verify it (a drafter that can
    # estimate its drafts' chances may stop there; None: draft to `num_drafts`)
    min_gain: np.ndarray | None = None

    @property
    def max_drafts(self) -> int:
        return int(self.num_drafts.max(initial=0))


@dataclass(slots=True)
class Proposal:
    """Drafts for B rows; columns past `num_drafts[b]` are padding and never accepted."""

    tokens: mx.array  # [B, K] int32 (K = ctx.max_drafts)
    num_drafts: np.ndarray  # [B] int, <= ctx.num_drafts
    # [B, K, V] processed draft log-weights (engine.sampling.process_logits), the distribution
    # q each draft was drawn from; None for point-mass proposals (q one-hot at the draft)
    draft_logits: mx.array | None = None
    # the sampler state after recording drafts[:, :j], for j = 0..K-1 (reused by verification)
    column_states: list[SamplerState] | None = None
    drafter_info: Any = None  # private to the drafter, handed back to observe()
    # `tokens` on the host ([B, K] int), when the drafter has them there (n-gram): the verify
    # input and a greedy verdict are then built without reading the device
    host_tokens: np.ndarray | None = None
    # [B] bool, or None: the row's drafts were copied from its request's predicted output
    # (their accepted tokens are counted for the request's usage)
    predicted: np.ndarray | None = None


class DrafterState(Protocol):
    def take(self, keep: Sequence[int]) -> None: ...

    def concat(self, other: DrafterState) -> None: ...


class Drafter(Protocol):
    name: str
    point_mass: bool  # True: q is one-hot (accept iff the target's own draw equals the draft)
    # True: rows decoded plainly must be caught up before the next proposal (a draft model's
    # KV), so trying speculation again after plain stretches is dear
    catches_up: bool

    def admit(self, contexts: Sequence[Sequence[int]], warm: bool,
              predictions: Sequence[Sequence[int] | None] = ()) -> Any:
        """Per-row state for rows joining the batch (None if the drafter keeps none).

        `contexts` are the rows' prompts; `warm=False` means speculation is currently off, so a
        drafter may defer expensive work (e.g. a draft prefill) until it is first asked.
        `predictions`: per row, its request's predicted output or None (empty: none has one),
        for a drafter that can copy drafts from them; others ignore it.
        """
        ...

    def propose(self, ctx: ProposeContext) -> Proposal: ...

    def observe(self, ctx: ProposeContext, proposal: Proposal, num_accepted: np.ndarray) -> None:
        """`num_accepted[b]` of row b's drafts were accepted (the target's token follows them)."""
        ...

    def stats(self) -> dict[str, Any]: ...


_REGISTRY: dict[str, Callable[..., Drafter]] = {}


def register_drafter(name: str) -> Callable[[Callable[..., Drafter]], Callable[..., Drafter]]:
    def deco(factory: Callable[..., Drafter]) -> Callable[..., Drafter]:
        _REGISTRY[name] = factory
        return factory

    return deco


def make_drafter(name: str, **kwargs: Any) -> Drafter:
    if name not in _REGISTRY:
        raise ValueError(f"unknown drafter {name!r}; registered: {sorted(_REGISTRY)}")
    return _REGISTRY[name](**kwargs)


def registered_drafters() -> list[str]:
    return sorted(_REGISTRY)
