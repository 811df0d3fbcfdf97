"""Architecture registry: which batched KV layout each layer of each model gets."""

from engine.models.registry import (
    ARCHITECTURES,
    ArchSpec,
    arch_name,
    layer_templates,
    make_batch_layouts,
    prepare_model,
    spec_for,
)

__all__ = [
    "ARCHITECTURES",
    "ArchSpec",
    "arch_name",
    "layer_templates",
    "make_batch_layouts",
    "prepare_model",
    "spec_for",
]
