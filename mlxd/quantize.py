"""``mlxd quantize --bits K SRC DST [--calibration FILE] [--recipe FILE]``: a trellis-quantized
model directory.

SRC is an mlx-lm model directory with float weights; DST gets the same layout plus
``"quantization": {"method": "trellis", ...}`` in config.json (docs/trellis.md). Without
``--calibration`` every layer is quantized on its own; with a calibration file (jsonl of
``{"text": ...}`` or ``{"messages": [...]}`` records) the layers are quantized with sequential
BlockLDLQ on its activations, tuned inside each block, then fine-tuned end to end. Keep the
calibration text apart from any text you evaluate on.

Everything else is a `Recipe`: the trellis (L, code, largest block, seed, layers left in
float), the calibration windows, the in-block tuning and the fine-tuning. Its defaults are
what the CLI uses; ``--recipe FILE`` (TOML or JSON, any subset of the keys) changes them, and
``--print-recipe`` writes the defaults as a TOML file to start from. Unknown keys and values
of the wrong type or range are refused with the key's name. The CLI entry point (mlxd/cli.py)
calls ``main(argv)``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from kernels import device as _blas

_blas.load()  # before mlx: float32 matmuls through OpenBLAS on Linux CPUs

BITS = (2, 3, 4)


class RecipeError(ValueError):
    """A recipe file that cannot be used: the message names the file and the key."""


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(what)


@dataclass(slots=True, frozen=True)
class Calibration:
    """Token windows the Hessians are collected on (sequential: from the already-quantized
    layers' outputs, as GPTQ does; else from the float model)."""

    windows: int = 64
    length: int = 512
    sequential: bool = True

    def __post_init__(self) -> None:
        _check(self.windows >= 1, f"windows must be >= 1, got {self.windows}")
        _check(self.length >= 2, f"length must be >= 2, got {self.length}")


@dataclass(slots=True, frozen=True)
class BlockTuning:
    """Adam steps after each quantized group of a block (its remaining float Linears, the
    quantized ones' gains and signs, its norms); sequential calibration only. target: "float"
    (the float model's hidden state after the block), "own" (the float block's output on its
    quantized-prefix inputs) or "auto" ("float" where the blocks form a simple chain)."""

    steps: int = 16
    lr: float = 1e-3
    target: str = "auto"

    def __post_init__(self) -> None:
        _check(self.steps >= 0, f"steps must be >= 0, got {self.steps}")
        _check(math.isfinite(self.lr) and self.lr > 0, f"lr must be > 0, got {self.lr}")
        from kernels.trellis.blocktune import TARGETS

        _check(self.target in TARGETS, f"target must be one of {', '.join(TARGETS)}, got {self.target!r}")


@dataclass(slots=True, frozen=True)
class Finetuning:
    """Adam steps of end-to-end fine-tuning after quantization (row gains, signs, norms),
    distilled from the float model on `windows` calibration windows of `length` tokens."""

    steps: int = 300
    windows: int = 512
    length: int = 256
    batch: int = 4
    lr: float = 1e-3
    signs: bool = True  # train the signs as real values (stored float16); False keeps them +-1

    def __post_init__(self) -> None:
        _check(self.steps >= 0, f"steps must be >= 0, got {self.steps}")
        for name in ("windows", "length", "batch"):
            _check(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        _check(math.isfinite(self.lr) and self.lr > 0, f"lr must be > 0, got {self.lr}")


@dataclass(slots=True, frozen=True)
class Recipe:
    """How `mlxd quantize` quantizes, beside the bits and the calibration file."""

    L: int | None = field(default=None, metadata={"type": int})  # None: 16 on a GPU, 12 on a CPU
    code: str = "1mad"
    max_block: int = 256  # largest block length T (a power of two, 32..256)
    seed: int = 0  # of the random Hadamard signs
    skip: tuple[str, ...] = ("lm_head",)  # module names (or suffixes) left in float
    calibration: Calibration = field(default_factory=Calibration)
    block_tune: BlockTuning = field(default_factory=BlockTuning)
    finetune: Finetuning = field(default_factory=Finetuning)

    def __post_init__(self) -> None:
        from kernels.trellis.bitshift import BLOCK_SIZES
        from kernels.trellis.codes import CODES

        _check(self.L is None or 5 <= self.L <= 16, f"L must be in 5..16, got {self.L}")
        _check(self.code in CODES, f"code must be one of {', '.join(CODES)}, got {self.code!r}")
        _check(self.max_block in BLOCK_SIZES, f"max_block must be one of {sorted(BLOCK_SIZES)}, got {self.max_block}")


_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string", tuple: "a list of strings"}


def _value(value: Any, kind: type, where: str) -> Any:
    """`value` checked against `kind`, the type of the field's default (or its declared type)."""
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif kind is tuple:
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
        value = tuple(value) if ok else value
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise RecipeError(f"{where} must be {_KINDS.get(kind, kind.__name__)}, got {value!r}")
    return value


def _build(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise RecipeError(f"{where} must be a table of keys, got {data!r}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise RecipeError(f"{where}: unknown key {', '.join(map(repr, unknown))} (known: {', '.join(known)})")
    defaults = cls()
    kwargs = {}
    for key, value in data.items():
        at = f"{where}.{key}" if where != "recipe" else key
        default = getattr(defaults, key)
        if is_dataclass(default):
            kwargs[key] = _build(type(default), value, at)
        elif value is None and default is None:
            kwargs[key] = None
        else:
            kind = known[key].metadata.get("type", type(default))
            kwargs[key] = _value(value, kind, at)
    try:
        return cls(**kwargs)
    except ValueError as exc:
        raise RecipeError(f"{where}: {exc}" if where != "recipe" else str(exc)) from None


def recipe_from_dict(data: Any) -> Recipe:
    """A `Recipe` from parsed TOML or JSON: the defaults, with the keys `data` sets."""
    return _build(Recipe, data, "recipe")


def load_recipe(path: Path) -> Recipe:
    """Read a recipe file: TOML (``.toml``) or JSON (anything else)."""
    import tomllib

    try:
        text = Path(path).read_text()
        data = tomllib.loads(text) if Path(path).suffix == ".toml" else json.loads(text)
    except (OSError, ValueError) as exc:
        raise RecipeError(f"{path}: {exc}") from None
    try:
        return recipe_from_dict(data)
    except RecipeError as exc:
        raise RecipeError(f"{path}: {exc}") from None


def recipe_toml(recipe: Recipe | None = None) -> str:
    """`recipe` (default: the defaults) as a TOML file `load_recipe` reads back."""
    recipe = recipe or Recipe()

    def line(key: str, value: Any) -> str:
        if isinstance(value, tuple):
            return f"{key} = [{', '.join(json.dumps(v) for v in value)}]"
        return f"{key} = {json.dumps(value)}"

    top = ["# mlxd quantize recipe: every key is optional (the defaults are shown)"]
    tables = []
    for f in fields(recipe):
        value = getattr(recipe, f.name)
        if is_dataclass(value):
            tables += ["", f"[{f.name}]", *(line(g.name, getattr(value, g.name)) for g in fields(value))]
        elif value is None:
            top.append(f"# {f.name} = 16  (unset: 16 on a GPU, 12 on a CPU)")
        else:
            top.append(line(f.name, value))
    return "\n".join(top + tables) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlxd quantize",
        usage="%(prog)s --bits K SRC DST [--calibration FILE] [--recipe FILE] [--no-progress]\n"
              "       %(prog)s --print-recipe",
        description="Quantize a model's Linear layers to trellis codes (QTIP-style).",
    )
    p.add_argument("src", type=Path, nargs="?", help="mlx-lm model directory (float weights)")
    p.add_argument("dst", type=Path, nargs="?", help="output directory")
    p.add_argument("--bits", type=int, choices=BITS, help="bits per weight")
    p.add_argument("--calibration", type=Path, metavar="FILE",
                   help="jsonl of {text} / {messages} records: BlockLDLQ on their activations, "
                        "then in-block tuning and fine-tuning")
    p.add_argument("--recipe", type=Path, metavar="FILE",
                   help="TOML or JSON file with the trellis, calibration and tuning settings")
    p.add_argument("--print-recipe", action="store_true", help="print the default recipe (TOML) and exit")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def default_L() -> int:
    import mlx.core as mx

    return 16 if mx.default_device() == mx.gpu else 12


def quantize_dir(
    src: Path,
    dst: Path,
    bits: int,
    recipe: Recipe | None = None,
    *,
    calibration: Path | None = None,
    progress: bool = True,
    only: Callable[[str], bool] | None = None,
) -> dict:
    """Quantize ``src`` into ``dst`` at ``bits`` per weight; returns the "quantization" config
    entry written. With ``calibration`` (a jsonl file): BlockLDLQ, sequential unless the recipe
    says otherwise (with in-block tuning after each group), then fine-tuning. ``only``: a filter
    on module paths (tests)."""
    from mlx_lm.utils import load_model
    from tqdm import tqdm

    from kernels.trellis import TrellisSpec, quantizable_size, quantize_model, save_model
    from kernels.trellis.linear import quantizable_linears

    recipe = recipe or Recipe()
    L = recipe.L or default_L()
    if not bits < L:
        raise RecipeError(f"L must be more than the bits ({bits}), got {L}")
    cal, bt, ft = recipe.calibration, recipe.block_tune, recipe.finetune
    skip = recipe.skip
    model, config = load_model(Path(src))
    if config.get("quantization") or config.get("quantization_config"):
        raise SystemExit(f"{src} is already quantized; trellis quantization needs float weights")
    spec = TrellisSpec(bits=bits, L=L, code=recipe.code, max_block=recipe.max_block)
    start = time.perf_counter()
    hessians = windows = ft_windows = teacher = None
    finetune_steps = ft.steps if calibration is not None else 0
    dtype = _float_dtype(model)
    on_cpu = _on_cpu()
    if calibration is not None:
        import mlx.core as mx

        stream = calibration_stream(Path(src), calibration)
        windows = even_windows(stream, cal.windows, cal.length)
        if on_cpu:
            model.set_dtype(mx.float32)  # MLX's CPU matmuls are fast in float32 only
        if not cal.sequential:
            paths = [p for p, _ in quantizable_linears(model, spec, skip) if only is None or only(p)]
            hessians = collect_hessians(model, windows, paths)
            windows = None
        if finetune_steps > 0:
            from kernels.trellis.finetune import teacher_for

            ft_windows = even_windows(stream, ft.windows, ft.length)
            # the float model's log-probs (float16) if they fit in 1 GiB, else a float copy of the
            # model that runs on each batch (this one is quantized in place)
            teacher = teacher_for(model, ft_windows, finetune_steps, ft.batch)
            if teacher is model:
                teacher, _ = load_model(Path(src))
                if on_cpu:
                    teacher.set_dtype(mx.float32)
    total = quantizable_size(model, spec, skip)
    with tqdm(total=total, unit="w", unit_scale=True, disable=not progress, desc=f"trellis K={bits} L={L}") as bar:
        qconfig = quantize_model(
            model,
            bits,
            L,
            code=recipe.code,
            max_block=recipe.max_block,
            seed=recipe.seed,
            skip=skip,
            only=only,
            progress=bar.update,
            hessians=hessians,
            calibration=windows,
            block_tune=_block_tune(bt) if windows is not None else None,
        )
    qconfig["quantize_seconds"] = round(time.perf_counter() - start, 1)
    if teacher is not None and ft_windows is not None:
        from kernels.trellis.finetune import finetune

        with tqdm(total=finetune_steps, unit="step", disable=not progress, desc="fine-tune") as bar:

            def step(_i: int, loss: float) -> None:
                bar.set_postfix(kl=f"{loss:.4f}")
                bar.update(1)

            result = finetune(
                model,
                teacher,  # log-probs or the float model
                ft_windows,
                steps=finetune_steps,
                batch=ft.batch,
                lr=ft.lr,
                train_signs=ft.signs,
                progress=step,
            )
        qconfig["finetune"] = {
            "steps": finetune_steps,
            "windows": ft.windows,
            "length": ft.length,
            "batch": ft.batch,
            "lr": ft.lr,
            "signs": ft.signs,
            "kl_first": round(result.loss_first, 5),
            "kl_last": round(result.loss_last, 5),
            "seconds": round(result.seconds, 1),
        }
    if calibration is not None and on_cpu:
        _cast_float_params(model, dtype)  # back to the stored dtype; trellis layers keep theirs
    qconfig["seconds"] = round(time.perf_counter() - start, 1)
    if calibration is not None:
        qconfig["calibration"] = {"file": Path(calibration).name, "windows": cal.windows, "length": cal.length}
    config["quantization"] = qconfig
    save_model(model, config, dst, src)
    return qconfig


def _block_tune(bt: BlockTuning) -> Any:
    from kernels.trellis.blocktune import BlockTune

    return BlockTune(steps=bt.steps, lr=bt.lr, target=bt.target) if bt.steps > 0 else None


def _float_dtype(model):
    import mlx.core as mx
    from mlx.utils import tree_flatten

    return next(v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating))


def _on_cpu() -> bool:
    import mlx.core as mx

    return mx.default_device() == mx.cpu


def _cast_float_params(model, dtype) -> None:
    """Cast the float parameters outside TrellisLinear layers (their scales stay float16)."""
    import mlx.core as mx

    from kernels.trellis import TrellisLinear

    for _, m in model.named_modules():
        if isinstance(m, TrellisLinear):
            continue
        arrays = {k: v.astype(dtype) for k, v in m.items() if isinstance(v, mx.array) and mx.issubdtype(v.dtype, mx.floating)}
        if arrays:
            m.update(arrays)


def calibration_stream(src: Path, data: Path) -> list[int]:
    """The calibration file's records as one token stream (tokenizer of ``src``)."""
    from mlx_lm.utils import load_tokenizer

    from kernels.trellis.calibration import read_records, token_stream

    return token_stream(load_tokenizer(src), read_records(data))


def even_windows(stream, num: int, length: int):
    from kernels.trellis.calibration import even_windows as windows

    return windows(stream, num, length)


def collect_hessians(model, windows, paths) -> dict:
    from kernels.trellis.calibration import collect_hessians as collect

    return collect(model, windows, paths)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.print_recipe:
        sys.stdout.write(recipe_toml())
        return 0
    if args.src is None or args.dst is None or args.bits is None:
        parser.error("SRC, DST and --bits are required")
    try:
        recipe = load_recipe(args.recipe) if args.recipe is not None else Recipe()
    except RecipeError as exc:
        parser.error(str(exc))
    if args.dst.exists() and any(args.dst.glob("*.safetensors")):
        print(f"note: replacing the weights in {args.dst}", file=sys.stderr)
    try:
        q = quantize_dir(args.src, args.dst, args.bits, recipe, calibration=args.calibration,
                         progress=not args.no_progress)
    except RecipeError as exc:
        parser.error(str(exc))
    print(json.dumps({"dst": str(args.dst), "quantization": q}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
