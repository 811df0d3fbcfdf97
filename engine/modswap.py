"""Swap module classes in place: a subclass that changes only how a module computes (the
few-row matmul dispatch of engine/fewrow.py, the RoPE guard of engine/cuda_guard.py) is installed
this way, so parameters, names and saving stay as they were."""

from __future__ import annotations

from typing import Any


def swap_classes(model: Any, mapping: dict[type, type]) -> int:
    """Give every module of `model` whose exact type is a key of `mapping` the class it maps
    to (subclasses of a key are left alone); returns how many were swapped."""
    count = 0
    for _, module in model.named_modules():
        new = mapping.get(type(module))
        if new is not None:
            module.__class__ = new
            count += 1
    return count
