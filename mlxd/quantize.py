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
    p.add_argument("--calibration-windows", type=int, default=64, help="token windows to run")
    p.add_argument("--calibration-length", type=int, default=512, help="tokens per window")
    p.add_argument(
        "--no-sequential",
        action="store_true",
        help="BlockLDLQ Hessians from the float model (default: sequential, from the already-quantized layers)",
    )
    p.add_argument(
        "--block-tune-steps",
        type=int,
        default=16,
        help="with --calibration (sequential): Adam steps of in-block tuning after each quantized group "
        "(the block's remaining float Linears, the quantized ones' gains and signs, its norms; towards the "
        "float block's output); 0: none",
    )
    p.add_argument("--block-tune-lr", type=float, default=1e-3, help="in-block tuning's Adam learning rate")
    p.add_argument(
        "--block-tune-target",
        default="auto",
        choices=("auto", "own", "float"),
        help="in-block tuning's target for block i: 'float', the float model's hidden state after block i, so "
        "the block also repairs the error it inherits; 'own', the float block's output on its (quantized-prefix) "
        "inputs; 'auto' (default), 'float' where the blocks form a simple chain, else 'own' (recorded as "
        "block_tune.target in config.json)",
    )
    p.add_argument(
        "--finetune-steps",
        type=int,
        default=300,
        help="with --calibration: Adam steps of fine-tuning after quantization (row gains, signs, norms; "
        "distilled from the float model on the calibration text); 0: none",
    )
    p.add_argument("--finetune-windows", type=int, default=512, help="calibration windows to fine-tune on")
    p.add_argument("--finetune-length", type=int, default=256, help="tokens per fine-tuning window")
    p.add_argument("--finetune-batch", type=int, default=4, help="windows per step")
    p.add_argument("--finetune-lr", type=float, default=1e-3, help="Adam learning rate (cosine decay)")
    p.add_argument("--finetune-no-signs", action="store_true", help="keep the signs +-1 (int8) when fine-tuning")
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
    calibration_windows: int = 64,
    calibration_length: int = 512,
    sequential: bool = True,
    block_tune_steps: int = 0,
    block_tune_lr: float = 1e-3,
    block_tune_target: str = "auto",
    finetune_steps: int = 0,
    finetune_windows: int = 512,
    finetune_length: int = 256,
    finetune_batch: int = 4,
    finetune_lr: float = 1e-3,
    finetune_signs: bool = True,
) -> dict:
    """Quantize ``src`` into ``dst``; returns the "quantization" config entry written.

    With ``calibration`` (a jsonl file): BlockLDLQ, sequential by default (with
    ``block_tune_steps`` of in-block tuning after each group), then ``finetune_steps`` of
    fine-tuning. Keep the calibration text apart from any text you evaluate on.
    """
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
    hessians = windows = ft_windows = teacher_lp = None
    dtype = _float_dtype(model)
    on_cpu = _on_cpu()
    if calibration is not None:
        import mlx.core as mx

        stream = calibration_stream(Path(src), calibration)
        windows = even_windows(stream, calibration_windows, calibration_length)
        if on_cpu:
            model.set_dtype(mx.float32)  # MLX's CPU matmuls are fast in float32 only
        if not sequential:
            paths = [p for p, _ in quantizable_linears(model, spec, skip) if only is None or only(p)]
            hessians = collect_hessians(model, windows, paths)
            windows = None
        if finetune_steps > 0:
            from kernels.trellis.finetune import teacher_for

            ft_windows = even_windows(stream, finetune_windows, finetune_length)
            # the float model's log-probs (float16) if they fit in 1 GiB, else a float copy of the
            # model that runs on each batch (this one is quantized in place)
            teacher_lp = teacher_for(model, ft_windows, finetune_steps, finetune_batch)
            if teacher_lp is model:
                teacher_lp, _ = load_model(Path(src))
                if on_cpu:
                    teacher_lp.set_dtype(mx.float32)
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
            calibration=windows,
            block_tune=_block_tune(block_tune_steps, block_tune_lr, block_tune_target) if windows is not None else None,
        )
    qconfig["quantize_seconds"] = round(time.perf_counter() - start, 1)
    if teacher_lp is not None:
        from kernels.trellis.finetune import finetune

        with tqdm(total=finetune_steps, unit="step", disable=not progress, desc="fine-tune") as bar:

            def step(_i: int, loss: float) -> None:
                bar.set_postfix(kl=f"{loss:.4f}")
                bar.update(1)

            ft = finetune(
                model,
                teacher_lp,  # log-probs or the float model
                ft_windows,
                steps=finetune_steps,
                batch=finetune_batch,
                lr=finetune_lr,
                train_signs=finetune_signs,
                progress=step,
            )
        qconfig["finetune"] = {
            "steps": finetune_steps,
            "windows": finetune_windows,
            "length": finetune_length,
            "batch": finetune_batch,
            "lr": finetune_lr,
            "signs": finetune_signs,
            "kl_first": round(ft.loss_first, 5),
            "kl_last": round(ft.loss_last, 5),
            "seconds": round(ft.seconds, 1),
        }
    if calibration is not None and on_cpu:
        _cast_float_params(model, dtype)  # back to the stored dtype; trellis layers keep theirs
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


def _block_tune(steps: int, lr: float, target: str = "own"):
    from kernels.trellis.blocktune import BlockTune

    return BlockTune(steps=steps, lr=lr, target=target) if steps > 0 else None


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
        block_tune_steps=args.block_tune_steps,
        block_tune_lr=args.block_tune_lr,
        block_tune_target=args.block_tune_target,
        sequential=not args.no_sequential,
        finetune_steps=args.finetune_steps if args.calibration is not None else 0,
        finetune_windows=args.finetune_windows,
        finetune_length=args.finetune_length,
        finetune_batch=args.finetune_batch,
        finetune_lr=args.finetune_lr,
        finetune_signs=not args.finetune_no_signs,
    )
    print(json.dumps({"dst": str(args.dst), "quantization": q}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
