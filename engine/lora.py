"""LoRA adapters served on top of one base model, selected per row inside the forward pass.

An adapter is a directory in mlx-lm's format (what `mlx_lm.lora` writes):

* `adapter_config.json`: `fine_tune_type` ("lora"; "dora" and "full" are refused),
  `num_layers` (the last N transformer blocks; -1 = all), `lora_parameters` with `rank`,
  `scale` and optionally `keys` (module names inside a block; default: every Linear in a block)
  and `dropout` (ignored: inference);
* `adapters.safetensors`: per adapted module `<module path>.lora_a` [in, rank] and
  `<module path>.lora_b` [rank, out], so that the module computes
  `base(x) + scale * (x @ lora_a) @ lora_b`.

`install(model, adapters)` stacks every adapter's matrices per module, zero-padded to the
largest rank, with row 0 all zeros ("no adapter") and the scale folded into B:
`A [N + 1, in, R]`, `B [N + 1, R, out]`. Each adapted module (a Linear or QuantizedLinear,
including the classes the loader swaps in) gets a subclass whose call adds
`gather_mm(gather_mm(x, A, idx), B, idx)` to the base output, where `idx` [rows] is the
per-row adapter index the runner sets before every forward (`AdapterSet.select`). When no row
of a forward has an adapter, `idx` is None and the module computes exactly its base output, so
base-only traffic pays nothing. Parameters, names and the base weights are untouched (the
stacks are plain attributes, not parameters).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

NO_ADAPTER = 0  # the per-row index of a row without an adapter
_ATTACHED = "_mlxd_adapters"  # the model attribute that holds its AdapterSet


class AdapterError(ValueError):
    """An adapter that cannot be served on this base model (the message says why)."""


@dataclass(slots=True)
class Adapter:
    """One adapter as read from disk: per module path, (lora_a [in, r], lora_b [r, out])."""

    name: str
    path: Path
    rank: int
    scale: float
    num_layers: int
    keys: tuple[str, ...] | None
    weights: dict[str, tuple[mx.array, mx.array]] = field(default_factory=dict)


def read_adapter(name: str, path: str | Path) -> Adapter:
    """Read an mlx-lm adapter directory (config + weights), checking its own consistency."""
    root = Path(path).expanduser()
    where = f"adapter {name!r} ({root})"
    cfg_file, weights_file = root / "adapter_config.json", root / "adapters.safetensors"
    if not cfg_file.is_file() or not weights_file.is_file():
        raise AdapterError(f"{where}: needs adapter_config.json and adapters.safetensors")
    cfg = json.loads(cfg_file.read_text())
    kind = cfg.get("fine_tune_type", "lora")
    if kind != "lora":
        raise AdapterError(f"{where}: fine_tune_type {kind!r} is not supported (only 'lora')")
    lora = cfg.get("lora_parameters") or {}
    if "rank" not in lora or "scale" not in lora:
        raise AdapterError(f"{where}: lora_parameters needs 'rank' and 'scale'")
    keys = lora.get("keys")
    adapter = Adapter(name, root, int(lora["rank"]), float(lora["scale"]),
                      int(cfg.get("num_layers", -1)), tuple(keys) if keys else None)
    raw = mx.load(str(weights_file))
    assert isinstance(raw, dict)
    halves: dict[str, dict[str, mx.array]] = {}
    for key, value in raw.items():
        module, _, leaf = key.rpartition(".")
        if leaf not in ("lora_a", "lora_b") or not module:
            raise AdapterError(f"{where}: {key!r} is not a LoRA weight (lora_a / lora_b)")
        halves.setdefault(module, {})[leaf] = value
    for module, pair in sorted(halves.items()):
        if set(pair) != {"lora_a", "lora_b"}:
            raise AdapterError(f"{where}: {module} has only {sorted(pair)}")
        a, b = pair["lora_a"], pair["lora_b"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != adapter.rank or b.shape[0] != adapter.rank:
            raise AdapterError(f"{where}: {module}: lora_a {a.shape} / lora_b {b.shape} do not "
                               f"have rank {adapter.rank}")
        adapter.weights[module] = (a, b)
    if not adapter.weights:
        raise AdapterError(f"{where}: adapters.safetensors holds no LoRA weights")
    return adapter


def linear_dims(module: Any) -> tuple[int, int] | None:
    """(in, out) of a Linear or QuantizedLinear (or a subclass); None for anything else."""
    if isinstance(module, nn.QuantizedLinear):
        out, packed = module.weight.shape
        return packed * 32 // module.bits, out
    if isinstance(module, nn.Linear):
        out, inp = module.weight.shape
        return inp, out
    return None


def allowed_modules(model: Any, adapter: Adapter) -> set[str]:
    """The module paths mlx-lm would adapt for this config: in the last `num_layers` blocks,
    those named by `keys` (default: every Linear of the block)."""
    modules = dict(model.named_modules())
    layers = list(model.layers)
    first = 0 if adapter.num_layers < 0 else max(len(layers) - adapter.num_layers, 0)
    blocks = {id(layer) for layer in layers[first:]}
    prefixes = [path for path, m in modules.items() if id(m) in blocks]
    out: set[str] = set()
    for prefix in prefixes:
        for path, m in modules.items():
            if not path.startswith(prefix + "."):
                continue
            rel = path[len(prefix) + 1:]
            if (rel in adapter.keys) if adapter.keys else linear_dims(m) is not None:
                out.add(path)
    return out


def check_fits(model: Any, adapter: Adapter) -> None:
    """Every adapted module exists in the base, is a Linear inside the config's layer set,
    and has the shapes of the base's layer: else one AdapterError naming the first misfit."""
    modules = dict(model.named_modules())
    allowed = allowed_modules(model, adapter)
    where = f"adapter {adapter.name!r} ({adapter.path})"
    for path, (a, b) in adapter.weights.items():
        module = modules.get(path)
        if module is None:
            raise AdapterError(f"{where}: the base model has no module {path}")
        dims = linear_dims(module)
        if dims is None:
            raise AdapterError(f"{where}: {path} is a {type(module).__name__}; only Linear and "
                               "QuantizedLinear layers take adapters")
        if path not in allowed:
            raise AdapterError(f"{where}: {path} is outside the layers its config adapts "
                               f"(num_layers={adapter.num_layers}, keys={adapter.keys})")
        if (a.shape[0], b.shape[1]) != dims:
            raise AdapterError(f"{where}: {path} is {dims[0]} -> {dims[1]} in the base, "
                               f"the adapter's is {a.shape[0]} -> {b.shape[1]}")


@dataclass(slots=True)
class AdapterSet:
    """The adapters installed on a model and the rows of the forward about to run."""

    names: tuple[str, ...]  # index i + 1 is names[i]; 0 is "no adapter"
    rows: mx.array | None = None  # [B] uint32 per-row index of the next forward (None: none)

    def index_of(self, name: str | None) -> int:
        """The index of an adapter by name (None -> 0); KeyError for an unknown name."""
        if name is None:
            return NO_ADAPTER
        return self.names.index(name) + 1 if name in self.names else _unknown(name)

    def select(self, rows: mx.array | None) -> None:
        """Set the per-row indices the next forward uses ([B] uint32, or None: no adapters)."""
        self.rows = rows


def _unknown(name: str) -> int:
    raise KeyError(name)


@dataclass(slots=True)
class _Stacks:
    a: mx.array  # [N + 1, in, R]
    b: mx.array  # [N + 1, R, out], the scale folded in
    owner: AdapterSet


class _LoraCall:
    """Mixed in front of a Linear class: base output plus the rows' gathered low-rank terms."""

    _lora: _Stacks

    def __call__(self, x: mx.array) -> mx.array:
        y = super().__call__(x)  # type: ignore[misc]
        idx = self._lora.owner.rows
        if idx is None:
            return y
        flat = x.ndim != 3  # [rows, tokens, in] is the engine's shape
        xb = x.reshape(idx.shape[0], -1, x.shape[-1]) if flat else x
        z = mx.gather_mm(mx.gather_mm(xb, self._lora.a, rhs_indices=idx), self._lora.b,
                         rhs_indices=idx)
        z = z.reshape(y.shape) if flat else z
        return y + (z if z.dtype == y.dtype else z.astype(y.dtype))


_CLASSES: dict[type, type] = {}


def _lora_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Lora{cls.__name__}", (_LoraCall, cls), {})
    return _CLASSES[cls]


def _dtype_of(module: Any) -> mx.Dtype:
    return module.scales.dtype if isinstance(module, nn.QuantizedLinear) else module.weight.dtype


def _stack(adapters: Sequence[Adapter], path: str, dims: tuple[int, int],
           rank: int, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
    inp, out = dims
    a_rows, b_rows = [mx.zeros((inp, rank), dtype)], [mx.zeros((rank, out), dtype)]
    for ad in adapters:
        a, b = ad.weights.get(path, (None, None))
        if a is None or b is None:
            a_rows.append(mx.zeros((inp, rank), dtype))
            b_rows.append(mx.zeros((rank, out), dtype))
            continue
        pad = rank - ad.rank
        a_rows.append(mx.pad(a.astype(dtype), [(0, 0), (0, pad)]))
        b_rows.append(mx.pad((ad.scale * b.astype(mx.float32)).astype(dtype), [(0, pad), (0, 0)]))
    return mx.stack(a_rows), mx.stack(b_rows)


def install(model: Any, adapters: Sequence[Adapter]) -> AdapterSet:
    """Check every adapter against `model`, then install them all (see the module docstring).
    Call after the model's dtype is final. Returns the set (also `attached(model)`)."""
    names = [ad.name for ad in adapters]
    if len(set(names)) != len(names):
        raise AdapterError(f"adapter names must be distinct: {names}")
    for ad in adapters:
        check_fits(model, ad)
    owner = AdapterSet(tuple(names))
    modules = dict(model.named_modules())
    rank = max((ad.rank for ad in adapters), default=0)
    paths = sorted({p for ad in adapters for p in ad.weights})
    for path in paths:
        module = modules[path]
        dims = linear_dims(module)
        assert dims is not None  # check_fits
        a, b = _stack(adapters, path, dims, rank, _dtype_of(module))
        mx.eval(a, b)
        module.__class__ = _lora_class(type(module))
        object.__setattr__(module, "_lora", _Stacks(a, b, owner))
    object.__setattr__(model, _ATTACHED, owner)
    return owner


def attached(model: Any) -> AdapterSet | None:
    """The AdapterSet installed on `model` (None: no adapters)."""
    found = getattr(model, _ATTACHED, None)
    return found if isinstance(found, AdapterSet) else None


def load(model: Any, specs: Sequence[tuple[str, str]]) -> AdapterSet | None:
    """Read and install `(name, path)` adapters on `model` (None when there are none)."""
    if not specs:
        return None
    return install(model, [read_adapter(name, path) for name, path in specs])

