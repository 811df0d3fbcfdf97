"""How K/V columns are stored: plain arrays or MLX affine-quantized triples.

A codec turns the `(keys, values)` a model hands to `update_and_fetch` into a flat list of
*buffers*, every one shaped `[B, H, S, d_j]` (so that layouts can write, gather, slice and
concatenate them along the column axis without knowing what they hold), and turns the stored
buffers back into what the model expects:

* `PlainCodec`:      buffers `[k, v]`; fetch returns `(k, v)`.
* `QuantizedCodec`:  buffers `[k_q, k_scales, k_biases, v_q, v_scales, v_biases]` from
  `mx.quantize` along the head dim; fetch returns `((k_q, k_s, k_b), (v_q, v_s, v_b))`, the form
  mlx-lm's `quantized_scaled_dot_product_attention` takes (the layout exposes `bits` and
  `group_size`, which is what routes mlx-lm's attention onto that path).

Quantization is per token (groups run along the head dim), so a column's codes never depend on
other columns: a row quantized alone, in a batch, or after a rollback holds identical codes.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True, slots=True)
class PlainCodec:
    name: str = "plain"

    @property
    def num_buffers(self) -> int:
        return 2

    def encode(self, keys: mx.array, values: mx.array) -> list[mx.array]:
        return [keys, values]

    def fetch(self, bufs: list[mx.array]) -> tuple[mx.array, mx.array]:
        return bufs[0], bufs[1]

    def decode(self, bufs: list[mx.array]) -> tuple[mx.array, mx.array]:
        """Full-precision keys and values (for conversion and tests)."""
        return bufs[0], bufs[1]

    def bytes_per_token(self, num_heads: int, k_dim: int, v_dim: int, itemsize: int) -> int:
        return num_heads * (k_dim + v_dim) * itemsize


@dataclass(frozen=True, slots=True)
class QuantizedCodec:
    bits: int = 8
    group_size: int = 64
    name: str = "quantized"

    def __post_init__(self) -> None:
        if self.bits not in (2, 3, 4, 5, 6, 8):
            raise ValueError(f"unsupported KV bits {self.bits}")
        if self.group_size not in (32, 64, 128):
            raise ValueError(f"unsupported KV group size {self.group_size}")

    @property
    def num_buffers(self) -> int:
        return 6

    def encode(self, keys: mx.array, values: mx.array) -> list[mx.array]:
        kq = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        vq = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        return [*kq, *vq]

    def fetch(self, bufs: list[mx.array]) -> tuple[tuple[mx.array, ...], tuple[mx.array, ...]]:
        return (bufs[0], bufs[1], bufs[2]), (bufs[3], bufs[4], bufs[5])

    def decode(self, bufs: list[mx.array]) -> tuple[mx.array, mx.array]:
        k = mx.dequantize(bufs[0], bufs[1], bufs[2], group_size=self.group_size, bits=self.bits)
        v = mx.dequantize(bufs[3], bufs[4], bufs[5], group_size=self.group_size, bits=self.bits)
        return k, v

    def bytes_per_token(self, num_heads: int, k_dim: int, v_dim: int, itemsize: int) -> int:
        def one(d: int) -> int:
            return d * self.bits // 8 + 2 * (d // self.group_size) * itemsize

        return num_heads * (one(k_dim) + one(v_dim))


Codec = PlainCodec | QuantizedCodec


def make_codec(bits: int = 16, group_size: int = 64) -> Codec:
    """`bits` 16 (or 32) means full precision; anything else is MLX affine quantization."""
    if bits >= 16:
        return PlainCodec()
    return QuantizedCodec(bits=bits, group_size=group_size)
