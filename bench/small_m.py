"""What a matmul or an attention call with a few query rows costs, per call, inside a graph.

    python -m bench.small_m [--dtype bfloat16] [--out FILE]

Why: on MLX-CUDA a target forward of width 2..9 (a speculative verify) or a decode step of a
batch of 2+ rows costs about twice a width-1 step for a small model (bench/step_costs.py on the
H200), although the arithmetic hardly grows. This bench isolates the two suspects, each as a
chain of `--chain` dependent calls evaluated once (so the per-call cost inside one graph is
measured, not the launch/sync of a lone op):

  * `matmul`: x[M, K] @ W.T for M rows. Variants: `plain` (what nn.Linear does: MLX-CUDA takes
    its gemv kernel only when M == 1, else cuBLASLt), `kernel` (our fused skinny GEMM,
    kernels/skinny: W read once for all M rows; CUDA only, M = 1..16), `q4` (MLX's affine 4-bit
    quantized_matmul, group 64: does the quantized path have the same one-row cliff?), `gemv_batched` (x viewed
    as M batches of one row, laid out so that MLX does not fold the batches back into M: one
    batched gemv that reads W once per row) and `split` (M separate one-row matmuls,
    concatenated);
    `gather` (engine.fewrow: `mx.gather_mm` with one row per gathered matrix, MLX-CUDA's
    gemv_gather kernel: the M one-row gemvs in one launch);
  * `attention`: scaled_dot_product_attention with w queries over L keys, with an array mask
    (the engine's case) or with none.

Each row: median µs per call over `--repeats` timed chains, and the max abs difference of the
variant's result from `plain`. At the end a table per size: plain, kernel, and the M = 1 gemv.
`--sweep` (CUDA) also times the kernel under every launch layout (rows a warp R, vectors in
flight U) per size and row count, to check what `kernels.skinny.layout` picks.
"""

from __future__ import annotations

import argparse
import json
import time

from mlxd import blas

blas.load()

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from kernels.skinny import skinny_matmul  # noqa: E402


def rows_as_batches(x: mx.array) -> mx.array:
    """x[M, K] as [M, 1, K] with strides (K, 1, 1): MLX reads it as a transposed one-row matrix
    per batch, so it neither copies it nor folds the batches into M (which would send it to
    cuBLASLt); with W.T as the shared matrix it runs one batched gemv."""
    return mx.swapaxes(x[:, :, None], 1, 2)


def mm_plain(x, w):
    return x @ w.T


def mm_gemv_batched(x, w):
    return (rows_as_batches(x) @ w.T)[:, 0, :]


def mm_split(x, w):
    return mx.concatenate([x[i : i + 1] @ w.T for i in range(x.shape[0])], axis=0)


def mm_kernel(x, w):
    return skinny_matmul(x, w)


_Q4: dict[int, tuple] = {}


def mm_q4(x, w):
    """MLX's affine 4-bit (group 64) quantized_matmul: what most MLX users decode with. Its
    max_abs_diff against `plain` is the quantization error, not a kernel error."""
    if id(w) not in _Q4:
        _Q4[id(w)] = (w, *mx.quantize(w, group_size=64, bits=4))
    _, wq, scales, biases = _Q4[id(w)]
    return mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=64, bits=4)


def mm_gather(x, w):
    """engine.fewrow: the M rows as one gathered gemv (mx.gather_mm, MLX-CUDA's gemv_gather)."""
    from engine.fewrow import gather_matmul

    return gather_matmul(x, w)


MATMULS = {"plain": mm_plain, "kernel": mm_kernel, "q4": mm_q4, "gemv_batched": mm_gemv_batched,
           "split": mm_split, "gather": mm_gather}


def _has_kernel() -> bool:
    from kernels.common import gpu_backend

    return gpu_backend() == "cuda"


def _time_chain(fn, x0, chain, repeats):
    # warm-up (JIT, cuBLAS plans)
    y = x0
    for _ in range(chain):
        y = fn(y)
    mx.eval(y)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        y = x0
        for _ in range(chain):
            y = fn(y)
        mx.eval(y)
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) / chain * 1e6, y


def bench_matmul(dtype, chain, repeats, variants, sizes=(384, 1024, 2048, 4096), ms=(1, 2, 3, 4, 5, 8, 9, 16)):
    rows = []
    for n in sizes:
        w = (mx.random.normal((n, n)) / n**0.5).astype(dtype)
        for m in ms:
            x0 = mx.random.normal((m, n)).astype(dtype)
            ref = None
            for name, f in MATMULS.items():
                if name not in variants or (name not in ("plain", "kernel", "q4") and m == 1):
                    continue
                if name == "kernel" and not _has_kernel():
                    continue
                us, y = _time_chain(lambda v, f=f, w=w: f(v, w), x0, chain, repeats)
                one = f(x0, w)
                if ref is None:
                    ref = one
                diff = float(mx.max(mx.abs(one.astype(mx.float32) - ref.astype(mx.float32))))
                row = {"kind": "matmul", "n": n, "m": m, "variant": name, "us_per_call": round(us, 2),
                       "max_abs_diff": diff}
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def sweep_layouts(dtype, chain, repeats, sizes=(1024, 4096), ms=(2, 8)):
    """The kernel under every launch layout (R rows a warp, U vectors a row in flight) per (n, m):
    what kernels.skinny.layout should pick. One NVRTC compile per layout."""
    from kernels.skinny.kernel import Layout, _pow2, layout

    rows = []
    for n in sizes:
        w = (mx.random.normal((n, n)) / n**0.5).astype(dtype)
        for m in ms:
            x0 = mx.random.normal((m, n)).astype(dtype)
            ref = mm_plain(x0, w)
            default = layout(m, n, n, dtype.size)
            best = None
            for r in (1, 2, 4):
                for u in (1, 2, 4, 8):
                    if r * m > 32 or r * u > 16:
                        continue
                    lay = Layout(m, r, u, _pow2(r * m))
                    us, _ = _time_chain(lambda v, w=w, lay=lay: skinny_matmul(v, w, lay), x0, chain, repeats)
                    diff = float(mx.max(mx.abs(skinny_matmul(x0, w, lay).astype(mx.float32) - ref.astype(mx.float32))))
                    row = {"kind": "sweep", "n": n, "m": m, "r": r, "u": u, "us_per_call": round(us, 2),
                           "max_abs_diff": diff, "default": lay == default}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
                    if best is None or us < best["us_per_call"]:
                        best = row
            print(json.dumps({"kind": "sweep_best", **best}), flush=True)
    return rows


def bench_attention(dtype, chain, repeats):
    rows = []
    heads, kv_heads, d = 6, 2, 64
    for L in (256, 1024):
        k = mx.random.normal((1, kv_heads, L, d)).astype(dtype)
        v = mx.random.normal((1, kv_heads, L, d)).astype(dtype)
        for w in (1, 2, 5, 9):
            q0 = mx.random.normal((1, heads, w, d)).astype(dtype)
            pos = mx.arange(L)[None, :] <= (L - w + mx.arange(w))[:, None]
            mask = pos[None, None]
            for name, m in (("arr_mask", mask), ("no_mask", None)):
                def f(q, m=m, k=k, v=v):
                    return mx.fast.scaled_dot_product_attention(q, k, v, scale=d**-0.5, mask=m)
                us, _ = _time_chain(f, q0, chain, repeats)
                row = {"kind": "attention", "L": L, "w": w, "variant": name, "us_per_call": round(us, 2)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def summary(rows):
    """Per (n, m): µs per call of plain / kernel, the M = 1 gemv of that size, and kernel's
    max_abs_diff from plain; printed as a table."""
    by = {(r["n"], r["m"], r["variant"]): r for r in rows}
    table = []
    print(f"{'n':>5} {'m':>3} {'plain':>8} {'kernel':>8} {'gemv m=1':>9} {'kern diff':>10}")
    for n, m in sorted({(r["n"], r["m"]) for r in rows}):
        plain, kern = by.get((n, m, "plain")), by.get((n, m, "kernel"))
        gemv = by.get((n, 1, "plain"))
        row = {"n": n, "m": m, "plain_us": plain and plain["us_per_call"], "kernel_us": kern and kern["us_per_call"],
               "gemv_m1_us": gemv and gemv["us_per_call"], "kernel_max_abs_diff": kern and kern["max_abs_diff"]}
        table.append(row)

        def f(v, w=8):
            return f"{v:>{w}.2f}" if isinstance(v, float) else f"{'-':>{w}}"

        print(f"{n:>5} {m:>3} {f(row['plain_us'])} {f(row['kernel_us'])} {f(row['gemv_m1_us'], 9)} "
              f"{row['kernel_max_abs_diff'] if kern else '-':>10}", flush=True)
    return table


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--chain", type=int, default=56)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--variants", default="plain,kernel,q4,gemv_batched,split",
                   help="matmul variants, comma-separated (" + ",".join(MATMULS) + ")")
    p.add_argument("--sizes", default="384,1024,2048,4096", help="square weight sizes, comma-separated")
    p.add_argument("--no-attention", action="store_true")
    p.add_argument("--sweep", action="store_true", help="also time every kernel launch layout (CUDA)")
    p.add_argument("--out")
    a = p.parse_args()
    dtype = getattr(mx, a.dtype)
    mm = bench_matmul(dtype, a.chain, a.repeats, a.variants.split(","),
                      sizes=tuple(int(v) for v in a.sizes.split(",")))
    att = [] if a.no_attention else bench_attention(dtype, a.chain, a.repeats)
    out = {"device": str(mx.default_device()), "dtype": a.dtype, "chain": a.chain, "rows": mm + att,
           "table": summary(mm)}
    if a.sweep and _has_kernel():
        out["sweep"] = sweep_layouts(dtype, a.chain, a.repeats)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
