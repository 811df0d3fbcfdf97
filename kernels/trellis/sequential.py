"""Sequential BlockLDLQ: each layer's Hessian comes from the inputs that the already-quantized
earlier layers produce (GPTQ's "sequential" order), rather than from the float model.

The order is found from the model itself, with no per-architecture code:

- A *block* is the module at the longest path prefix of a Linear that ends in a list index
  (``model.layers.3`` for ``model.layers.3.mlp.up_proj``). Blocks run in index order.
- For block i, the float inputs of block i are captured by running the model (blocks < i are
  already quantized) with the block swapped for a wrapper that records its call arguments and
  stops the forward (so each capture costs only the prefix of the model).
- Inside the block, Linears that receive the very same input array in one call form a *group*
  (q/k/v; gate/up). Groups are quantized in call order. Each group's Hessian is collected by
  rerunning only the block on the captured arguments, with the earlier groups of the block already
  quantized, and the block call is stopped as soon as the group's layers have seen their input.

Linears outside any block (e.g. an untied ``lm_head``, if not skipped) are done last, with
Hessians from the fully quantized rest of the model.

In-block tuning with ``BlockTune(target="float")`` carries the float model's hidden states from
block to block, which holds only if the blocks form a simple chain: one list, consecutive
indices, each called once a forward with the hidden state as its first positional argument, and
the next block's hidden-state input equal to the block's output. The first three are checked up
front or at the float pass, the last one on the first captured call of every block after the
first (``_check_chain``); anything else raises instead of tuning towards wrong targets. With
``target="auto"`` a failed check is a warning instead: the block where it failed and every later
one tune towards their own float output ("own"), and ``info["block_tune_target"]`` says which
target was used ("float", "own", or "float+own" after a fallback midway).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from .blocktune import BlockTune, block_output, block_targets, float_targets, tune_block
from .calibration import _HessianTap


class _Stop(Exception):
    """Raised to end a forward pass early once the inputs we need are recorded."""


class _Capture(nn.Module):
    """Stands in for a block: records (args, kwargs) of each call, then stops the forward."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        object.__setattr__(self, "calls", [])

    def __getattr__(self, name: str) -> Any:  # the model may read the block's attributes
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "inner" or "inner" not in self:
                raise
            return getattr(self["inner"], name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((args, kwargs))
        raise _Stop


class _GroupTap(_HessianTap):
    """A Hessian tap that stops the block call once every tap of its group has fired."""

    def __init__(self, inner: nn.Module, fired: set, group_size: int) -> None:
        super().__init__(inner)
        object.__setattr__(self, "fired", fired)
        object.__setattr__(self, "group_size", group_size)

    def __call__(self, x: mx.array) -> mx.array:
        y = super().__call__(x)
        self.fired.add(id(self))
        if len(self.fired) >= self.group_size:
            raise _Stop
        return y


class _IdTap(nn.Module):
    """Records which input array object a Linear saw (to group Linears that share an input)."""

    def __init__(self, inner: nn.Module, path: str, log: list) -> None:
        super().__init__()
        self.inner = inner
        object.__setattr__(self, "path", path)
        object.__setattr__(self, "log", log)

    def __call__(self, x: mx.array) -> mx.array:
        self.log.append((self.path, x))
        return self.inner(x)


def block_path(path: str) -> str | None:
    """The longest proper prefix of ``path`` that ends in a list index, or None."""
    parts = path.split(".")
    for i in range(len(parts) - 2, -1, -1):
        if parts[i].isdigit():
            return ".".join(parts[: i + 1])
    return None


def _block_key(path: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in path.split("."))


def _swap(model: nn.Module, items: Sequence[tuple[str, nn.Module]]) -> None:
    model.update_modules(tree_unflatten(list(items)))


def capture_block_inputs(model: nn.Module, block: str, windows: mx.array, batch: int) -> list:
    """(args, kwargs) of every call of the module at ``block`` over ``windows``, in batches."""
    inner = dict(model.named_modules())[block]
    cap = _Capture(inner)
    _swap(model, [(block, cap)])
    try:
        for lo in range(0, windows.shape[0], batch):
            try:
                model(windows[lo : lo + batch])
            except _Stop:
                pass
            else:
                raise RuntimeError(f"{block} was not called by the model's forward")
    finally:
        _swap(model, [(block, inner)])
    calls = list(cap.calls)
    mx.eval([a for args, kwargs in calls for a in (*args, *kwargs.values()) if isinstance(a, mx.array)])
    return calls


def _call_block(block: nn.Module, calls: list) -> None:
    for args, kwargs in calls:
        try:
            out = block(*args, **kwargs)
        except _Stop:
            continue
        mx.eval(out)


def input_groups(model: nn.Module, block: str, paths: Sequence[str], calls: list) -> list[list[str]]:
    """The block's Linears at ``paths`` grouped by identical input, in the order they run."""
    modules = dict(model.named_modules())
    log: list = []
    taps = [(p, _IdTap(modules[p], p, log)) for p in paths]
    _swap(model, taps)
    try:
        _call_block(modules[block], calls[:1])
    finally:
        _swap(model, [(p, t.inner) for p, t in taps])
    groups: dict[int, list[str]] = {}
    for p, x in log:
        if not any(p in g for g in groups.values()):
            groups.setdefault(id(x), []).append(p)
    found = [g for g in groups.values()]
    missing = [p for p in paths if not any(p in g for g in found)]
    return found + [[p] for p in missing]  # never called in the block: alone, at the end


def group_hessians(model: nn.Module, block: str, group: Sequence[str], calls: list) -> dict[str, mx.array]:
    modules = dict(model.named_modules())
    fired: set = set()
    taps = [(p, _GroupTap(modules[p], fired, len(group))) for p in group]
    _swap(model, taps)
    try:
        for args, kwargs in calls:
            fired.clear()
            try:
                out = modules[block](*args, **kwargs)
                mx.eval(out)
            except _Stop:
                pass
            mx.eval([t.acc[0] for _, t in taps])
    finally:
        _swap(model, [(p, t.inner) for p, t in taps])
    return {p: t.acc[0] / max(1, t.acc[1]) for p, t in taps}


def _check_consecutive(blocks: Sequence[str]) -> None:
    """target="float" needs the blocks to be consecutive entries of one list."""
    parents = {b.rsplit(".", 1)[0] for b in blocks}
    idx = [int(b.rsplit(".", 1)[1]) for b in blocks]
    if len(parents) > 1 or idx != list(range(idx[0], idx[0] + len(idx))):
        raise ValueError(
            "BlockTune(target='float') needs the quantized blocks to be consecutive entries of one list "
            f"(a simple chain); got {list(blocks)}"
        )


def _check_chain(prev: str, prev_out: mx.array, block: str, calls: list) -> None:
    """target="float": the hidden state entering ``block`` must be ``prev``'s output (first call)."""
    x = calls[0][0][0] if calls[0][0] else None
    ok = isinstance(x, mx.array) and x.shape == prev_out.shape
    if ok and x is not None:
        num = float(mx.sum(mx.square(x.astype(mx.float32) - prev_out.astype(mx.float32))))
        ok = num <= 1e-6 * max(float(mx.sum(mx.square(prev_out.astype(mx.float32)))), 1e-30)
    if not ok:
        raise RuntimeError(
            f"BlockTune(target='float'): the hidden-state input of {block} is not the output of {prev}, so "
            "the blocks are not a simple chain and the float hidden states cannot be carried forward; "
            "use target='own'"
        )


def quantize_sequential(
    model: nn.Module,
    targets: Sequence[tuple[str, nn.Module]],
    windows: mx.array,
    quantize_one: Callable[[str, nn.Module, mx.array], nn.Module],
    batch: int = 4,
    on_hessians: Callable[[str, mx.array], None] | None = None,
    block_tune: BlockTune | None = None,
    on_tune: Callable[[str, list[str], dict], None] | None = None,
    info: dict | None = None,
) -> list[tuple[str, nn.Module]]:
    """Quantize ``targets`` (path, Linear) in model order; returns the (path, new layer) swaps.

    quantize_one(path, linear, hessian) -> the quantized layer; it is swapped in before the next
    Hessian is collected. on_hessians(path, H) sees every Hessian used (for tests and logging).
    block_tune: after each group, tune the block towards its float output (``blocktune.py``;
    with target="float", the float model's hidden state after the block);
    on_tune(block, group, stats) sees each stage's relative output error before/after.
    """
    by_block: dict[str | None, list[str]] = {}
    linears = dict(targets)
    for path, _ in targets:
        by_block.setdefault(block_path(path), []).append(path)
    blocks = sorted((b for b in by_block if b is not None), key=_block_key)
    swapped: list[tuple[str, nn.Module]] = []

    def do(path: str, hessian: mx.array) -> None:
        if on_hessians is not None:
            on_hessians(path, hessian)
        layer = quantize_one(path, linears[path], hessian)
        swapped.append((path, layer))
        _swap(model, [(path, layer)])

    auto = block_tune is not None and block_tune.target == "auto"
    float_target = block_tune is not None and block_tune.target in ("float", "auto")
    used: list[str] = []  # the targets used, in order ("float", then "own" after a fallback)

    def fall_back(err: Exception) -> None:
        nonlocal float_target
        if not auto:
            raise err
        warnings.warn(f"{err}; in-block tuning falls back to target='own' from here", stacklevel=3)
        float_target = False

    if float_target and blocks:
        try:
            _check_consecutive(blocks)
        except ValueError as err:
            fall_back(err)
    float_h: list[mx.array] | None = None  # target="float": the float model's hidden states after the last block
    prev_out = None  # target="float": the finished previous block's output on its first call

    for bi, block in enumerate(blocks):
        calls = capture_block_inputs(model, block, windows, batch)
        block_module = dict(model.named_modules())[block]
        outputs = None
        if float_target and prev_out is not None:
            try:
                _check_chain(blocks[bi - 1], prev_out, block, calls)
            except RuntimeError as err:
                fall_back(err)
                float_h = prev_out = None
        if float_target:
            if float_h is None:  # the first block: nothing before it is quantized yet
                float_h = [args[0] if args else None for args, _ in calls]  # type: ignore[misc]
            # block i is still float here (earlier stages only touched blocks < i): its output on
            # the float inputs is the float model's hidden state after it, the target of block i
            # and the float input of block i + 1
            outputs = float_targets(block_module, calls, float_h, block)
        elif block_tune is not None:
            outputs = block_targets(block_module, calls)
        if block_tune is not None:
            kind = "float" if float_target else "own"
            if not used or used[-1] != kind:
                used.append(kind)
        done: list[str] = []
        for group in input_groups(model, block, by_block[block], calls):
            hessians = group_hessians(model, block, group, calls)
            for path in group:
                do(path, hessians[path])
            done.extend(group)
            rest = [p for p in by_block[block] if p not in done]
            if block_tune is not None and outputs is not None and (rest or block_tune.tune_last):
                stats = tune_block(block_module, block, rest, done, calls, outputs, block_tune, seed=bi)
                if on_tune is not None:
                    on_tune(block, list(group), stats)
        if float_target and bi + 1 < len(blocks):
            args, kwargs = calls[0]
            prev_out = block_output(block_module(*args, **kwargs))
            mx.eval(prev_out)
        del calls, outputs
    rest = by_block.get(None, [])
    if rest:
        from .calibration import collect_hessians

        hessians = collect_hessians(model, windows, rest)
        for path in rest:
            do(path, hessians[path])
    if info is not None and used:
        info["block_tune_target"] = "+".join(used)
    return swapped
