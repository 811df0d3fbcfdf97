"""Speculative decoding inside continuous batching (docs/speculative.md).

    config = SpecConfig(method="ngram", num_draft_tokens=4)       # or method="draft", draft_model=
    spec = build_speculation(config, target_model, vocab_size)    # NoSpec when method == "none"

Drafters register by name (engine.spec.base.register_drafter): "draft" (a small model with the
same tokenizer, engine.spec.draft_model), "ngram" (prompt lookup, engine.spec.ngram) and
"prediction" (only the requests' predicted outputs: the server's default, which costs nothing
while no request brings one, and which an architecture that cannot roll back simply goes
without).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from engine.api import MAX_DRAFT_TOKENS
from engine.spec import draft_model as _draft_model  # noqa: F401  (registers "draft")
from engine.spec import ngram as _ngram  # noqa: F401  (registers "ngram")
from engine.spec.adaptive import Acceptance, Controller, ControllerConfig, StepCosts
from engine.spec.base import (
    Drafter,
    Proposal,
    ProposeContext,
    make_drafter,
    register_drafter,
    registered_drafters,
)
from engine.spec.decoder import NoSpec, Round, SpecRows, Speculation

METHODS = ("none", "prediction", "draft", "ngram")
# the ceiling of the draft length when none is given: a draft model's greedy rounds stop where
# their drafts stop paying (adaptive.py, rule 6), so a deep ceiling costs nothing when they are
# unsure. N-gram offers are unpriced and its probes go to the ceiling: 16 gained at one to four
# streams on the CPU twin but lost at sixteen (0.93x: a width-17 probe of 16 rows cost 6.2 plain
# steps; docs/benchmarks.md), so 4
CEILINGS = {"draft": 16, "ngram": 4}
DEFAULT_CEILING = 4


@dataclass(slots=True)
class SpecConfig:
    method: str = "none"  # none | prediction | draft | ngram (or any registered drafter)
    draft_model: Any = None  # path of the draft model (method "draft"), or a loaded one
    num_draft_tokens: int | None = None  # the ceiling of the draft length (None: CEILINGS)
    adaptive: bool = True  # False: always draft the ceiling (tests)
    ngram_max: int = 4
    ngram_min: int = 2
    draft_dtype: str = "auto"
    # one speculative round per verify width at engine start (MLX-CUDA's per-engine setup paid
    # at load): None = when the default device is a GPU and the method is not "prediction"
    # (which most servers never use: its first round builds them); True / False force it
    warmup: bool | None = None

    def __post_init__(self) -> None:
        if self.method == "none" and self.draft_model:
            self.method = "draft"  # --draft-model alone turns the draft model on
        if self.method == "draft" and not self.draft_model:
            raise ValueError("--spec draft needs --draft-model PATH")
        if self.num_draft_tokens is not None and not 1 <= self.num_draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"--num-draft-tokens must be from 1 to {MAX_DRAFT_TOKENS}")

    @property
    def ceiling(self) -> int:
        """The ceiling of the draft length: `num_draft_tokens`, else the method's default."""
        return self.num_draft_tokens or CEILINGS.get(self.method, DEFAULT_CEILING)

    @property
    def enabled(self) -> bool:
        return self.method != "none"


def build_speculation(
    config: SpecConfig | None, target_model: Any, vocab_size: int, draft: Any = None
) -> Speculation | NoSpec:
    """The engine's speculation (`NoSpec` when off); `draft` is a loaded draft model
    (engine.loader)."""
    if config is None or not config.enabled:
        return NoSpec()
    kwargs: dict[str, Any] = dict(max_draft=config.ceiling, vocab_size=vocab_size)
    if config.method == "draft":
        draft = draft if draft is not None else config.draft_model
        if isinstance(draft, str | os.PathLike):
            from engine.loader import load_model

            draft = load_model(str(draft), dtype=config.draft_dtype)
        from engine.loader import LoadedModel

        model = draft.model if isinstance(draft, LoadedModel) else draft
        draft_vocab = draft.vocab_size if isinstance(draft, LoadedModel) else vocab_size
        if abs(draft_vocab - vocab_size) > 128:
            raise ValueError(
                f"the draft model's vocabulary ({draft_vocab}) is not the target's ({vocab_size})"
            )
        kwargs["model"] = model
    elif config.method in ("ngram", "prediction"):
        kwargs.update(max_ngram=config.ngram_max, min_ngram=config.ngram_min)
    drafter = make_drafter(config.method, **kwargs)
    ctl = ControllerConfig(max_draft=config.ceiling, adaptive=config.adaptive)
    return Speculation(target_model, drafter, ctl, optional=config.method == "prediction")


__all__ = [
    "Acceptance",
    "CEILINGS",
    "DEFAULT_CEILING",
    "METHODS",
    "Controller",
    "ControllerConfig",
    "Drafter",
    "Proposal",
    "ProposeContext",
    "NoSpec",
    "Round",
    "SpecConfig",
    "SpecRows",
    "Speculation",
    "StepCosts",
    "build_speculation",
    "make_drafter",
    "register_drafter",
    "registered_drafters",
]
