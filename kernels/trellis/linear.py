"""TrellisLinear, and swapping it into any mlx-lm model: quantize, save, load.

A quantized model directory is an ordinary mlx-lm directory whose ``config.json`` carries

    "quantization": {"method": "trellis", "bits": K, "L": L, "code": "1mad", "max_block": 256, ...}

and whose safetensors hold, for every quantized Linear at path ``p``, ``p.packed`` (uint32),
``p.scales`` (float16), ``p.signs`` (int8) and ``p.bias`` if it had one, beside the model's other
(unquantized) parameters. mlx-lm's own loader does not know this method: load such a directory
with ``load_model`` below, or build the model yourself and call ``load_hook``.
"""

from __future__ import annotations

import glob
import json
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from .bitshift import block_size_for
from .matvec import MAX_FUSED_BATCH, compile_decode, fused_backend, fused_decode
from .quantizer import (
    TrellisSpec,
    TrellisWeight,
    can_quantize,
    dequantize,
    dequantize_rotated,
    quantize_weight,
    rotate,
)

METHOD = "trellis"
DEFAULT_SKIP = ("lm_head",)


class TrellisLinear(nn.Module):
    """A Linear layer whose weight is trellis-coded (see ``quantizer.py`` for the format)."""

    def __init__(
        self,
        input_dims: int,
        output_dims: int,
        bits: int,
        L: int,
        code: str = "1mad",
        block: int | None = None,
        bias: bool = False,
    ) -> None:
        super().__init__()
        block = block or block_size_for(input_dims)
        if block is None:
            raise ValueError(f"no trellis block length divides {input_dims}")
        self.bits, self.L, self.code, self.block = bits, L, code, block
        self.packed = mx.zeros((output_dims, input_dims * bits // 32), dtype=mx.uint32)
        self.scales = mx.zeros((output_dims,), dtype=mx.float16)
        self.signs = mx.ones((input_dims,), dtype=mx.int8)
        if bias:
            self.bias = mx.zeros((output_dims,))

    @property
    def input_dims(self) -> int:
        return int(self.signs.shape[0])

    @property
    def output_dims(self) -> int:
        return int(self.packed.shape[0])

    def trellis_weight(self) -> TrellisWeight:
        return TrellisWeight(self.packed, self.scales, self.signs, self.bits, self.L, self.block, self.code)

    def dense_weight(self) -> mx.array:
        """The dense float32 weight this layer stands for (for inspection and tests)."""
        return dequantize(self.trellis_weight())

    def dense_rotated(self) -> mx.array:
        """W~ dense float32, cached on the module when ``cache_dense`` is set (CPU default)."""
        cached = self.__dict__.get("_dense")
        if cached is not None and cached[0] is self.packed and cached[1] is self.scales:
            return cached[2]
        dense = dequantize_rotated(self.trellis_weight())
        if self.cache_dense:
            mx.eval(dense)
            # object.__setattr__: a plain attribute, so the cache is not a parameter (not saved).
            object.__setattr__(self, "_dense", (self.packed, self.scales, dense))
        return dense

    @property
    def cache_dense(self) -> bool:
        """Keep the dequantized W~ when there is no fused kernel (CPU): speed over memory there."""
        return fused_backend() is None

    def _signs_f32(self) -> mx.array:
        cached = self.__dict__.get("_signs32")
        if cached is None or cached[0] is not self.signs:
            cached = (self.signs, self.signs.astype(mx.float32))
            object.__setattr__(self, "_signs32", cached)
        return cached[1]

    def _decode_fn(self, backend: str):
        """matvec.fused_decode for this layer (kept on the module: one tuple compare a call)."""
        compiled = compile_decode(backend)
        has_bias = "bias" in self
        cached = self.__dict__.get("_decode")
        if cached is None or cached[:3] != (backend, compiled, has_bias):
            fn = fused_decode(self.bits, self.L, self.block, self.code, backend, has_bias, compiled)
            cached = (backend, compiled, has_bias, fn)
            object.__setattr__(self, "_decode", cached)
        return cached[3]

    def __call__(self, x: mx.array) -> mx.array:
        rows = x.size // self.input_dims
        backend = fused_backend() if rows <= MAX_FUSED_BATCH else None
        if backend is not None:
            # decode path: sign flip, Hadamard, one kernel (any leading shape, output in x's
            # dtype), as one mx.compile'd function on CUDA (matvec.COMPILED_BACKENDS)
            fn = self._decode_fn(backend)
            if "bias" in self:
                return fn(x, self._signs_f32(), self.packed, self.scales, self.bias)
            return fn(x, self._signs_f32(), self.packed, self.scales)
        y = rotate(x, self._signs_f32()) @ self.dense_rotated().T
        if "bias" in self:
            y = y + self.bias.astype(mx.float32)
        return y.astype(x.dtype)

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        spec: TrellisSpec,
        key: mx.array | None = None,
        progress: Callable[[int], None] | None = None,
        hessian: mx.array | None = None,
    ) -> TrellisLinear:
        out_dims, in_dims = linear.weight.shape
        has_bias = "bias" in linear
        w = quantize_weight(linear.weight, spec, key=key, progress=progress, hessian=hessian)
        layer = cls(in_dims, out_dims, spec.bits, spec.L, spec.code, w.block, bias=has_bias)
        layer.packed, layer.scales, layer.signs = w.packed, w.scales, w.signs
        if has_bias:
            layer.bias = linear.bias
        return layer

    def _extra_repr(self) -> str:
        return f"{self.input_dims}, {self.output_dims}, bits={self.bits}, L={self.L}, code={self.code}, block={self.block}"


def spec_from_config(qconfig: dict[str, Any]) -> TrellisSpec:
    return TrellisSpec(
        bits=int(qconfig["bits"]),
        L=int(qconfig["L"]),
        code=str(qconfig.get("code", "1mad")),
        max_block=int(qconfig.get("max_block", 256)),
        wrap_window=qconfig.get("wrap_window", 64),
    )


def quantizable_linears(
    model: nn.Module, spec: TrellisSpec, skip: Iterable[str] = DEFAULT_SKIP
) -> list[tuple[str, nn.Linear]]:
    """Plain Linear layers the trellis format can hold (row length OK), minus skipped names."""
    skip = tuple(skip)
    found = []
    for path, module in model.named_modules():
        if type(module) is not nn.Linear:
            continue
        if any(path == s or path.endswith("." + s) for s in skip):
            continue
        if can_quantize(int(module.weight.shape[1]), spec):
            found.append((path, module))
    return sorted(found)


def quantize_model(
    model: nn.Module,
    bits: int,
    L: int = 16,
    *,
    code: str = "1mad",
    max_block: int = 256,
    seed: int = 0,
    skip: Iterable[str] = DEFAULT_SKIP,
    only: Callable[[str], bool] | None = None,
    progress: Callable[[int], None] | None = None,
    hessians: dict[str, mx.array] | None = None,
    calibration: mx.array | None = None,
    calibration_batch: int = 4,
    block_tune: Any = None,
    on_tune: Callable[[str, list[str], dict], None] | None = None,
) -> dict[str, Any]:
    """Quantize the model's Linear layers in place; returns the config's "quantization" entry.

    only: optional filter on module paths (e.g. to quantize a few layers in a quick test).
    progress(n): called with the number of weights just quantized.
    hessians: optional E[x x^T] per module path (``calibration.collect_hessians``, from the float
    model): those layers are quantized with BlockLDLQ.
    calibration: optional token windows (n, length): sequential BlockLDLQ instead, every layer's
    Hessian collected on these windows from the outputs of the already-quantized earlier layers
    (``sequential.py``). Run the model in float32 on a CPU (MLX's CPU matmuls are fast there).
    block_tune: a ``blocktune.BlockTune`` (needs ``calibration``): after each group of a block is
    quantized, tune the block's remaining float Linears, the quantized ones' gains and signs and
    the block's norms towards the float block's output (``block_tune.target``: on its own inputs,
    or the float model's hidden state); on_tune(block, group, stats) logs it. The entry records
    the target used ("float", "own", or "float+own" where "auto" fell back midway).
    """
    if hessians is not None and calibration is not None:
        raise ValueError("pass hessians (from the float model) or calibration windows, not both")
    if block_tune is not None and calibration is None:
        raise ValueError("block_tune needs calibration windows (sequential quantization)")
    spec = TrellisSpec(bits=bits, L=L, code=code, max_block=max_block)
    info: dict[str, Any] = {}
    targets = [(p, m) for p, m in quantizable_linears(model, spec, skip) if only is None or only(p)]
    keys = {path: mx.random.key(seed * 100003 + index) for index, (path, _) in enumerate(targets)}

    def quantize_one(path: str, linear: Any, hessian: mx.array | None) -> nn.Module:
        return TrellisLinear.from_linear(linear, spec, key=keys[path], progress=progress, hessian=hessian)

    if calibration is not None:
        from .sequential import quantize_sequential

        swapped = quantize_sequential(
            model, targets, calibration, quantize_one, batch=calibration_batch, block_tune=block_tune,
            on_tune=on_tune, info=info,
        )
    else:
        swapped = []
        for path, linear in targets:
            hessian = None if hessians is None else hessians.get(path)
            swapped.append((path, quantize_one(path, linear, hessian)))
            model.update_modules(tree_unflatten(swapped[-1:]))
    return {
        "method": METHOD,
        "bits": bits,
        "L": L,
        "code": code,
        "max_block": max_block,
        "wrap_window": spec.wrap_window,
        "seed": seed,
        "num_layers": len(swapped),
        "ldlq": hessians is not None or calibration is not None,
        "sequential": calibration is not None,
        **({"block_tune": {"steps": block_tune.steps, "lr": block_tune.lr,
                           "target": info.get("block_tune_target", block_tune.target)}}
           if block_tune is not None else {}),
    }


def quantizable_size(model: nn.Module, spec: TrellisSpec, skip: Iterable[str] = DEFAULT_SKIP) -> int:
    return sum(int(m.weight.size) for _, m in quantizable_linears(model, spec, skip))


def is_trellis_config(config: dict[str, Any]) -> bool:
    q = config.get("quantization")
    return isinstance(q, dict) and q.get("method") == METHOD


def _load_weights(weights_dir: Path) -> dict[str, mx.array]:
    files = sorted(glob.glob(str(Path(weights_dir) / "model*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no model*.safetensors in {weights_dir}")
    weights: dict[str, mx.array] = {}
    for f in files:
        weights.update(cast(dict[str, mx.array], mx.load(f)))  # safetensors: a dict
    return weights


def apply_trellis(model: nn.Module, qconfig: dict[str, Any], weights: dict[str, mx.array]) -> nn.Module:
    """Swap every Linear that has ``p.packed`` in ``weights`` for an (unfilled) TrellisLinear.

    Shapes and bits come from the tensors themselves (n_in = len(signs), K = 32*words/n_in), so
    layers may differ in bits; L, code and max_block come from the config.
    """
    swaps = []
    modules = dict(model.named_modules())
    for name, packed in weights.items():
        if not name.endswith(".packed"):
            continue
        path = name[: -len(".packed")]
        if path not in modules:
            raise KeyError(f"trellis weights for {path!r}, which the model does not have")
        n_out, words = packed.shape
        n_in = int(weights[f"{path}.signs"].shape[0])
        bits = words * 32 // n_in
        block = block_size_for(n_in, int(qconfig.get("max_block", 256)))
        layer = TrellisLinear(
            n_in, n_out, bits, int(qconfig["L"]), str(qconfig.get("code", "1mad")), block, bias=f"{path}.bias" in weights
        )
        swaps.append((path, layer))
    if swaps:
        model.update_modules(tree_unflatten(swaps))
    return model


def load_hook(model: nn.Module, config: dict[str, Any], weights_dir: Path) -> nn.Module:
    """Make ``model`` (built from ``config``, weights loaded or not) a trellis model from disk.

    Swaps in TrellisLinear layers, loads every parameter from ``weights_dir/model*.safetensors``
    (strictly), evaluates them and returns the model (the same object, changed in place).
    """
    if not is_trellis_config(config):
        raise ValueError('config has no "quantization": {"method": "trellis", ...}')
    weights = _load_weights(Path(weights_dir))
    apply_trellis(model, config["quantization"], weights)
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    model.eval()
    return model


def load_model(model_dir: Path | str) -> tuple[nn.Module, dict[str, Any]]:
    """Load a trellis model directory with mlx-lm's model classes plus ``load_hook``."""
    from mlx_lm.utils import load_model as mlx_lm_load_model

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    # Hide our "quantization" entry from mlx-lm, which would try to affine-quantize.
    model, _ = mlx_lm_load_model(
        model_dir, lazy=True, strict=False, model_config={"quantization": None, "quantization_config": None}
    )
    return load_hook(model, config, model_dir), config


def save_model(model: nn.Module, config: dict[str, Any], dst: Path | str, src: Path | str | None = None) -> None:
    """Write weights (mlx-lm's file layout) and config.json to ``dst``; copy tokenizer etc. from ``src``.

    (mlx-lm's own ``save_model`` counts parameters assuming its affine layers, so we write the
    shards ourselves.)
    """
    from mlx_lm.utils import make_shards

    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    if src is not None:
        for f in Path(src).iterdir():
            if f.is_file() and not (f.name.endswith(".safetensors") or f.name in ("config.json", "model.safetensors.index.json")):
                shutil.copy2(f, dst / f.name)
    for old in dst.glob("model*.safetensors"):
        old.unlink()
    weights = dict(tree_flatten(model.parameters()))
    shards = make_shards(weights)
    pattern = "model-{:05d}-of-{:05d}.safetensors" if len(shards) > 1 else "model.safetensors"
    weight_map = {}
    for i, shard in enumerate(shards):
        name = pattern.format(i + 1, len(shards))
        mx.save_safetensors(str(dst / name), shard, metadata={"format": "mlx"})
        weight_map.update({k: name for k in shard})
    index = {
        "metadata": {"total_size": sum(v.nbytes for v in weights.values())},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    config = dict(config)
    config.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(dict(sorted(config.items())), indent=2) + "\n")


def trellis_layers(model: nn.Module) -> list[tuple[str, TrellisLinear]]:
    return [(p, m) for p, m in model.named_modules() if isinstance(m, TrellisLinear)]


def bits_per_weight(model: nn.Module) -> float:
    """Stored bits per quantized weight, scales and signs included."""
    layers = [m for _, m in trellis_layers(model)]
    num = sum(m.packed.nbytes + m.scales.nbytes + m.signs.nbytes for m in layers) * 8
    den = sum(m.input_dims * m.output_dims for m in layers)
    return num / den if den else 0.0


__all__ = [
    "TrellisLinear",
    "apply_trellis",
    "bits_per_weight",
    "is_trellis_config",
    "load_hook",
    "load_model",
    "quantizable_size",
    "quantize_model",
    "save_model",
    "spec_from_config",
    "trellis_layers",
]
