"""Mat-vec speed of trellis weights vs MLX's 4-bit quantized_matmul and a bf16 matmul (GPU).

    python -m bench trellis speed [--bits 3] [--batches 1 4] [--out DIR]

For each weight shape (n_out x n_in) and batch (rows of x):

- "per call": R independent calls, cycling over C copies of the weight (C chosen so the copies
  together are >= 512 MB, far above the H200's 50 MB L2, so every call streams from HBM), all in one
  mx.eval; time per call = wall / R (this includes MLX's per-op dispatch, as a model pays it).
- "stacked": one call on the C copies stacked along n_out (one launch, same bytes): the kernel's
  streaming rate with the dispatch cost amortised. Bandwidth = weight bytes read / time.

Trellis rows use uniformly random codes (speed does not depend on the values) with L = 16 and
x~ already rotated (float32); "trellis 3-bit + rotate" is the whole TrellisLinear call. Also
reports the read bandwidth of a large mx.sum (the ceiling we compare against) and encoder speed
(weights/s of quantize_weight). Writes DIR/trellis_speed.json and .png.
"""

from __future__ import annotations

import engine  # noqa: F401  (BLAS before mlx)

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
from kernels.trellis.linear import TrellisLinear
from kernels.trellis.quantizer import TrellisSpec, quantize_weight, rotate

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336)]
WORKING_SET = 512 << 20  # bytes of weight copies a "per call" run cycles over (>> the L2)


def timed(fn: Callable[[], Any], repeats: int = 3) -> float:
    """Best wall time of fn() (which evaluates its own work), after one warm-up."""
    fn()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def per_call_and_stacked(make_weight: Callable[[int], Any], call: Callable[[mx.array, Any], mx.array],
                         weight_bytes: int, x: mx.array, working_set: int, calls: int = 96,
                         module_call: Callable[[list[Any]], list[Any]] | None = None) -> dict[str, Any]:
    """module_call(weights) -> list of per-copy callables, when a call is a module (TrellisLinear)."""
    copies = max(2, min(128, math.ceil(working_set / weight_bytes)))
    weights = [make_weight(i) for i in range(copies)]
    mx.eval(weights)
    fns = module_call(weights) if module_call else [lambda x, w=w: call(x, w) for w in weights]

    def run_calls():
        mx.eval([fns[i % copies](x) for i in range(calls)])

    per_call = timed(run_calls) / calls
    fns.clear()
    stacked_w: Any
    if isinstance(weights[0], (tuple, list)):
        stacked_w = tuple(mx.concatenate(list(parts), axis=0) for parts in zip(*weights, strict=True))
    else:
        stacked_w = mx.concatenate(weights, axis=0)
    weights.clear()
    mx.eval(stacked_w)

    def run_stacked():
        mx.eval(call(x, stacked_w))

    stacked = timed(run_stacked, repeats=5)
    return {
        "us_per_call": round(per_call * 1e6, 2),
        "GBps_per_call": round(weight_bytes / per_call / 1e9, 1),
        "us_stacked_per_copy": round(stacked / copies * 1e6, 2),
        "GBps_stacked": round(weight_bytes * copies / stacked / 1e9, 1),
        "copies": copies,
        "weight_bytes": weight_bytes,
    }


def bench_shape(n_out: int, n_in: int, batch: int, bits_list: list[int],
                working_set: int = WORKING_SET) -> list[dict[str, Any]]:
    rows = []
    key = mx.random.key(n_out * 7 + n_in + batch)
    x = mx.random.normal((batch, n_in), key=key).astype(mx.bfloat16)

    def add(name: str, res: dict) -> None:
        row = {"shape": [n_out, n_in], "batch": batch, "variant": name, **res}
        rows.append(row)
        print(json.dumps(row), flush=True)

    add(
        "bf16 matmul",
        per_call_and_stacked(
            lambda i: mx.random.normal((n_out, n_in), key=mx.random.key(i)).astype(mx.bfloat16),
            lambda x, w: x @ w.T,
            2 * n_out * n_in,
            x,
            working_set,
        ),
    )

    def affine(i):
        w = mx.random.normal((n_out, n_in), key=mx.random.key(i)).astype(mx.bfloat16)
        return mx.quantize(w, 64, 4)

    add(
        "affine 4-bit g64 quantized_matmul",
        per_call_and_stacked(
            affine,
            lambda x, w: mx.quantized_matmul(x, w[0], w[1], w[2], transpose=True, group_size=64,
                                             bits=4),
            n_out * n_in // 2 + 2 * 2 * n_out * n_in // 64,
            x,
            working_set,
        ),
    )

    x_rot = rotate(x, mx.ones((n_in,), mx.int8))
    block = 256
    backend = matvec.fused_backend() or "cuda"
    for bits in bits_list:
        # the launch layout of the real shape (tuned table or heuristic), also for the stacked launch
        cfg = matvec.default_config(n_out, n_in, batch, backend, bits)

        def trellis(i, bits=bits):
            rng = np.random.default_rng(i)
            packed = rng.integers(0, 2**32, size=(n_out, n_in * bits // 32), dtype=np.uint32)
            return (mx.array(packed), mx.array(rng.uniform(0.5, 2, n_out).astype(np.float16)))

        def call(x, w, bits=bits, cfg=cfg):
            return matvec.trellis_matvec(x, w[0], w[1], bits=bits, L=16, block=block, config=cfg)

        res = per_call_and_stacked(trellis, call, n_out * n_in * bits // 8 + 2 * n_out, x_rot,
                                   working_set)
        add(f"trellis {bits}-bit", {**res, "layout": cfg.key()})

        if bits == 3:
            signs = mx.ones((n_in,), mx.int8)

            def full(x, w, bits=bits, cfg=cfg, signs32=signs.astype(mx.float32)):
                # what TrellisLinear runs: sign flip + Hadamard, one kernel, output in x's dtype
                return matvec.trellis_matvec(
                    rotate(x, signs32), w[0], w[1], bits=bits, L=16, block=block, config=cfg, out_dtype=x.dtype
                )

            def modules(weights, bits=bits, signs=signs):
                layers = []
                for packed, scales in weights:
                    layer = TrellisLinear(n_in, n_out, bits, 16, "1mad", block)
                    layer.packed, layer.scales, layer.signs = packed, scales, signs
                    layers.append(layer)
                return layers

            res = per_call_and_stacked(trellis, full, n_out * n_in * 3 // 8 + 2 * n_out, x,
                                       working_set, module_call=modules)
            add("trellis 3-bit + rotate (TrellisLinear)", {**res, "layout": cfg.key()})
    return rows


def read_bandwidth(num: int = 1 << 30) -> dict:
    big = mx.ones((num,), dtype=mx.float32)  # 4 GiB by default
    mx.eval(big)
    t = timed(lambda: mx.eval(mx.sum(big)), repeats=5)
    copy = timed(lambda: mx.eval(big * 2), repeats=3)
    return {"sum_read_GBps": round(big.nbytes / t / 1e9, 1), "copy_read_write_GBps": round(2 * big.nbytes / copy / 1e9, 1)}


def dispatch_overhead() -> float:
    a = mx.ones((1,))
    mx.eval(a)

    def chain():
        y = a
        for _ in range(200):
            y = y + 1
        mx.eval(y)

    return timed(chain) / 200 * 1e6


def encoder_speed(on_gpu: bool) -> list[dict]:
    rows = []
    shape = (1024, 4096) if on_gpu else (64, 1024)
    configs = [(16, 2), (16, 3), (16, 4), (12, 2), (12, 3), (12, 4)] if on_gpu else [(12, 2), (12, 4)]
    w = mx.random.normal(shape, key=mx.random.key(1))
    quantize_weight(mx.random.normal((8, 512)), TrellisSpec(bits=2, L=12))  # warm-up
    for L, bits in configs:
        t0 = time.perf_counter()
        q = quantize_weight(w, TrellisSpec(bits=bits, L=L))
        mx.eval(q.packed, q.scales)
        dt = time.perf_counter() - t0
        row = {"L": L, "bits": bits, "shape": list(shape), "seconds": round(dt, 2), "weights_per_second": round(w.size / dt)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def plot(result: dict[str, Any], path: Path) -> None:
    plt = common.pyplot()

    rows = result["matvec"]
    groups = sorted({(tuple(r["shape"]), r["batch"]) for r in rows}, key=lambda g: (g[1], g[0]))
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    fig, axes = plt.subplots(2, 1, figsize=(12, 9))
    width = 0.8 / len(variants)
    for vi, v in enumerate(variants):
        us, bw = [], []
        for g in groups:
            r = next((r for r in rows if (tuple(r["shape"]), r["batch"]) == g and r["variant"] == v), None)
            us.append(r["us_per_call"] if r else 0)
            bw.append(r["GBps_stacked"] if r else 0)
        xs = np.arange(len(groups)) + vi * width
        axes[0].bar(xs, us, width, label=v)
        axes[1].bar(xs, bw, width, label=v)
    labels = [f"{g[0][0]}x{g[0][1]}\nbatch {g[1]}" for g in groups]
    for ax in axes:
        ax.set_xticks(np.arange(len(groups)) + 0.4 - width / 2)
        ax.set_xticklabels(labels, fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("µs per call (96 calls in one eval)")
    axes[0].legend(fontsize=7, ncol=3)
    ceiling = result["bandwidth"]["sum_read_GBps"]
    axes[1].axhline(ceiling, color="k", ls="--", lw=1, label=f"mx.sum read {ceiling:.0f} GB/s")
    axes[1].axhline(4800, color="gray", ls=":", lw=1, label="H200 datasheet 4800 GB/s")
    axes[1].set_ylabel("GB/s of weight bytes (stacked, one launch)")
    axes[1].legend(fontsize=7)
    fig.suptitle(f"trellis mat-vec vs MLX ({result['device_name']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    shapes = args.shapes or SHAPES
    working_set = int(args.working_set_mib * (1 << 20))
    on_gpu = mx.default_device() == mx.gpu
    out = common.out_dir(args, "trellis-speed")
    path = out / "trellis_speed.json"
    backend = matvec.fused_backend()
    result: dict[str, Any] = {"device": str(mx.default_device()), "machine": platform.machine(),
                              "fused_backend": backend, "device_name": _device_name()}

    def save() -> None:
        common.write_json(path, "trellis-speed", result, args)

    if not args.skip_encoder:
        result["encoder"] = encoder_speed(on_gpu)
        save()
    if backend is None:
        print("no fused trellis kernel on this device: encoder speed only", file=sys.stderr)
        return 0
    result["kernel_variant"] = matvec.kernel_variant(backend)
    result["dispatch_overhead_us"] = round(dispatch_overhead(), 2)
    result["bandwidth"] = read_bandwidth(1 << 30 if working_set >= WORKING_SET else working_set // 4)
    save()
    result["matvec"] = []
    result["tuned_layouts"] = {f"{k[0]}x{k[1]}x{k[2]}": v.key() for k, v in matvec.TUNED.items()}
    for batch in args.batches:
        for n_out, n_in in shapes:
            result["matvec"] += bench_shape(n_out, n_in, batch, args.bits, working_set)
            save()
    plot(result, path.with_suffix(".png"))
    print(f"wrote {path}")
    return 0


def _device_name() -> str:
    try:
        return str(mx.device_info().get("device_name", "?"))
    except Exception:  # noqa: BLE001 (a backend without device_info)
        return "?"
