"""KV memory and prefix-cache benchmark (a script, not a test).

    python -m bench kv memory                      # bundled tinycoder-16m
    python -m bench kv memory --budget-gib 1 --seq 2000

Reports, for KV at 16 / 8 / 4 bits (group 64 and 32), in the model's own 16-bit dtype
(bfloat16) and in the CPU compute dtype (float32):
  * bytes per token per layout kind (full-attention layers, rings, recurrent state);
  * bytes of one `--seq`-token row and how many such rows fit in `--budget-gib`, with the
    ratio to the 16-bit count (targets: >= 1.8x at 8 bits, >= 3.2x at 4 bits);
and the time to first token for a repeated `--seq`-token prefix with and without the prefix
cache (library level: lookup + restore + prefill of the suffix vs prefill of everything).
Writes DIR/kv_memory.json and DIR/kv_memory.png.
"""

from __future__ import annotations

import engine  # noqa: F401  (BLAS before mlx)

# isort: split

import argparse
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from bench import common
from bench.kv_quality import DTYPES
from engine.kv.memory import measure_footprint
from engine.kv.prefix_cache import PrefixCache, chunk_ends
from engine.models import make_batch_layouts

CONFIGS = [(16, 64), (8, 64), (8, 32), (4, 64), (4, 32)]


def footprints(model: Any, seq: int, budget: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for bits, group in CONFIGS:
        fp = measure_footprint(model, kv_bits=bits, kv_group_size=group)
        row_bytes = fp.row_bytes(seq)
        rows.append(
            {
                "kv": "16" if bits == 16 else f"{bits}/g{group}",
                "bytes_per_token_by_kind": fp.bytes_per_token_by_kind(),
                "marginal_bytes_per_token": fp.bytes_per_token(),
                "row_bytes": row_bytes,
                "rows_in_budget": fp.max_rows(budget, seq),
            }
        )
    base = rows[0]["rows_in_budget"] or 1
    for r in rows:
        r["rows_vs_16bit"] = round(r["rows_in_budget"] / base, 3)
    return rows


def ttft(model: Any, prompt: list[int], chunk: int, pc: PrefixCache | None) -> tuple[float, int]:
    """Seconds to the first token of `prompt` (and the cached tokens used)."""
    t0 = time.perf_counter()
    hit = pc.lookup(prompt, max_tokens=len(prompt) - 1) if pc else None
    row = pc.restore(hit) if (pc and hit) else make_batch_layouts(model, 1)
    start = hit.num_tokens if hit else 0
    block = pc.block_size if pc else 1
    for end in chunk_ends(start, len(prompt), chunk, block):
        logits = model(mx.array([prompt[start:end]]), cache=row)
        mx.eval(logits, [layer.state for layer in row])
        if pc and end < len(prompt):
            pc.insert(prompt[:end], row)
        start = end
    mx.eval(mx.argmax(logits[:, -1], axis=-1))
    return time.perf_counter() - t0, (hit.num_tokens if hit else 0)


def prefix_bench(model: Any, seq: int, chunk: int, repeats: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    prefix = rng.integers(3, 8000, seq).tolist()
    pc = PrefixCache(make_batch_layouts(model, 0), block_size=64, max_bytes=4 << 30)
    cold, warm, cached = [], [], 0
    ttft(model, prefix + [11, 12], chunk, None)  # warm-up
    for i in range(repeats):
        cold.append(ttft(model, prefix + [100 + i, 7], chunk, None)[0])
    ttft(model, prefix + [5, 6], chunk, pc)  # fills the cache
    for i in range(repeats):
        t, cached = ttft(model, prefix + [200 + i, 9, 10], chunk, pc)
        warm.append(t)
    return {
        "prefix_tokens": seq,
        "cached_tokens": cached,
        "ttft_s_without": float(np.median(cold)),
        "ttft_s_with": float(np.median(warm)),
        "speedup": float(np.median(cold) / np.median(warm)),
        "prefix_cache_bytes": pc.nbytes,
    }


def plot(report: dict[str, Any], path: Path) -> None:
    plt = common.pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for dtype, rows in report["footprints"].items():
        ax1.plot(
            [r["kv"] for r in rows], [r["rows_vs_16bit"] for r in rows], marker="o", label=dtype
        )
    ax1.axhline(1.8, ls=":", c="gray")
    ax1.axhline(3.2, ls=":", c="gray")
    ax1.set_title(f"{report['seq']}-token rows in a fixed budget (x 16-bit)")
    ax1.legend()
    p = report["prefix_cache"]
    ax2.bar(["no prefix cache", "prefix cache"], [p["ttft_s_without"], p["ttft_s_with"]])
    ax2.set_title(f"TTFT, repeated {p['prefix_tokens']}-token prefix ({p['speedup']:.1f}x)")
    ax2.set_ylabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def run(args: argparse.Namespace) -> int:
    from mlx_lm.utils import load

    model_dir = args.model or common.default_model()
    out = common.out_dir(args, "kv-memory")
    model = load(str(model_dir))[0]
    budget = int(args.budget_gib * (1 << 30))
    report: dict[str, Any] = {"model": model_dir.name, "seq": args.seq, "budget_bytes": budget}
    report["footprints"] = {}
    for dtype in ("bfloat16", "float32"):
        model.set_dtype(DTYPES[dtype])
        report["footprints"][dtype] = footprints(model, args.seq, budget)
    model.set_dtype(mx.float32)  # CPU compute dtype
    report["prefix_cache"] = prefix_bench(model, args.seq, args.chunk, args.repeats)
    for dtype, rows in report["footprints"].items():
        for r in rows:
            print(
                f"{dtype:>8} KV {r['kv']:>6}: {r['marginal_bytes_per_token']:>6} B/token "
                f"(full layers), {r['row_bytes'] / 1e6:7.2f} MB per {args.seq}-token row, "
                f"{r['rows_in_budget']:>5} rows ({r['rows_vs_16bit']}x)  "
                f"by kind {r['bytes_per_token_by_kind']}"
            )
    p = report["prefix_cache"]
    print(
        f"TTFT {p['prefix_tokens']}-token prefix: {p['ttft_s_without'] * 1e3:.0f} ms without, "
        f"{p['ttft_s_with'] * 1e3:.0f} ms with the prefix cache ({p['speedup']:.1f}x, "
        f"{p['cached_tokens']} cached tokens)"
    )
    path = common.write_json(out / "kv_memory.json", "kv-memory", report, args)
    plot(report, path.with_suffix(".png"))
    print(f"wrote {path}")
    return 0
