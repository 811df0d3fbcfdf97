"""Batched KV layouts (see docs/kv-layouts.md).

Attention layers: `PlainLayout`, `QuantizedLayout`, `RotatingLayout`, `QuantizedRotatingLayout`
(engine.kv.attention). Recurrent layers: `RecurrentLayout` (engine.kv.recurrent). Whole-model
helpers: engine.kv.batch. Which layer gets which layout: engine.models.
"""

from engine.kv.attention import (
    KVLayout,
    PlainLayout,
    QuantizedLayout,
    QuantizedRotatingLayout,
    RotatingLayout,
)
from engine.kv.codec import PlainCodec, QuantizedCodec, make_codec
from engine.kv.recurrent import RecurrentLayout, install_stepping

__all__ = [
    "KVLayout",
    "PlainCodec",
    "PlainLayout",
    "QuantizedCodec",
    "QuantizedLayout",
    "QuantizedRotatingLayout",
    "RecurrentLayout",
    "RotatingLayout",
    "install_stepping",
    "make_codec",
]
