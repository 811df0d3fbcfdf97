"""Architecture registry: which batched KV layout each layer of each model gets."""

from engine.models.registry import (
    ARCHITECTURES,
    UNSUPPORTED,
    ArchSpec,
    UnsupportedArchitecture,
    arch_name,
    check_supported,
    layer_templates,
    make_batch_layouts,
    prepare_model,
    spec_for,
    speculation_blocker,
)

__all__ = [
    "ARCHITECTURES",
    "UNSUPPORTED",
    "ArchSpec",
    "UnsupportedArchitecture",
    "arch_name",
    "check_supported",
    "layer_templates",
    "make_batch_layouts",
    "prepare_model",
    "spec_for",
    "speculation_blocker",
]
