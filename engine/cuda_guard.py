"""A guard against a launch failure of MLX-CUDA (0.32.4) that a serving batch can reach.

**The failure.** On the H200, `mx.fast.rope` on a `[256, 4, 1, 16]` float32 input with per-row
offsets (a `[256]` int32 array, what the engine's KV layouts pass) fails at launch with
`cudaGraphAddKernelNode ... invalid argument` (`cudaLaunchKernelExC` with
`MLX_USE_CUDA_GRAPHS=0`), and with it the whole step: every request of the batch ends in an
error. MLX has closed bugs with the same message for other launch grids (ml-explore/mlx#3659,
RoPE over very large inputs; #3666, non-contiguous copies); this one, at a small size, still
fails in the 0.32.4 wheel. Measured boundary (one child process per shape, per-row offsets):
one query per row (MLX's "single" kernel) with head dim 16 fails from 512 rows (batch x heads)
on, in float32 and bfloat16, with array or int offsets; 256 rows launch. Head dim 64 launched at
every size tried (up to 3,072 rows), and so did 9 queries per row (up to 27,648 rows) and a
512-token prefill.

**The guard.** `install(model)` (CUDA only; engine/loader.py calls it for every model it loads)
gives the model's RoPE modules a guarded subclass, the way engine/fewrow.py swaps `nn.Linear`:
`mx.fast.rope` itself is never replaced, so code outside mlxd's models is not affected. A RoPE
module is one whose `__call__(x, offset, ...)` calls `mx.fast.rope` itself: `mlx.nn.RoPE`, the
variants of `mlx_lm.models.rope_utils` (Llama 3, YaRN, SuScaled, ...) and the model files' own
(DeepSeek-V2, Hunyuan, InternLM3). A model that calls `mx.fast.rope` inside its attention
(no RoPE module) is not covered.

A guarded module sends a one-query input with a head dim under `SMALL_HEAD` (64) and more than
`ROWS` (256) rows through the module's own call in slices of whole batch rows, at most `ROWS`
rows each (shapes that launch), and concatenates the results. RoPE is applied row by row, so
the result equals the unsliced call bit for bit. Every other call (most real models' head dims
are 64-256, and prefill chunks carry many queries a row) goes straight to the module's call.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine.api import MAX_DRAFT_TOKENS
from kernels import cpu as cpu_kernels
from kernels.attention import decode as decode_attention
from kernels.common import gpu_backend, mask_5d, swap_classes

ROWS = 256  # most rows (batch x heads) of one-query RoPE that launched (512 failed)
SMALL_HEAD = 64  # head dims below this are affected (16 failed, 64 never did)

_GUARDED: dict[type, type] = {}  # RoPE module class -> its guarded subclass


def applies() -> bool:
    """Whether the guard is needed here: on an MLX-CUDA GPU."""
    return gpu_backend() == "cuda"


def batch_rows(x: mx.array, offset: Any) -> int:
    """How many leading (batch) rows of x one slice may hold, or 0 when x goes through whole:
    x is one query per row with a small head and more than `ROWS` rows, and a per-row offset
    (if any) has one entry per batch row."""
    if x.ndim < 3 or x.shape[-2] != 1 or x.shape[-1] >= SMALL_HEAD:
        return 0
    rows = x.size // x.shape[-1]
    if rows <= ROWS:
        return 0
    if isinstance(offset, mx.array) and offset.size > 1 and offset.shape != (x.shape[0],):
        return 0
    per_row = rows // x.shape[0]
    return max(1, ROWS // per_row) if per_row <= ROWS else 0


def sliced_call(call: Callable[..., mx.array], x: mx.array, offset: Any, step: int, *args: Any,
                **kwargs: Any) -> mx.array:
    """call(x, offset, ...) over slices of `step` batch rows, concatenated."""
    per_row = isinstance(offset, mx.array) and offset.size > 1
    outs = [
        call(x[i : i + step], offset[i : i + step] if per_row else offset, *args, **kwargs)
        for i in range(0, x.shape[0], step)
    ]
    return mx.concatenate(outs, axis=0)


def is_rope_module(cls: type) -> bool:
    """Whether modules of `cls` are RoPE modules the guard can take (see the module doc)."""
    code = getattr(inspect.getattr_static(cls, "__call__", None), "__code__", None)
    if code is None or cls in _GUARDED.values():
        return False
    names = code.co_varnames[: code.co_argcount]
    return "fast" in code.co_names and "rope" in code.co_names and names[1:3] == ("x", "offset")


def guarded_class(cls: type) -> type:
    """The subclass of RoPE module class `cls` whose call slices inputs that would not launch."""
    hit = _GUARDED.get(cls)
    if hit is None:
        base = cls.__call__

        def __call__(self: Any, x: mx.array, offset: Any = 0, *args: Any, **kwargs: Any) -> mx.array:
            step = batch_rows(x, offset)
            if step:
                return sliced_call(partial(base, self), x, offset, step, *args, **kwargs)
            return base(self, x, offset, *args, **kwargs)

        hit = type(f"Guarded{cls.__name__}", (cls,), {"__call__": __call__, "__module__": __name__})
        _GUARDED[cls] = hit
    return hit


def install(model: nn.Module | None = None, force: bool = False) -> int:
    """Give the RoPE modules of `model` their guarded subclass on MLX-CUDA (`force`: anywhere,
    for tests); returns how many were swapped. Idempotent; `model` None swaps nothing."""
    if model is None or not (force or applies()):
        return 0
    classes = {type(m) for _, m in model.named_modules()}
    return swap_classes(model, {cls: guarded_class(cls) for cls in classes if is_rope_module(cls)})


# -- few-query attention -----------------------------------------------------------------------
# A second MLX-CUDA failure: with cuDNN attention on (MLX's default), a speculative run aborts the
# process in `std::terminate` ("cudaStreamEndCapture ... operation failed due to a previous error
# during capture"): on the H200, `bench spec` with forced n-gram verify steps of 5 queries died
# within seconds, every time, while plain decoding, long prefills and synthetic cuDNN calls of the
# same shapes outside the engine ran. The verify forwards (2 to the draft ceiling + 1 queries a
# row) are what a plain run does not have. They gain nothing from cuDNN (plain-op attention
# measured 0.85-1.11x of it there), while prefill gains a lot (flash attention never
# materialises the chunk x context scores: with plain ops an 8k-token prompt ran out of the
# H200's memory). So cuDNN stays on and few-query calls of the model's attention take plain ops:
# `install_attention(model)` points the `scaled_dot_product_attention` of the model's mlx-lm
# modules at `few_query_sdpa`, which sends 2..`FEW_QUERIES` queries through `plain_attention`
# (what MLX's own fallback computes), one-query calls over rows of different lengths through
# mlxd's decode-attention kernel (MLX-CUDA does not fuse a one-query call with an array mask:
# kernels/attention/decode.py), and everything else to mlx-lm's function unchanged.

# query lengths 2..FEW_QUERIES take plain ops: every verify width the engine can run (the draft
# model's default ceiling of 16 verifies 17 columns; through cuDNN such rounds built a graph for
# every new context length and the process aborted) and short last chunks
FEW_QUERIES = MAX_DRAFT_TOKENS + 1


def plain_attention(q: mx.array, k: mx.array, v: mx.array, scale: float,
                    mask: mx.array | str | None) -> mx.array:
    """softmax(q k^T * scale + mask) v with grouped-query heads, in plain MLX ops: `q`
    `[B, H, L, D]`, `k`/`v` `[B, Hkv, K, D]`; `mask` None, "causal" (the last L of K positions)
    or an array, boolean (True = attend) or additive, broadcastable to `[B, H, L, K]`."""
    B, H, L, D = q.shape
    Hkv, K = k.shape[1], k.shape[2]
    rep = H // Hkv
    q5 = (q * scale).reshape(B, Hkv, rep, L, D)
    scores = q5 @ k[:, :, None].swapaxes(-1, -2)  # [B, Hkv, rep, L, K]
    if isinstance(mask, str):
        rows = mx.arange(K - L, K)[:, None]
        mask = rows >= mx.arange(K)[None]
    if mask is not None:
        m = mask_5d(mask, H, Hkv)
        if m.dtype == mx.bool_:
            scores = mx.where(m, scores, mx.array(-mx.inf, scores.dtype))
        else:
            scores = scores + m.astype(scores.dtype)
    probs = mx.softmax(scores.astype(mx.float32), axis=-1).astype(v.dtype)
    return (probs @ v[:, :, None]).reshape(B, H, L, v.shape[-1])


def _tagged(fn: Callable[..., Any], route: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` marked as `route`'s stand-in for `original` (so `install_attention` can tell it
    and give `original` back)."""
    fn._mlxd_route = route  # type: ignore[attr-defined]
    fn._mlxd_original = original  # type: ignore[attr-defined]
    return fn


def _route_sdpa(original: Callable[..., mx.array], route: str,
                call: Callable[..., mx.array | None]) -> Callable[..., mx.array]:
    """mlx-lm's `scaled_dot_product_attention` with plain-KV calls offered to `call` first (it
    answers None to pass); `original` itself when it is already on `route`."""
    if getattr(original, "_mlxd_route", None) == route:
        return original

    def sdpa(queries: mx.array, keys: Any, values: Any, cache: Any, scale: float,
             mask: Any, sinks: Any = None) -> mx.array:
        if not hasattr(cache, "bits"):
            out = call(queries, keys, values, cache, scale, mask, sinks)
            if out is not None:
                return out
        return original(queries, keys, values, cache, scale, mask, sinks)

    return _tagged(sdpa, route, original)


def _few_query_call(queries: mx.array, keys: Any, values: Any, cache: Any, scale: float,
                    mask: Any, sinks: Any) -> mx.array | None:
    if sinks is not None or not isinstance(keys, mx.array):
        return None
    if 2 <= queries.shape[2] <= FEW_QUERIES:
        return plain_attention(queries, keys, values, scale, mask)
    if isinstance(mask, mx.array) and decode_attention.takes(queries, keys, values):
        lengths = getattr(cache, "decode_lengths", None)
        lens = lengths() if lengths is not None else None
        if lens is not None:
            return decode_attention.decode_attention(queries, keys, values, lens, scale)
    return None


def _cpu_call(queries: mx.array, keys: Any, values: Any, cache: Any, scale: float,
              mask: Any, sinks: Any) -> mx.array | None:
    if cpu_kernels.takes(queries, keys, values, mask, sinks):
        try:
            return cpu_kernels.attention(queries, keys, values, scale, mask)
        except cpu_kernels.InTransform:  # traced (mx.compile / vmap): MLX's op
            return None
    return None


def few_query_sdpa(original: Callable[..., mx.array]) -> Callable[..., mx.array]:
    """mlx-lm's `scaled_dot_product_attention` with 2..`FEW_QUERIES` queries on plain ops, and
    one query a row over rows of different lengths (an array mask a full layout made, which
    MLX-CUDA would not fuse) through `kernels.attention.decode` with the layout's row lengths."""
    return _route_sdpa(original, "cuda", _few_query_call)


def cpu_sdpa(original: Callable[..., mx.array]) -> Callable[..., mx.array]:
    """mlx-lm's `scaled_dot_product_attention` with float32 calls whose scores are big enough
    through `kernels.cpu.attention` (the softmax on NumPy's vectorised exp), everything else
    unchanged."""
    return _route_sdpa(original, "cpu", _cpu_call)


def cpu_swiglu(original: Callable[..., mx.array]) -> Callable[..., mx.array]:
    """mlx-lm's `swiglu` with float32 calls of at least `kernels.cpu.MIN_SWIGLU` elements
    through `kernels.cpu.swiglu` (NumPy's exp), everything else unchanged."""
    if getattr(original, "_mlxd_route", None) == "cpu":
        return original

    def swiglu(gate: mx.array, x: mx.array) -> mx.array:
        if cpu_kernels.swiglu_takes(gate, x):
            try:
                return cpu_kernels.swiglu(gate, x)
            except cpu_kernels.InTransform:  # traced (mx.compile / vmap): MLX's op
                pass
        return original(gate, x)

    return _tagged(swiglu, "cpu", original)


def attention_route() -> str | None:
    """Which attention route this process's device takes: "cuda" on MLX-CUDA, "cpu" on MLX's
    CPU backend, None on Metal (its fused kernels need nothing)."""
    if mx.default_device() == mx.cpu:
        return "cpu"
    return "cuda" if applies() else None


def install_attention(model: nn.Module | None = None, force: bool = False,
                      route: str | None = None) -> int:
    """Point the `scaled_dot_product_attention` of every mlx-lm module that defines one of
    `model`'s layers at the device's route (`attention_route`): `few_query_sdpa` on MLX-CUDA,
    `cpu_sdpa` on a CPU, where the modules' `swiglu` also becomes `cpu_swiglu`. `force` takes
    the CUDA route anywhere and `route` names one (tests). Returns how many modules changed.
    Idempotent; a module on another route is switched (a CPU route's `swiglu` stays)."""
    import sys

    from mlx_lm.models import activations, base

    route = route or ("cuda" if force else attention_route())
    if model is None or route is None:
        return 0
    # (attribute, mlx-lm's function, its wrapper on this route)
    swaps: list[tuple[str, Any, Callable[..., Any]]] = [
        ("scaled_dot_product_attention", base.scaled_dot_product_attention,
         few_query_sdpa if route == "cuda" else cpu_sdpa)]
    if route == "cpu":
        swaps.append(("swiglu", activations.swiglu, cpu_swiglu))
    names = {type(m).__module__ for _, m in model.named_modules()}
    count = 0
    for name in sorted(names):
        module = sys.modules.get(name)
        changed = False
        for attr, theirs, wrap in swaps:
            fn = getattr(module, attr, None)
            if fn is None or getattr(fn, "_mlxd_route", None) == route:
                continue
            if getattr(fn, "_mlxd_original", fn) is theirs:
                setattr(module, attr, wrap(theirs))
                changed = True
        count += changed
    return count
