"""`kv`: what the KV cache costs and what quantizing it changes, on one model.

    python -m bench kv memory [--seq 2000] [--budget-gib 1]     # bench/kv_memory.py
    python -m bench kv quality [--windows 8] [--window 1024]    # bench/kv_quality.py

memory: bytes per token and per row for 16/8/4-bit KV (group 64 and 32), rows that fit in a
budget, and the TTFT of a repeated prefix with and without the prefix cache (library level).
quality: mean KL of 8- and 4-bit KV against full-precision KV over windows of the dev set's
code, top-1 agreement and perplexity.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bench import common


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("kv", help="KV cache memory and prefix cache (memory); quantized-KV "
                       "quality (quality)", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = p.add_subparsers(dest="mode", required=True, metavar="MODE")
    m = modes.add_parser("memory", help="bytes per row, rows in a budget, prefix-cache TTFT")
    m.add_argument("--model", type=Path, default=None, help="default: the bundled tinycoder-16m")
    m.add_argument("--seq", type=int, default=2000, help="tokens per row (and prefix length)")
    m.add_argument("--budget-gib", type=float, default=1.0)
    m.add_argument("--chunk", type=int, default=256, help="prefill chunk")
    m.add_argument("--repeats", type=int, default=3)
    common.add_out_arg(m)
    m.set_defaults(func=_memory)
    q = modes.add_parser("quality", help="KL of quantized KV against full-precision KV")
    q.add_argument("--model", type=Path, default=None, help="default: the bundled tinycoder-16m")
    q.add_argument("--data", type=Path, default=common.DEV_DATA)
    q.add_argument("--windows", type=int, default=8)
    q.add_argument("--window", type=int, default=1024, help="tokens per window")
    q.add_argument("--chunk", type=int, default=256, help="prefill chunk")
    q.add_argument("--group-size", type=int, nargs="+", default=[64, 32])
    q.add_argument("--bits", type=int, nargs="+", default=[8, 4])
    q.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    common.add_out_arg(q)
    q.set_defaults(func=_quality)


def _memory(args: argparse.Namespace) -> int:
    from bench import kv_memory

    return kv_memory.run(args)


def _quality(args: argparse.Namespace) -> int:
    from bench import kv_quality

    return kv_quality.run(args)
