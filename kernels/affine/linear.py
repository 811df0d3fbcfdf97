"""QuantizedLinear on CUDA through the fused few-row kernel, and fusion of sibling projections.

``install(model)`` (CUDA only, or ``force``) swaps the class of every exact ``nn.QuantizedLinear``
in affine mode to ``FewRowQuantizedLinear`` (parameters, names and saving unchanged) and every
``nn.QuantizedEmbedding`` to ``FewRowQuantizedEmbedding`` (its ``as_linear``, a tied lm_head).
x with 1..MAX_ROWS rows in all goes through the kernel (inside ``mx.compile`` on CUDA: the traced
call is replayed without Python work); more rows, other dtypes, other modes, the CPU and Metal go
to ``mx.quantized_matmul``.

``fuse_siblings(model)`` joins projections that read the same input (q/k/v of an attention,
gate/up of an MLP, by those attribute names) into one launch: their packed weights, scales and
biases are stacked along N in one buffer, and each member keeps a view of its rows (no second
copy). The first member called with a given x computes every member's output in one call and
the others take theirs for the same x (any order); a member called with another x computes
alone. A member whose weight was replaced after fusing (a reload) computes alone. Each output row is computed from its own weight row only, so a member's result equals
its unfused result; in float32 bit for bit (one layout for every shape), in 16-bit activations up
to the summation order of the layout picked for the stacked shape.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from kernels.common import gpu_backend

from . import qmm


def swap_classes(model: Any, mapping: dict[type, type]) -> int:
    """Give every module whose exact type is a key of `mapping` the mapped class (in place, as
    engine/modswap.py does; kernels/ does not import the engine); returns how many."""
    count = 0
    for _, module in model.named_modules():
        new = mapping.get(type(module))
        if new is not None:
            module.__class__ = new
            count += 1
    return count


def enabled() -> bool:
    return gpu_backend() == "cuda"


@lru_cache(maxsize=64)
def _compiled(bits: int, group: int, with_bias: bool) -> Any:
    def call(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array) -> mx.array:
        return qmm.affine_qmm(x, w, scales, biases, bits=bits, group=group)

    def call_bias(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, b: mx.array) -> mx.array:
        return qmm.affine_qmm(x, w, scales, biases, bits=bits, group=group) + b

    return mx.compile(call_bias if with_bias else call)


# Which path x with this many rows in all takes on CUDA where the kernel applies: "ours" (the
# fused kernel), "pad8" (rows padded to 8: MLX-CUDA runs its one-row kernel once per row from 2
# to 7 rows and a multi-row kernel from 8 on, which costs about one one-row call) or "mlx".
ROUTE: dict[int, str] = dict.fromkeys(range(1, qmm.MAX_ROWS + 1), "ours")
PAD_ROWS = 8


def padded_matmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None, bits: int,
                  group: int) -> mx.array:
    """mx.quantized_matmul with x's rows (leading dims flattened) padded to `PAD_ROWS`."""
    k = x.shape[-1]
    rows = x.size // k
    flat = x.reshape(rows, k)
    padded = mx.concatenate([flat, mx.zeros((PAD_ROWS - rows, k), x.dtype)])
    y = mx.quantized_matmul(padded, w, scales=scales, biases=biases, transpose=True,
                            group_size=group, bits=bits)
    return y[:rows].reshape(*x.shape[:-1], y.shape[-1])


def affine_matmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None, bits: int, group: int,
                  bias: mx.array | None = None) -> mx.array:
    """x @ W.T (+ bias): the fused kernel (compiled) or MLX's padded to 8 rows where `ROUTE`
    says so and the kernel takes the call, else MLX's."""
    if biases is not None and qmm.takes(x, w, scales, bits, group) and gpu_backend() == "cuda":
        route = ROUTE.get(x.size // x.shape[-1], "mlx")
        if route == "ours":
            fn = _compiled(bits, group, bias is not None)
            return fn(x, w, scales, biases) if bias is None else fn(x, w, scales, biases, bias)
        if route == "pad8" and x.size // x.shape[-1] < PAD_ROWS:
            y = padded_matmul(x, w, scales, biases, bits, group)
            return y if bias is None else y + bias
    y = mx.quantized_matmul(x, w, scales=scales, biases=biases, transpose=True, group_size=group, bits=bits)
    return y if bias is None else y + bias


class FewRowQuantizedLinear(nn.QuantizedLinear):
    """nn.QuantizedLinear whose few-row calls on CUDA take the fused kernel (module doc)."""

    def __call__(self, x: mx.array) -> mx.array:
        group = getattr(self, "_fused_group", None)
        if group is not None:
            return group.output(self, x)
        return self._own(x)

    def _own(self, x: mx.array) -> mx.array:
        if self.mode != "affine":
            return super().__call__(x)
        bias = self["bias"] if "bias" in self else None
        return affine_matmul(x, self["weight"], self["scales"], self.get("biases"), self.bits, self.group_size, bias)


class FewRowQuantizedEmbedding(nn.QuantizedEmbedding):
    def as_linear(self, x: mx.array) -> mx.array:
        if self.mode != "affine":
            return super().as_linear(x)
        return affine_matmul(x, self["weight"], self["scales"], self.get("biases"), self.bits, self.group_size)


def install(model: Any, force: bool = False) -> int:
    """Swap QuantizedLinear / QuantizedEmbedding to the few-row classes and fuse sibling
    projections; returns how many modules were swapped (0 unless `enabled()` or `force`)."""
    if not (force or enabled()):
        return 0
    count = swap_classes(model, {nn.QuantizedLinear: FewRowQuantizedLinear, nn.QuantizedEmbedding: FewRowQuantizedEmbedding})
    fuse_siblings(model)
    return count


def uninstall(model: Any) -> int:
    """Back to MLX's classes (for A/B measurements; fused members keep their views, unfused)."""
    for _, module in model.named_modules():
        if isinstance(module, FewRowQuantizedLinear) and "_fused_group" in module.__dict__:
            del module.__dict__["_fused_group"]
    return swap_classes(model, {FewRowQuantizedLinear: nn.QuantizedLinear, FewRowQuantizedEmbedding: nn.QuantizedEmbedding})


SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class FusedGroup:
    """Sibling projections sharing one stacked weight (module doc). Plain attribute of each
    member (not a Module child: it holds no parameters of its own to save or load)."""

    __slots__ = ("members", "bounds", "views", "weight", "scales", "biases", "bits", "group", "_x", "_ys")

    def __init__(self, members: list[FewRowQuantizedLinear]) -> None:
        first = members[0]
        self.members = members
        self.bits, self.group = first.bits, first.group_size
        self.weight = mx.concatenate([m["weight"] for m in members], axis=0)
        self.scales = mx.concatenate([m["scales"] for m in members], axis=0)
        self.biases = mx.concatenate([m["biases"] for m in members], axis=0)
        mx.eval(self.weight, self.scales, self.biases)
        self.bounds: list[tuple[int, int]] = []
        self.views: list[mx.array] = []
        start = 0
        for m in members:
            stop = start + int(m["weight"].shape[0])
            self.bounds.append((start, stop))
            # a view of the stacked buffer: the member's parameters stay where saving finds them
            m.weight, m.scales, m.biases = self.weight[start:stop], self.scales[start:stop], self.biases[start:stop]
            self.views.append(m["weight"])
            start = stop
        self._x: mx.array | None = None
        self._ys: dict[int, mx.array] = {}

    def intact(self) -> bool:
        """Whether every member still holds its view (weights loaded later replace them)."""
        return all(m["weight"] is v for m, v in zip(self.members, self.views, strict=True))

    def output(self, member: FewRowQuantizedLinear, x: mx.array) -> mx.array:
        if not self.intact():
            return member._own(x)
        key = id(member)
        if self._x is not x or key not in self._ys:
            y = affine_matmul(x, self.weight, self.scales, self.biases, self.bits, self.group)
            self._x = x
            self._ys = {}
            for m, (start, stop) in zip(self.members, self.bounds, strict=True):
                part = y[..., start:stop]
                self._ys[id(m)] = part + m["bias"] if "bias" in m else part
        out = self._ys.pop(key)
        if not self._ys:
            self._x = None
        return out


def _fusable(members: list[Any]) -> bool:
    if not all(type(m) is FewRowQuantizedLinear for m in members):
        return False
    first = members[0]
    return all(
        m.mode == "affine" and m.get("biases") is not None and m.bits == first.bits
        and m.group_size == first.group_size and m["weight"].shape[1] == first["weight"].shape[1]
        and m["scales"].dtype == first["scales"].dtype and "_fused_group" not in m.__dict__
        for m in members
    )


def fuse_siblings(model: Any) -> int:
    """Fuse every q/k/v and gate/up set of FewRowQuantizedLinear siblings; returns how many sets."""
    count = 0
    for _, module in model.named_modules():
        for names in SIBLINGS:
            found = [getattr(module, n, None) for n in names]
            members = [m for m in found if m is not None]
            if len(members) == len(names) and _fusable(members):
                group = FusedGroup(members)
                for m in members:
                    # in the instance __dict__, not the Module's items: not a parameter or child
                    m.__dict__["_fused_group"] = group
                count += 1
    return count
