"""QuantizedLinear on CUDA and the CPU: MLX's kernels where they pay, ours or a dense matmul elsewhere.

``install(model)`` (CUDA and the CPU, or ``force``; Metal keeps MLX's classes) swaps the class of
every exact ``nn.QuantizedLinear`` to ``FewRowQuantizedLinear`` and every ``nn.QuantizedEmbedding``
to ``FewRowQuantizedEmbedding`` (its ``as_linear``, a tied lm_head); parameters, names and saving
are unchanged, and ``uninstall`` swaps them back. A call with x of affine-quantized weights goes,
by x's rows in all (leading dims flattened):

- on CUDA, where ``ROUTE`` says: "ours", the fused few-row kernel inside ``mx.compile`` (the
  traced call is replayed without Python work), or "mlx", ``mx.quantized_matmul``;
- on CUDA and the CPU, from the device's ``DEQUANTIZE_ROWS`` rows on (prefill chunks; on the CPU
  also decode batches of 128 rows or more): the weight dequantized for the call and multiplied
  densely, 1.4-5x faster than MLX's kernel on an H100 and 3-20x on the CPU.

On the CPU a float32 call below those rows goes to the C++ kernel of ``cpu.py`` (one thread per
core, each group of a weight row dequantized once for all rows of x); where no C++ compiler built
it, to MLX's kernel, split by W's output rows over one CPU stream per core when W is large
(bit-identical: each output is the same kernel over the same row). Every other call (other
modes, no biases) goes to MLX's.

On CUDA, MLX's call gets x flattened to ``[rows, K]`` and the result reshaped back:
MLX-CUDA's quantized_matmul treats x's leading dims as a batch of M-row problems (M = x's
second-to-last dim), so a decode batch ``[B, 1, K]`` is B one-row problems, each reading the
whole weight; flattened it is one problem of B rows. For contiguous x the reshape is free.
On the CPU MLX's calls get x as it is.

Where ``JOIN_ROWS`` lists the device (the CPU), ``install`` also joins sibling projections
(q/k/v, gate/up) into one buffer each, so that a call of few rows computes them in one product
(``SiblingGroup``; the same results as apart).

The dense path rounds differently from the few-row kernels, so in float32 on the CPU a row's
outputs are the same alone and in a batch only while both take the same path (a 10-token prompt
alone takes the few-row kernel, in a group of twenty the dense one); decode batches and verify
forwards of up to 127 rows all take the few-row one.
"""

from __future__ import annotations

import itertools
import os
import threading
from functools import lru_cache
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from kernels.common import gpu_backend, swap_classes

from . import cpu as cpu_kernel
from . import qmm


def swapped_here() -> bool:
    """Whether `install` swaps the layers here: on CUDA (the kernel, the dense prefill path) and
    on the CPU (the dense path, the split); Metal keeps MLX's classes."""
    return gpu_backend() != "metal"


@lru_cache(maxsize=64)
def _compiled(bits: int, group: int, with_bias: bool) -> Any:
    def call(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array) -> mx.array:
        return qmm.affine_qmm(x, w, scales, biases, bits=bits, group=group)

    def call_bias(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, b: mx.array) -> mx.array:
        return qmm.affine_qmm(x, w, scales, biases, bits=bits, group=group) + b

    return mx.compile(call_bias if with_bias else call)


# Which kernel x with this many rows in all takes on CUDA: "ours" (the fused kernel, compiled) or
# "mlx" (mx.quantized_matmul, x flattened); rows not listed take "mlx". This table is the one place
# that decides. Measured on an H200 (MLX-CUDA 0.32.4), 8B-shape llama, 4-bit g64 bf16, a whole
# forward on a 32-token cache, ms (python -m bench qmm --random-shape llama-3-8b):
#   decode rows             1      2      4      8    verify of 2..6 tokens
#   MLX's, as loaded     9.17  13.25  21.59  32.52    12.46 .. 29.09
#   ours                11.39  11.89  11.46  14.04    11.89 .. 12.89
# and per call alone, 14336x4096 (python -m bench qmm --sweep), µs, MLX's / ours compiled:
#   1 row 42.5 / 44.7, 2 rows 75.6 / 44.3, 5 rows 171.7 / 49.2, 8 rows 38.1 / 60.5.
# One row stays on MLX's one-row kernel (a whole step with ours costs 11.39 ms, not 9.17). With
# one-row layouts swept on an H100 ours is faster alone (µs, MLX's / ours compiled: 14336x4096
# 42.8 / 24.5, 4096x14336 38.8 / 26.8, 4096x4096 14.8 / 11.6, 128256x4096 293 / 137) and still
# slower in whole steps: 6.63-6.69 ms against 5.91-5.92 with MLX's, the same process alternating.
# MLX-CUDA runs that one-row kernel once per row up to 7 rows in all; from 8 rows of a 2-D x it
# takes a multi-row kernel, faster than ours alone (above), not yet measured in whole steps
# flattened: the bench's "flat" variant is MLX's with the flattening only.
ROUTE: dict[int, str] = {1: "mlx", **dict.fromkeys(range(2, qmm.MAX_ROWS + 1), "ours")}


# From this many rows of x in all, a call dequantizes W to the activation dtype and runs a dense
# matmul (cuBLAS; OpenBLAS's sgemm on the CPU) instead of MLX's quantized kernel.
# CUDA: MLX's multi-row kernel runs prefill-sized products at ~100-130 TFLOPS. Measured on an H100
# (MLX-CUDA 0.32.4, bf16, g64; python -m bench qmm --prefill --rows 128 256 512 1024 2048 8192),
# µs, MLX's / dequantize + matmul, 4-bit:
#   rows               128          256          512         2048          8192
#   4096x4096     161 / 134    158 / 141    204 / 141    670 / 222    2414 /  626
#   14336x4096    213 / 255    362 / 266    665 / 321   2054 / 643    7894 / 1584
#   4096x14336    389 / 296    374 / 302    556 / 324   1920 / 576    7147 / 1686
# 8-bit: 0.84-1.06x at 256 rows, 1.12-1.43x at 512, 1.84-3.03x at 2048.
# CPU: below this the C++ kernel of cpu.py runs (one thread per core, each weight group
# dequantized once for all rows). Measured on the 2-core Linux machine (float32, 4-bit g64,
# OpenBLAS), ms, dequantize + matmul / the C++ kernel:
#   rows              16            64           128           256
#   2048x2048    10.7 / 2.6    15.0 / 9.1    21.4 / 18.9    33.7 / 52.7
#   8192x2048    85.2 / 9.9     106 / 41.8    136 / 75.8     189 / 220
#   2048x8192     101 / 12.3    131 / 48.8    156 / 181      208 / 400
# Without it (no C++ compiler) MLX's kernel runs below CPU_DEQUANTIZE_ROWS_WITHOUT_KERNEL: it
# dequantizes the weight again for every row of x on one thread, so a row costs about what a
# one-row call does (ms, MLX's / dequantize + matmul; python -m bench qmm --prefill):
#   rows              1             8            16            32           256
#   2048x2048    2.7 / 13.5    20.9 / 16.0   43.7 / 16.6   85.0 / 16.1    662 /  41
#   8192x2048   10.3 / 100     85.6 / 91.9    168 / 104     337 / 111    2621 / 177
# The dense copy lives for its one call (the memory budget counts two of the largest weight).
DEQUANTIZE_ROWS = {"cuda": 512, "cpu": cpu_kernel.MAX_ROWS + 1}
CPU_DEQUANTIZE_ROWS_WITHOUT_KERNEL = 16


def _cpu_dense_from() -> int:
    return DEQUANTIZE_ROWS["cpu"] if cpu_kernel.available() else CPU_DEQUANTIZE_ROWS_WITHOUT_KERNEL


def _dense_from(backend: str | None) -> int | None:
    """The rows from which a call goes dense for a `gpu_backend()` answer (None: Metal, which
    keeps MLX's kernel)."""
    if backend == "metal":
        return None
    return DEQUANTIZE_ROWS["cuda"] if backend == "cuda" else _cpu_dense_from()


def dequantize_rows() -> int | None:
    """DEQUANTIZE_ROWS for this device (None: Metal, which keeps MLX's kernel)."""
    return _dense_from(gpu_backend())


def dense_matmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, bits: int, group: int) -> mx.array:
    """x @ W.T over W dequantized to x's dtype for this one call (a dense matmul)."""
    dense = mx.dequantize(w, scales, biases, group_size=group, bits=bits)
    if dense.dtype != x.dtype:
        dense = dense.astype(x.dtype)
    return x @ dense.T


def dequantized_peak_bytes(model: Any) -> int:
    """What dense copies of weights add to a forward of `dequantize_rows()` rows or more (0 on
    Metal): two of the model's largest affine weight (a tied head included) in its scales'
    dtype, since each lives only for its own call."""
    if dequantize_rows() is None:
        return 0
    largest = 0
    for _, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) and m.mode == "affine":
            rows, words = m["weight"].shape
            largest = max(largest, rows * words * 32 // m.bits * m["scales"].dtype.size)
    return 2 * largest


def _rows(x: mx.array) -> int:
    """x's rows in all (leading dims flattened)."""
    return x.size // x.shape[-1] if x.ndim and x.shape[-1] else 0


def route(x: mx.array) -> str:
    """ROUTE's answer for x's rows in all."""
    return ROUTE.get(_rows(x), "mlx")


def mlx_matmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None, bits: int, group: int,
               mode: str = "affine") -> mx.array:
    """mx.quantized_matmul(x, W, transpose=True); on CUDA x's leading dims flattened first
    when they hold more than one problem (one M-row problem instead of a batch of them, module
    doc). A lone problem (a one-row decode step, one row's verify) goes as it is: two reshapes
    per call are ~450 graph nodes a step of an 8B model, host work a step bound by it pays."""
    return _mlx(x, w, scales, biases, bits, group, mode, gpu_backend() == "cuda")


def _mlx(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None, bits: int, group: int,
         mode: str, cuda: bool) -> mx.array:
    if cuda and x.ndim > 2 and x.size > x.shape[-2] * x.shape[-1]:
        lead = x.shape[:-1]
        y = mx.quantized_matmul(x.reshape(-1, x.shape[-1]), w, scales=scales, biases=biases, transpose=True,
                                group_size=group, bits=bits, mode=mode)
        return y.reshape(*lead, y.shape[-1])
    return mx.quantized_matmul(x, w, scales=scales, biases=biases, transpose=True, group_size=group, bits=bits,
                               mode=mode)


def affine_matmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None, bits: int, group: int,
                  bias: mx.array | None = None) -> mx.array:
    """x @ W.T (+ bias) for affine W: on CUDA the fused kernel where `ROUTE` says "ours" and the
    kernel takes the call; on CUDA and the CPU a dense matmul over the dequantized weight from
    the device's `DEQUANTIZE_ROWS` rows on; else MLX's (flattened on CUDA). Every layer call of
    a decode step comes here (~225 for an 8B model), so the choice is made in one pass."""
    backend = gpu_backend()
    rows = _rows(x)
    if backend == "metal":
        y = _mlx(x, w, scales, biases, bits, group, "affine", False)
    elif backend == "cuda":
        if biases is not None and ROUTE.get(rows) == "ours" and qmm.takes(x, w, scales, bits, group):
            fn = _compiled(bits, group, bias is not None)
            return fn(x, w, scales, biases) if bias is None else fn(x, w, scales, biases, bias)
        y = (dense_matmul(x, w, scales, biases, bits, group)
             if biases is not None and rows and rows >= DEQUANTIZE_ROWS["cuda"]
             else _mlx(x, w, scales, biases, bits, group, "affine", True))
    elif biases is not None and rows and rows >= _cpu_dense_from():
        y = dense_matmul(x, w, scales, biases, bits, group)
    else:
        ours = (cpu_kernel.qmm(x, w, scales, biases, bits, group)
                if biases is not None and cpu_kernel.takes(x, w, scales, biases, bits, group) else None)
        if ours is not None:
            y = ours
        elif w.shape[0] * w.shape[1] * 32 // bits >= CPU_SPLIT_WEIGHTS and cpu_streams() > 1:
            y = _split_matmul(x, w, scales, biases, bits, group)
        else:
            y = _mlx(x, w, scales, biases, bits, group, "affine", False)
    return y if bias is None else y + bias


# On the CPU MLX's quantized matmul (where the C++ kernel does not take a call, or was not built)
# runs on one thread; a weight of this many elements or more is split by output rows over CPU
# streams (one thread each), which run at once. Every output is computed exactly as before
# (the same kernel over the same row of W), so the result is bit-identical. Measured on the 2-core Linux machine (float32,
# 4-bit g64): 8192x2048 one row 11.7 -> 5.9 ms, 2048x2048 3.1 -> 2.4 ms; a random 4-bit
# Llama-3.2-1B-shape model decodes at 347-351 instead of 639-643 ms a token in mlxd's engine.
CPU_SPLIT_WEIGHTS = 2048 * 2048
_STREAMS = threading.local()  # MLX's streams belong to the thread that made them


def cpu_streams() -> int:
    """CPU streams a split product uses: one per core, at most 4 (2 measured)."""
    return max(1, min(os.cpu_count() or 1, 4))


def _split_matmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None, bits: int,
                  group: int) -> mx.array:
    """mx.quantized_matmul over `cpu_streams()` slices of W's rows at once, concatenated."""
    parts = cpu_streams()
    streams: list[Any] = _STREAMS.__dict__.setdefault("streams", [])
    while len(streams) < parts - 1:
        streams.append(mx.new_stream(mx.cpu))
    n = w.shape[0]
    bounds = [n * i // parts for i in range(parts + 1)]
    outs = []
    for i in range(parts):
        lo, hi = bounds[i], bounds[i + 1]
        outs.append(mx.quantized_matmul(
            x, w[lo:hi], scales[lo:hi], None if biases is None else biases[lo:hi], transpose=True,
            group_size=group, bits=bits, stream=None if i == 0 else streams[i - 1]))
    return mx.concatenate(outs, axis=-1)


# Projections that read the same input: the q/k/v of an attention and the gate/up of an MLP,
# by these attribute names of one module.
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))

# x with at most this many rows in all goes through one product over the siblings' joined weight
# (`SiblingGroup`); more rows (prefill chunks, wide batches) through each member's own. A device
# not listed keeps its siblings apart. Measured on the 2-core Linux machine (float32, 4-bit,
# mlxd's engine in-process, windows alternating between joined and apart, tokens/s): a 4-layer,
# 256-wide model 1.13x at one row and 1.15x at four (a forward 8.4 -> 7.1 ms); Llama-3.2-1B's
# shape 1.00-1.01x a forward, 1.11x / 1.01x the engine's 1 / 4 rows. CUDA is not listed: at one
# row (MLX's own kernel over the joined weight) an 8B-shape 4-bit model on one H100 gave 0.99x a
# forward and 1.00x pipelined decode; through the kernel of `ROUTE`'s 2..16 rows a joined launch
# lost (docs/kernels.md).
JOIN_ROWS: dict[str, int] = {"cpu": 16}


class SiblingGroup:
    """Sibling projections whose packed weights, scales and biases lie in one buffer, rows
    stacked in member order; each member's parameters are views of its rows (no second copy,
    and saving finds them where it did).

    The first member called with an x of up to `JOIN_ROWS` rows computes one product over the
    joined weight and keeps the other members' parts for that same x (the same array object),
    which they take when called with it, in any order; a member called with another x, or with
    more rows, computes from its own view. Each output comes from its own weight row through
    the same kernel as the member's own call, so a member's result is the same joined or alone.
    A plain attribute of each member (not a Module child: nothing of it is saved or loaded).
    """

    __slots__ = ("bits", "group", "weight", "scales", "biases", "splits", "members", "_x", "_parts")

    def __init__(self, members: list[FewRowQuantizedLinear]) -> None:
        first = members[0]
        self.bits, self.group = first.bits, first.group_size
        self.weight = mx.concatenate([m["weight"] for m in members], axis=0)
        self.scales = mx.concatenate([m["scales"] for m in members], axis=0)
        self.biases = mx.concatenate([m["biases"] for m in members], axis=0)
        stops = list(itertools.accumulate(int(m["weight"].shape[0]) for m in members))
        self.splits = stops[:-1]  # where each member's output columns start, but the first's
        for m, start, stop in zip(members, [0, *self.splits], stops, strict=True):
            m.weight, m.scales, m.biases = (self.weight[start:stop], self.scales[start:stop],
                                            self.biases[start:stop])
        self.members = members
        self._x: mx.array | None = None
        self._parts: dict[int, mx.array] = {}

    def output(self, member: FewRowQuantizedLinear, x: mx.array, cuda: bool) -> mx.array | None:
        """member's x @ W.T from the joined product (without the member's bias), or None when
        the member computes alone."""
        if self._x is x:
            y = self._parts.pop(id(member), None)
            if y is not None:
                if not self._parts:
                    self._x = None
                return y
        if not 0 < _rows(x) <= JOIN_ROWS.get("cuda" if cuda else "cpu", 0):
            return None
        y = affine_matmul(x, self.weight, self.scales, self.biases, self.bits, self.group)
        parts = mx.split(y, self.splits, axis=-1)
        mine = parts[0]
        self._parts = {}
        for m, part in zip(self.members, parts, strict=True):
            if m is member:
                mine = part
            else:
                self._parts[id(m)] = part
        self._x = x
        return mine


def _joinable(members: list[Any]) -> bool:
    if not all(type(m) is FewRowQuantizedLinear for m in members):
        return False
    first = members[0]
    return all(
        m.mode == "affine" and m.get("biases") is not None and m.bits == first.bits
        and m.group_size == first.group_size and m["weight"].shape[1] == first["weight"].shape[1]
        and m["scales"].dtype == first["scales"].dtype and "_siblings" not in m.__dict__
        for m in members
    )


def join_siblings(model: Any, lazy: bool = False) -> int:
    """Join every q/k/v and gate/up set of FewRowQuantizedLinear siblings into a `SiblingGroup`;
    returns how many sets. Runs after every transform of the weights (dtype, sharding). Each
    group's buffers are evaluated here, one group at a time (a transient copy of one group's
    weights), unless `lazy`: a model built lazily (engine.loader) evaluates them with its
    parameters, in the thread that built them (MLX's streams belong to their thread)."""
    count = 0
    for _, module in model.named_modules():
        for names in SIBLINGS:
            members: list[Any] = [getattr(module, n, None) for n in names]
            if _joinable(members):
                group = SiblingGroup(members)
                for m in members:
                    m.__dict__["_siblings"] = group  # the instance's own dict: not a parameter or child
                if not lazy:
                    mx.eval([(m["weight"], m["scales"], m["biases"]) for m in members])
                count += 1
    return count


class FewRowQuantizedLinear(nn.QuantizedLinear):
    """nn.QuantizedLinear whose calls on CUDA and the CPU take the paths of `affine_matmul`
    (module doc), joined with its siblings' where they were joined (`SiblingGroup`)."""

    def __call__(self, x: mx.array) -> mx.array:
        bias = self["bias"] if "bias" in self else None
        group = self.__dict__.get("_siblings")
        if group is not None:
            y = group.output(self, x, gpu_backend() == "cuda")
            if y is not None:
                return y if bias is None else y + bias
        if self.mode == "affine":
            return affine_matmul(x, self["weight"], self["scales"], self.get("biases"), self.bits, self.group_size, bias)
        y = mlx_matmul(x, self["weight"], self["scales"], self.get("biases"), self.bits, self.group_size, self.mode)
        return y if bias is None else y + bias


class FewRowQuantizedEmbedding(nn.QuantizedEmbedding):
    """nn.QuantizedEmbedding whose ``as_linear`` (a tied lm_head) routes as FewRowQuantizedLinear."""

    def as_linear(self, x: mx.array) -> mx.array:
        if self.mode == "affine":
            return affine_matmul(x, self["weight"], self["scales"], self.get("biases"), self.bits, self.group_size)
        return mlx_matmul(x, self["weight"], self["scales"], self.get("biases"), self.bits, self.group_size, self.mode)


def install(model: Any, force: bool = False, lazy: bool = False) -> int:
    """Swap QuantizedLinear / QuantizedEmbedding to the few-row classes and, where `JOIN_ROWS`
    has the device (or `force`), join sibling projections (`join_siblings`; `lazy`: the model's
    parameters are not read yet); returns how many modules were swapped (0 unless
    `swapped_here()` or `force`)."""
    if not (force or swapped_here()):
        return 0
    count = swap_classes(model, {nn.QuantizedLinear: FewRowQuantizedLinear, nn.QuantizedEmbedding: FewRowQuantizedEmbedding})
    if force or JOIN_ROWS.get(gpu_backend() or "cpu", 0):
        join_siblings(model, lazy=lazy)
    return count


def uninstall(model: Any) -> int:
    """Back to MLX's classes (for A/B measurements; joined members keep their views, alone);
    returns how many modules were swapped."""
    for _, module in model.named_modules():
        module.__dict__.pop("_siblings", None)
    return swap_classes(model, {FewRowQuantizedLinear: nn.QuantizedLinear, FewRowQuantizedEmbedding: nn.QuantizedEmbedding})
