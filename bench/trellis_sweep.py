"""Autotune the fused trellis mat-vec on a GPU: every launch layout checked, then timed.

    python bench/trellis_sweep.py --out sweep.json [--tuned tuned.json] [--budget-s 300]

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

Also times the dispatch paths of a call (the wrapper, the bare kernel object, precompiled cubin)
and MLX's affine 4-bit quantized_matmul on the same shapes. Writes the JSON as it goes, and the
winners as a table matvec.load_tuned can read (``--tuned``).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from bench.trellis_speed import timed  # noqa: E402  (first: it loads the BLAS before mlx)
from kernels.trellis import matvec  # noqa: E402
from kernels.trellis.matvec import SMEM, LaunchConfig  # noqa: E402
from kernels.trellis.quantizer import TrellisWeight, dequantize_rotated  # noqa: E402

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


def random_packed(n_out: int, n_in: int, bits: int, key: int) -> mx.array:
    rng = np.random.default_rng(key)
    return mx.array(rng.integers(0, 2**32, size=(n_out, n_in * bits // 32), dtype=np.uint32))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tuned", type=Path, default=None)
    p.add_argument("--budget-s", type=float, default=300.0, help="stop starting new shapes after this")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes, for a quick check of the script")
    p.add_argument("--plot", type=Path, default=None, help="only draw the PNG of an earlier --out JSON")
    args = p.parse_args(argv)
    if args.plot:
        plot(json.loads(args.plot.read_text()), args.out)
        return 0
    t_start = time.perf_counter()
    global SHAPES, WORKING_SET, CALLS
    if args.dry_run:  # CPU check of this script: the twin stands in for the kernel
        SHAPES, WORKING_SET, CALLS = [(256, 1024)], 2 << 20, 2

        def fake(x, packed, scales, *, bits, L, block, code="1mad", backend=None, config=None, out_dtype=None):
            w = TrellisWeight(packed, scales, mx.ones((x.shape[-1],), mx.int8), bits, L, block, code)
            return matvec.matmul_rotated(x, w, use_fused=False).astype(out_dtype or x.dtype)

        matvec.trellis_matvec = fake
        matvec.fused_backend = lambda: "cuda"
        matvec.kernel_variant = lambda backend: "dry-run"
    backend = matvec.fused_backend()
    if backend is None:
        print("no fused backend here", file=sys.stderr)
        return 1
    result: dict = {
        "device": str(mx.default_device()),
        "machine": platform.machine(),
        "mlx": mx.__version__,
        "variant": matvec.kernel_variant(backend),
        "rows": [],
        "dispatch": {},
        "errors": [],
    }
    try:
        result["device_name"] = mx.device_info().get("device_name", "?")
    except Exception:
        result["device_name"] = "?"
    tuned: dict[str, dict] = {}

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        if args.tuned:
            args.tuned.write_text(json.dumps(tuned, indent=1) + "\n")

    big = mx.ones((1 << (20 if args.dry_run else 28),), dtype=mx.float32)
    mx.eval(big)
    t = timed(lambda: mx.eval(mx.sum(big)), 5)
    result["sum_read_GBps"] = round(big.nbytes / t / 1e9, 1)
    big = None
    print(json.dumps({"sum_read_GBps": result["sum_read_GBps"]}), flush=True)

    for n_out, n_in in SHAPES:
        if time.perf_counter() - t_start > args.budget_s:
            result["errors"].append(f"budget: skipped {n_out}x{n_in}")
            break
        wbytes = n_out * n_in * BITS // 8 + 2 * n_out
        copies = max(2, min(128, math.ceil(WORKING_SET / wbytes)))
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
            scale = float(mx.max(mx.abs(twin)).item())
            rows_here = []
            for cfg in candidates(n_out, n_in, batch):
                row = {"shape": [n_out, n_in], "batch": batch, "config": cfg.key(), **cfg.__dict__}
                try:
                    t0 = time.perf_counter()
                    y = matvec.trellis_matvec(x, packed_all, scales_all, bits=BITS, L=L, block=BLOCK, config=cfg)
                    mx.eval(y)
                    row["compile_s"] = round(time.perf_counter() - t0, 2)
                    err = float(mx.max(mx.abs(y[:, :n_out].astype(mx.float32) - twin)).item()) / scale
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
                        for i in range(CALLS)
                    ])

                try:
                    r["us_per_call"] = round(timed(run_calls, 3) / CALLS * 1e6, 2)
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
                mx.eval([mx.quantized_matmul(x, *qcopies[i % copies], transpose=True, group_size=64, bits=4) for i in range(CALLS)])

            qrow = {
                "shape": [n_out, n_in], "batch": batch, "config": "affine-q4-quantized_matmul", "ok": True,
                "us_stacked_per_copy": round(tq * 1e6, 2), "GBps_stacked": round(qbytes / tq / 1e9, 1),
                "us_per_call": round(timed(q_calls, 3) / CALLS * 1e6, 2),
            }
            print(json.dumps(qrow), flush=True)
            result["rows"].append(qrow)
            save()
        packed_all = scales_all = copies_list = dense = wq = qcopies = None  # free before the next shape
    result["dispatch"] = dispatch_paths()
    result["seconds"] = round(time.perf_counter() - t_start, 1)
    save()
    try:
        plot(result, args.out.with_suffix(".png"))
    except Exception as exc:  # no matplotlib there: draw it later with --plot
        print(f"plot: {exc}", file=sys.stderr)
    return 0


def plot(result: dict, path: Path) -> None:
    """GB/s of weight bytes (stacked) per shape and batch: best layout, old body, affine 4-bit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r.get("ok") and "GBps_stacked" in r]
    groups = sorted({(tuple(r["shape"]), r["batch"]) for r in rows}, key=lambda g: (g[1], g[0]))
    series = {"trellis 3-bit, best layout": [], "trellis 3-bit, old smem body": [], "affine 4-bit quantized_matmul": []}
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


def dispatch_paths() -> dict:
    """Per-call cost of the ways to launch the same kernel (96 calls on 96 small weights)."""
    out: dict = {}
    try:
        n_out, n_in, batch = 4096, 4096, 1
        ws = [random_packed(n_out, n_in, BITS, 1000 + i) for i in range(8)]
        sc = mx.ones((n_out,), mx.float16)
        x = mx.random.normal((batch, n_in)).astype(mx.bfloat16)
        xf = x.astype(mx.float32)
        mx.eval(ws, sc, x, xf)
        cfg = matvec.default_config(n_out, n_in, batch, "cuda", BITS)
        call = lambda i: matvec.trellis_matvec(x, ws[i % 8], sc, bits=BITS, L=L, block=BLOCK)  # noqa: E731
        out["wrapper_us"] = round(timed(lambda: mx.eval([call(i) for i in range(96)]), 3) / 96 * 1e6, 2)
        kern = matvec._kernel("cuda", matvec.kernel_variant("cuda"), cfg.body)
        kargs = matvec._launch_args(n_out, n_in, batch, BITS, L, BLOCK, "1mad", x.dtype, cfg, (batch,), x.dtype, sc.dtype)
        out["kernel_object_us"] = round(
            timed(lambda: mx.eval([kern(inputs=[ws[i % 8], sc, x], **kargs)[0] for i in range(96)]), 3) / 96 * 1e6, 2
        )
        from kernels.trellis.linear import TrellisLinear

        layers = []
        for i in range(8):
            layer = TrellisLinear(n_in, n_out, BITS, L, "1mad", BLOCK)
            layer.packed, layer.scales = ws[i], sc
            layers.append(layer)
        x3 = x.reshape(1, 1, n_in)
        out["trellis_linear_us"] = round(timed(lambda: mx.eval([layers[i % 8](x3) for i in range(96)]), 3) / 96 * 1e6, 2)
        out["add_op_us"] = round(timed(lambda: mx.eval([xf + float(i) for i in range(96)]), 3) / 96 * 1e6, 2)
        out["multiply_hadamard_us"] = round(
            timed(lambda: mx.eval([mx.hadamard_transform(x * xf, 1 / 64) for i in range(96)]), 3) / 96 * 1e6, 2
        )
        # the same kernel through precompiled_cuda_kernel, from MLX's on-disk cubin cache
        import glob
        import os
        import tempfile

        cache = os.environ.get("MLX_PTX_CACHE_DIR") or os.path.join(tempfile.gettempdir(), "mlx", mx.__version__, "ptx")
        source, header = matvec.kernel_sources("cuda", matvec.kernel_variant("cuda"), cfg.body)
        import hashlib

        kname = "trellis_matvec_" + hashlib.sha1((source + header).encode()).hexdigest()[:12]
        ints = "".join(f"_{v}" for _, v in kargs["template"] if isinstance(v, int))
        hits = sorted(glob.glob(os.path.join(cache, f"custom_kernel_{kname}{ints}_*.txt")))
        found = None
        if hits:
            line = Path(hits[0]).read_text().strip().split("\n")[0]
            found = (Path(hits[0]).stem, line.split("\t")[1].strip())
            out["precompiled_module"] = found[0]
        if found:
            blob = Path(cache, found[0] + ".ptx").read_bytes()
            grid, tg = kargs["grid"], kargs["threadgroup"]

            def pre(i):
                return mx.fast.precompiled_cuda_kernel(
                    name=found[1], compiled_source=blob, inputs=[ws[i % 8], sc, x], output_shapes=[(batch, n_out)],
                    output_dtypes=[x.dtype], scalars=[], grid=grid, threadgroup=tg,
                )[0]

            ref = call(0)
            got = pre(0)
            out["precompiled_matches"] = bool(mx.allclose(ref.astype(mx.float32), got.astype(mx.float32)).item())
            out["precompiled_us"] = round(timed(lambda: mx.eval([pre(i) for i in range(96)]), 3) / 96 * 1e6, 2)
        else:
            out["precompiled"] = f"no cubin found in {cache}"
    except Exception as exc:
        out["error"] = str(exc)[:300]
    print(json.dumps({"dispatch": out}), flush=True)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
