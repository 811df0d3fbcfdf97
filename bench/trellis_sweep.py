"""Autotune the fused trellis mat-vec on a GPU: every launch layout checked, then timed.

    python -m bench trellis sweep [--tuned tuned.json] [--budget-s 300] [--out DIR]

For each weight shape (n_out x n_in) and batch (rows of x), 3-bit L = 16 1MAD codes (random: speed
does not depend on the values):

1. Every candidate layout (kernels.trellis.matvec.LaunchConfig: the register-resident "xreg" body
   with its knobs, and the shared-memory "smem" body) runs on the stacked weights and its first
   n_out rows are compared with the plain-MLX twin (dense dequantize_rotated, then a float32
   matmul). A layout that disagrees is recorded and never timed.
2. "stacked": copies of the weight stacked along n_out (>= 512 MB, far above the 50 MB L2), REPS
   launches in one eval: time per copy = the kernel's streaming rate, dispatch amortised.
3. "per call": the best layouts again, 96 calls of the real shape cycling over the copies in one
   eval (what a model pays, dispatch included).

Also times MLX's affine 4-bit quantized_matmul on the same shapes. Writes DIR/trellis_sweep.json as it
goes (and .png), and the winners as a table matvec.load_tuned can read (``--tuned``).
"""

from __future__ import annotations

from bench.trellis_speed import timed  # first: it loads the BLAS before mlx

# isort: split

import argparse
import json
import math
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from bench import common
from kernels.trellis import matvec
from kernels.trellis.matvec import SMEM, LaunchConfig
from kernels.trellis.quantizer import TrellisWeight, dequantize_rotated

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336)]
BATCHES = (1, 4)
BITS, L, BLOCK = 3, 16, 256
WORKING_SET = 512 << 20
REPS = 4
CALLS = 96


def candidates(n_out: int, n_in: int, batch: int) -> list[LaunchConfig]:
    """The layouts tried for one shape: the table's or heuristic's pick, the smem body, and a
    spread of (groups a lane, rows a chunk, chunks a warp, row-warps a threadgroup) around the
    region that won on the H200 (one group a lane, 32-64 rows a warp)."""
    if batch <= 2:
        grid = [(1, 8, 4, 1), (1, 8, 8, 1), (1, 8, 4, 2), (1, 8, 8, 2), (1, 8, 2, 2), (1, 4, 8, 2), (2, 4, 4, 4)]
    else:
        grid = [(1, 4, 8, 1), (1, 4, 8, 2), (1, 8, 4, 2), (1, 2, 16, 2)]
    out = []
    for gpl, rwu, nch, rs in grid:
        cfg = LaunchConfig("xreg", gpl, rwu, nch, rs, 1)
        if matvec.xreg_fits(cfg, n_in, batch, BITS):
            out.append(cfg)
    default = matvec.default_config(n_out, n_in, batch, "cuda", BITS)
    extra = [default, SMEM]
    if default.body == "xreg" and batch == 1:
        extra.append(LaunchConfig(**{**default.__dict__, "den": 0}))
    seen: dict[str, LaunchConfig] = {}
    for c in extra + out:
        seen.setdefault(c.key(), c)
    return list(seen.values())


def read_bandwidth(num: int) -> float:
    """GB/s of a large mx.sum over `num` float32 values (the read ceiling)."""
    big = mx.ones((num,), dtype=mx.float32)
    mx.eval(big)
    t = timed(lambda: mx.eval(mx.sum(big)), 5)
    return round(big.nbytes / t / 1e9, 1)


def _item(a: mx.array) -> float:
    value = a.item()
    assert isinstance(value, float)
    return value


def random_packed(n_out: int, n_in: int, bits: int, key: int) -> mx.array:
    rng = np.random.default_rng(key)
    return mx.array(rng.integers(0, 2**32, size=(n_out, n_in * bits // 32), dtype=np.uint32))


def sweep_shape(n_out: int, n_in: int, working_set: int, calls: int, result: dict[str, Any],
                tuned: dict[str, dict[str, Any]], save: Callable[[], None]) -> None:
    """Every candidate layout of one weight shape at each batch: checked, timed (stacked and per
    call), the pick recorded in `tuned`; and affine 4-bit on the same shape."""
    wbytes = n_out * n_in * BITS // 8 + 2 * n_out
    copies = max(2, min(128, math.ceil(working_set / wbytes)))
    packed_all = random_packed(n_out * copies, n_in, BITS, n_out + n_in)
    scales_all = mx.random.uniform(0.5, 2.0, (n_out * copies,)).astype(mx.float16)
    mx.eval(packed_all, scales_all)
    copies_list = [(packed_all[i * n_out : (i + 1) * n_out], scales_all[i * n_out : (i + 1) * n_out]) for i in range(copies)]
    mx.eval(copies_list)
    tw = TrellisWeight(copies_list[0][0], copies_list[0][1], mx.ones((n_in,), mx.int8), BITS, L, BLOCK, "1mad")
    dense = dequantize_rotated(tw)
    mx.eval(dense)
    # MLX affine 4-bit g64 on the same shape (same number of copies)
    wq = mx.quantize(mx.random.normal((n_out * copies, n_in)).astype(mx.bfloat16) * 0.02, 64, 4)
    mx.eval(wq)
    qbytes = n_out * n_in // 2 + 4 * n_out * n_in // 64
    qcopies = [tuple(a[i * n_out : (i + 1) * n_out] for a in wq) for i in range(copies)]
    mx.eval(qcopies)
    for batch in BATCHES:
        x = mx.random.normal((batch, n_in), key=mx.random.key(batch)).astype(mx.bfloat16)
        xf = x.astype(mx.float32)
        twin = xf @ dense.T
        mx.eval(x, xf, twin)
        scale = _item(mx.max(mx.abs(twin)))
        rows_here = []
        for cfg in candidates(n_out, n_in, batch):
            row = {"shape": [n_out, n_in], "batch": batch, "config": cfg.key(), **cfg.__dict__}
            try:
                t0 = time.perf_counter()
                y = matvec.trellis_matvec(x, packed_all, scales_all, bits=BITS, L=L, block=BLOCK, config=cfg)
                mx.eval(y)
                row["compile_s"] = round(time.perf_counter() - t0, 2)
                err = _item(mx.max(mx.abs(y[:, :n_out].astype(mx.float32) - twin))) / scale
                row["max_err_rel"] = err
                if not err < 2e-2:  # bf16 input; the twin gets the same bf16 x in float32
                    row["ok"] = False
                    result["errors"].append(f"{n_out}x{n_in} b{batch} {cfg.key()}: err {err:.3g}")
                    print(json.dumps(row), flush=True)
                    result["rows"].append(row)
                    continue
                row["ok"] = True

                def run_stacked(cfg=cfg, x=x):
                    mx.eval([matvec.trellis_matvec(x, packed_all, scales_all, bits=BITS, L=L, block=BLOCK, config=cfg) for _ in range(REPS)])

                ts = timed(run_stacked, 5) / (REPS * copies)
                row["us_stacked_per_copy"] = round(ts * 1e6, 2)
                row["GBps_stacked"] = round(wbytes / ts / 1e9, 1)
                row["pct_of_read_peak"] = round(100 * wbytes / ts / 1e9 / result["sum_read_GBps"], 1)
            except Exception as exc:  # a layout that fails to compile or run is recorded, not fatal
                row["ok"] = False
                row["error"] = str(exc)[:300]
                result["errors"].append(f"{n_out}x{n_in} b{batch} {cfg.key()}: {str(exc)[:200]}")
            print(json.dumps(row), flush=True)
            result["rows"].append(row)
            rows_here.append(row)
            save()
        good = sorted((r for r in rows_here if r.get("ok") and "us_stacked_per_copy" in r), key=lambda r: r["us_stacked_per_copy"])
        # per call (96 calls of the real shape in one eval) for the three best layouts + default
        default_key = matvec.default_config(n_out, n_in, batch, "cuda", BITS).key()
        per_call_keys = [r["config"] for r in good[:1]] + [default_key]
        for r in rows_here:
            if r["config"] not in per_call_keys or not r.get("ok"):
                continue
            cfg = LaunchConfig(**{k: r[k] for k in ("body", "gpl", "rwu", "nch", "rs", "den")})

            def run_calls(cfg=cfg, x=x):
                mx.eval([
                    matvec.trellis_matvec(x, copies_list[i % copies][0], copies_list[i % copies][1], bits=BITS, L=L, block=BLOCK, config=cfg)
                    for i in range(calls)
                ])

            try:
                r["us_per_call"] = round(timed(run_calls, 3) / calls * 1e6, 2)
            except Exception as exc:
                r["per_call_error"] = str(exc)[:200]
            print(json.dumps({"config": r["config"], "shape": r["shape"], "batch": batch, "us_per_call": r.get("us_per_call")}), flush=True)
        # the table's pick: the fastest stacked layout that still gives the real shape about a
        # wave of warps (8 a multiprocessor), since a stacked launch always has rows to spare
        def warps(r):
            if r["body"] == "smem":
                return n_out
            wc = matvec.warp_columns(n_in, r["gpl"])
            return -(-n_out // (r["rs"] * r["rwu"] * r["nch"])) * r["rs"] * wc

        # (at least ~2 warps a multiprocessor: per call, the H200 runs these kernels dispatch-bound)
        filled = [r for r in good if warps(r) >= 132 * 2] or good
        if filled:
            best = filled[0]
            tuned[f"{n_out}x{n_in}x{batch}"] = {k: best[k] for k in ("body", "gpl", "rwu", "nch", "rs", "den")}
        def q_stacked(x=x):
            mx.eval([mx.quantized_matmul(x, *wq, transpose=True, group_size=64, bits=4) for _ in range(REPS)])

        tq = timed(q_stacked, 5) / (REPS * copies)

        def q_calls(x=x):
            mx.eval([mx.quantized_matmul(x, *qcopies[i % copies], transpose=True, group_size=64, bits=4) for i in range(calls)])

        qrow = {
            "shape": [n_out, n_in], "batch": batch, "config": "affine-q4-quantized_matmul", "ok": True,
            "us_stacked_per_copy": round(tq * 1e6, 2), "GBps_stacked": round(qbytes / tq / 1e9, 1),
            "us_per_call": round(timed(q_calls, 3) / calls * 1e6, 2),
        }
        print(json.dumps(qrow), flush=True)
        result["rows"].append(qrow)
        save()


def run(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    shapes = args.shapes or SHAPES
    working_set = int(args.working_set_mib * (1 << 20))
    calls = args.calls
    out = common.out_dir(args, "trellis-sweep")
    path = out / "trellis_sweep.json"
    backend = matvec.fused_backend()
    if backend is None:
        print("no fused backend here", file=sys.stderr)
        return 1
    result: dict = {
        "device": str(mx.default_device()),
        "machine": platform.machine(),
        "mlx": getattr(mx, "__version__", "?"),
        "variant": matvec.kernel_variant(backend),
        "rows": [],
        "errors": [],
    }
    try:
        result["device_name"] = mx.device_info().get("device_name", "?")
    except Exception:
        result["device_name"] = "?"
    tuned: dict[str, dict] = {}

    def save() -> None:
        common.write_json(path, "trellis-sweep", result, args)
        if args.tuned:
            args.tuned.write_text(json.dumps(tuned, indent=1) + "\n")

    result["sum_read_GBps"] = read_bandwidth(1 << 28 if working_set >= WORKING_SET else working_set // 4)
    print(json.dumps({"sum_read_GBps": result["sum_read_GBps"]}), flush=True)

    for n_out, n_in in shapes:
        if time.perf_counter() - t_start > args.budget_s:
            result["errors"].append(f"budget: skipped {n_out}x{n_in}")
            break
        sweep_shape(n_out, n_in, working_set, calls, result, tuned, save)
    result["seconds"] = round(time.perf_counter() - t_start, 1)
    save()
    try:
        plot(result, path.with_suffix(".png"))
    except ImportError as exc:  # no matplotlib there: draw it later with `python -m bench plot`
        print(f"plot: {exc}", file=sys.stderr)
    print(f"wrote {path}")
    return 0


def plot(result: dict[str, Any], path: Path) -> None:
    """GB/s of weight bytes (stacked) per shape and batch: best layout, old body, affine 4-bit."""
    plt = common.pyplot()

    rows = [r for r in result["rows"] if r.get("ok") and "GBps_stacked" in r]
    groups = sorted({(tuple(r["shape"]), r["batch"]) for r in rows}, key=lambda g: (g[1], g[0]))
    series: dict[str, list[float]] = {"trellis 3-bit, best layout": [], "trellis 3-bit, old smem body": [], "affine 4-bit quantized_matmul": []}
    for g in groups:
        here = [r for r in rows if (tuple(r["shape"]), r["batch"]) == g]
        trel = [r for r in here if r["config"] != "affine-q4-quantized_matmul"]
        series["trellis 3-bit, best layout"].append(max((r["GBps_stacked"] for r in trel), default=0))
        series["trellis 3-bit, old smem body"].append(next((r["GBps_stacked"] for r in trel if r["config"] == "smem"), 0))
        series["affine 4-bit quantized_matmul"].append(
            next((r["GBps_stacked"] for r in here if r["config"] == "affine-q4-quantized_matmul"), 0)
        )
    fig, ax = plt.subplots(figsize=(11, 5))
    width = 0.8 / len(series)
    for i, (name, vals) in enumerate(series.items()):
        ax.bar(np.arange(len(groups)) + i * width, vals, width, label=name)
    peak = result.get("sum_read_GBps", 0)
    if peak:
        ax.axhline(peak, color="k", ls="--", lw=1, label=f"mx.sum read {peak:.0f} GB/s")
        ax.axhline(peak / 2, color="r", ls=":", lw=1, label="50 % of it (the target)")
    ax.set_xticks(np.arange(len(groups)) + 0.4 - width / 2)
    ax.set_xticklabels([f"{g[0][0]}x{g[0][1]}\nbatch {g[1]}" for g in groups], fontsize=8)
    ax.set_ylabel("GB/s of weight bytes (stacked launch)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(f"trellis mat-vec layouts ({result.get('device_name', '?')}, mlx {result.get('mlx', '?')})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
