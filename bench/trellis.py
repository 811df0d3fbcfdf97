"""`trellis`: trellis-quantized weights, speed on a GPU and quality anywhere.

    python -m bench trellis speed   [--bits 3] [--batches 1 4]       # bench/trellis_speed.py
    python -m bench trellis sweep   [--tuned tuned.json]             # bench/trellis_sweep.py
    python -m bench trellis quality [--bits 4 3 2] [--L 12]          # bench/trellis_quality.py

speed: the fused trellis mat-vec against MLX's affine 4-bit quantized_matmul and a bf16 matmul,
per call and stacked (streaming rate), plus encoder speed. sweep: every launch layout of the
fused kernel checked against the plain-MLX twin and timed; the winners as a tuned table.
quality: perplexity of the bundled model under bf16, affine 4/3-bit and trellis weights.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bench import common


def _shape(text: str) -> tuple[int, int]:
    n_out, n_in = text.lower().split("x")
    return int(n_out), int(n_in)


def _add_shape_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", type=_shape, nargs="+", default=None,
                   help="weight shapes N_OUTxN_IN (default: 4096x4096 14336x4096 4096x14336)")
    p.add_argument("--working-set-mib", type=float, default=512,
                   help="MiB of weight copies a timed run cycles over (far above the L2)")
    common.add_out_arg(p)


def add_parsers(sub: Any) -> None:
    t = sub.add_parser("trellis", help="trellis weights: speed, layout sweep (GPU), quality",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = t.add_subparsers(dest="mode", required=True, metavar="MODE")
    p = modes.add_parser("speed", help="mat-vec speed against affine 4-bit and bf16 (GPU)")
    p.add_argument("--bits", type=int, nargs="+", default=[3])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    p.add_argument("--skip-encoder", action="store_true")
    _add_shape_args(p)
    p.set_defaults(func=_run("trellis_speed"))
    p = modes.add_parser("sweep", help="autotune the fused kernel's launch layouts (GPU)")
    p.add_argument("--tuned", type=Path, default=None, help="write the winners' table here")
    p.add_argument("--budget-s", type=float, default=300.0,
                   help="stop starting new shapes after this")
    p.add_argument("--calls", type=int, default=96, help="calls of the real shape per timing")
    _add_shape_args(p)
    p.set_defaults(func=_run("trellis_sweep"))
    p = modes.add_parser("quality", help="perplexity under bf16, affine and trellis weights")
    p.add_argument("--model", type=Path, default=None, help="default: the bundled tinycoder-16m")
    p.add_argument("--data", type=Path, default=common.DEV_DATA)
    p.add_argument("--windows", type=int, default=24)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--bits", type=int, nargs="+", default=[4, 3, 2])
    p.add_argument("--L", type=int, nargs="+", default=[12])
    p.add_argument("--modes", nargs="*", default=["seq"], choices=["seq", "ldlq", "plain"])
    p.add_argument("--finetune-steps", type=int, default=300, help="0: no fine-tuning rows")
    p.add_argument("--finetune-windows", type=int, default=512)
    p.add_argument("--finetune-length", type=int, default=256)
    p.add_argument("--finetune-batch", type=int, default=4)
    p.add_argument("--finetune-lr", type=float, default=1e-3)
    p.add_argument(
        "--finetune-holdout",
        type=int,
        default=0,
        help="windows (of --finetune-length) from the end of the calibration text kept out of the fine-tuning "
        "windows; their KL to the float model is logged every --holdout-every steps, to watch for overfitting",
    )
    p.add_argument("--holdout-every", type=int, default=50)
    p.add_argument("--skip-unfinetuned", action="store_true", help="no rows for the trellis models before fine-tuning")
    p.add_argument("--label", default="", help="added to the fine-tuned rows' names")
    p.add_argument(
        "--eval-kl",
        action="store_true",
        help="also the KL to the float model on the evaluation windows (trellis rows; a diagnostic)",
    )
    p.add_argument("--append", action="store_true", help="add rows to --out DIR's trellis_quality.json instead of starting it afresh")
    p.add_argument("--dirs", type=Path, nargs="*", default=[], help="trellis model dirs (mlxd quantize) to score too")
    p.add_argument("--skip-affine", action="store_true", help="no affine baselines (slow on a CPU)")
    p.add_argument(
        "--block-tune-steps",
        type=int,
        default=16,
        help="seq mode: Adam steps of in-block tuning after each quantized group (kernels/trellis/blocktune.py); 0: none",
    )
    p.add_argument("--block-tune-lr", type=float, default=1e-3)
    p.add_argument(
        "--block-tune-target",
        default="float",
        choices=["own", "float"],
        help="in-block target: the float block's output on its quantized-prefix inputs ('own') or the float "
        "model's hidden state after the block ('float'; '-float' in the row names and cache keys)",
    )
    p.add_argument("--calib-windows", type=int, default=64)
    p.add_argument("--calib-length", type=int, default=512)
    common.add_out_arg(p)
    p.add_argument(
        "--cache",
        type=Path,
        default=None,
        help="dir of quantized (pre-fine-tuning) models: reuse one quantized with the same bits/L/mode/"
        "calibration, else quantize and save it there (fine-tuning variants then skip the encoding)",
    )
    p.set_defaults(func=_run("trellis_quality"))


def _run(module: str) -> Any:
    def run(args: argparse.Namespace) -> int:
        import importlib

        return int(importlib.import_module(f"bench.{module}").run(args))

    return run
