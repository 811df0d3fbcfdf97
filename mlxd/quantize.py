"""``mlxd quantize --trellis-bits K [--trellis-L L] SRC DST``: write a trellis-quantized model dir.

SRC is an mlx-lm model directory with float weights; DST gets the same layout plus
``"quantization": {"method": "trellis", ...}`` in config.json (docs/trellis.md). The CLI entry
point (mlxd/cli.py) calls ``main(argv)``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from mlxd import blas as _blas

_blas.load()  # before mlx: float32 matmuls through OpenBLAS on Linux CPUs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlxd quantize",
        description="Quantize a model's Linear layers to trellis codes (QTIP-style).",
    )
    p.add_argument("src", type=Path, help="mlx-lm model directory (float weights)")
    p.add_argument("dst", type=Path, help="output directory")
    p.add_argument("--trellis-bits", type=int, required=True, choices=(2, 3, 4), help="bits per weight K")
    p.add_argument(
        "--trellis-L",
        type=int,
        default=None,
        help="trellis state bits L (default: 16 on a GPU, 12 on a CPU, where L=16 is ~16x slower)",
    )
    p.add_argument("--trellis-code", default="1mad", choices=("1mad", "3inst"))
    p.add_argument("--trellis-block", type=int, default=256, help="largest block length T (a power of two >= 32)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random Hadamard signs")
    p.add_argument(
        "--skip",
        action="append",
        default=None,
        help="module name (or suffix) to leave unquantized; repeatable (default: lm_head)",
    )
    p.add_argument(
        "--calibration",
        type=Path,
        default=None,
        help="jsonl of {text} / {messages} records: quantize with BlockLDLQ on their activations",
    )
    p.add_argument("--calibration-windows", type=int, default=16, help="token windows to run")
    p.add_argument("--calibration-length", type=int, default=512, help="tokens per window")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def default_L() -> int:
    import mlx.core as mx

    return 16 if mx.default_device() == mx.gpu else 12


def quantize_dir(
    src: Path,
    dst: Path,
    bits: int,
    L: int | None = None,
    *,
    code: str = "1mad",
    max_block: int = 256,
    seed: int = 0,
    skip: Sequence[str] | None = None,
    progress: bool = True,
    only=None,
    calibration: Path | None = None,
    calibration_windows: int = 16,
    calibration_length: int = 512,
) -> dict:
    """Quantize ``src`` into ``dst``; returns the "quantization" config entry written."""
    from mlx_lm.utils import load_model
    from tqdm import tqdm

    from kernels.trellis import TrellisSpec, quantizable_size, quantize_model, save_model
    from kernels.trellis.linear import DEFAULT_SKIP, quantizable_linears

    L = L or default_L()
    skip = tuple(skip) if skip else DEFAULT_SKIP
    model, config = load_model(Path(src))
    if config.get("quantization") or config.get("quantization_config"):
        raise SystemExit(f"{src} is already quantized; trellis quantization needs float weights")
    spec = TrellisSpec(bits=bits, L=L, code=code, max_block=max_block)
    start = time.perf_counter()
    hessians = None
    if calibration is not None:
        paths = [p for p, _ in quantizable_linears(model, spec, skip) if only is None or only(p)]
        hessians = calibration_hessians(model, Path(src), calibration, paths, calibration_windows, calibration_length)
    total = quantizable_size(model, spec, skip)
    with tqdm(total=total, unit="w", unit_scale=True, disable=not progress, desc=f"trellis K={bits} L={L}") as bar:
        qconfig = quantize_model(
            model,
            bits,
            L,
            code=code,
            max_block=max_block,
            seed=seed,
            skip=skip,
            only=only,
            progress=bar.update,
            hessians=hessians,
        )
    qconfig["seconds"] = round(time.perf_counter() - start, 1)
    if calibration is not None:
        qconfig["calibration"] = {
            "file": Path(calibration).name,
            "windows": calibration_windows,
            "length": calibration_length,
        }
    config["quantization"] = qconfig
    save_model(model, config, dst, src)
    return qconfig


def calibration_hessians(model, src: Path, data: Path, paths, num_windows: int, length: int) -> dict:
    """E[x x^T] per layer over evenly spaced windows of ``data`` (float32 forward on a CPU)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_tokenizer

    from kernels.trellis.calibration import (
        collect_hessians,
        even_windows,
        read_records,
        token_stream,
    )

    tokenizer = load_tokenizer(src)
    windows = even_windows(token_stream(tokenizer, read_records(data)), num_windows, length)
    dtype = next(v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating))
    on_cpu = mx.default_device() == mx.cpu
    if on_cpu:
        model.set_dtype(mx.float32)  # MLX's CPU matmuls are fast in float32 only
    try:
        return collect_hessians(model, windows, paths)
    finally:
        if on_cpu:
            model.set_dtype(dtype)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.dst.exists() and any(args.dst.glob("*.safetensors")):
        print(f"note: replacing the weights in {args.dst}", file=sys.stderr)
    q = quantize_dir(
        args.src,
        args.dst,
        args.trellis_bits,
        args.trellis_L,
        code=args.trellis_code,
        max_block=args.trellis_block,
        seed=args.seed,
        skip=args.skip,
        progress=not args.no_progress,
        calibration=args.calibration,
        calibration_windows=args.calibration_windows,
        calibration_length=args.calibration_length,
    )
    print(json.dumps({"dst": str(args.dst), "quantization": q}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
