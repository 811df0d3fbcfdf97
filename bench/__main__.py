"""`python -m bench` (also `mlxd bench`): mlxd's benchmark harness, one subcommand per question.

    sweep        start mlxd and the servers users would pick instead, same load, level by level
    load         drive a server that is already running
    spec         the engine with and without speculative decoding, same prompts
    kv           KV cache memory per row and prefix-cache TTFT (memory); quantized-KV quality
    constrained  the cost of grammar-constrained decoding in the engine
    trellis      trellis weights: mat-vec speed (GPU), layout sweep (GPU), perplexity
    plot         redraw the PNG of any result JSON
    random-model write a random-weight model directory of a known shape
    wide-twin    a wider, deeper llama checkpoint that computes its source's logits

Each subcommand writes its JSON and PNG into `--out DIR` (default `.bench/<subcommand>-<time>/`,
ignored by git). docs/benchmarks.md has the current numbers and the commands that made them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _prog() -> str:
    """How the harness was started, for usage lines: `python -m bench` or `mlxd bench`."""
    return "python -m bench" if Path(sys.argv[0]).parent.name == "bench" else "mlxd bench"


def build_parser() -> argparse.ArgumentParser:
    from bench import constrained, kv, modelprep, plot, spec, sweep, trellis, widetwin

    parser = argparse.ArgumentParser(prog=_prog(), description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="subcommand", required=True, metavar="SUBCOMMAND")
    for module in (sweep, spec, kv, constrained, trellis, plot, modelprep, widetwin):
        module.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
