"""`python -m bench` (from a checkout): mlxd's benchmark harness, one subcommand per question.

    sweep        start mlxd and the servers users would pick instead, same load, level by level
    agent        multi-turn agent sessions (tools, growing prompts) against mlxd and its peers
    prefill      prefill tok/s of one long prompt, servers against raw mlx-lm
    coldstart    TTFT of the first requests on a freshly started server (kernel compilation)
    embed        /v1/embeddings throughput at each batch size
    load         drive a server that is already running
    spec         the engine with and without speculative decoding, same prompts
    kv           KV cache memory per row and prefix-cache TTFT (memory); quantized-KV quality
    constrained  the cost of grammar-constrained decoding in the engine
    trellis      trellis weights: mat-vec speed (GPU), layout sweep (GPU), perplexity
    qmm          few-row affine 4-bit matmul on CUDA: kernel speed, layout sweep, model steps
    attention    decode attention over rows of different lengths: kernel vs masked (CUDA)
    steps        where a run's engine steps spent their time (mlxd serve --trace-steps)
    plot         redraw the PNG of any result JSON
    random-model write a random-weight model directory of a known shape
    wide-twin    a wider, deeper llama checkpoint that computes its source's logits
    models       every mlx-lm text architecture on a tiny model: load, exactness, prefix, n-gram
    tp           one process vs --tensor-parallel N: decode tok/s, communication share
    switch       several models by name: time to switch (unload + load), decode gaps while loading

Each subcommand writes its JSON and PNG into `--out DIR` (default `.bench/<subcommand>-<time>/`,
ignored by git). docs/benchmarks.md has the current numbers and the commands that made them.
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from bench import (
        agent,
        attention,
        coldstart,
        constrained,
        embed,
        kv,
        modelprep,
        models,
        plot,
        qmm,
        spec,
        steps,
        sweep,
        switch,
        tp,
        trellis,
        widetwin,
    )

    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="subcommand", required=True, metavar="SUBCOMMAND")
    for module in (sweep, agent, coldstart, embed, spec, kv, constrained, trellis, qmm, attention,
                   steps, plot, modelprep, widetwin, models, tp, switch):
        module.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
