"""The few-row affine quantized matmul on CUDA: kernel speed, layout sweep, whole-model steps.

    python -m bench qmm [--quick] [--sweep] [--rows 1 2 4] [--shapes 4096x4096 ...] [--out DIR]
    python -m bench qmm --model DIR          (or --random-shape llama-3-8b: built in memory)

Kernel mode, for 4-bit group-64 bfloat16 weights of 8B-llama shapes (4096x4096, 14336x4096,
4096x14336, 6144x4096 and 28672x4096) and 1, 2, 3, 4, 5, 8, 16 rows of a 2-D x:

- "mlx": ``mx.quantized_matmul``; "ours": kernels.affine's kernel with the layout
  ``pick_config`` gives; "compiled": the same through ``mx.compile``, as FewRowQuantizedLinear
  calls it.
- Timing: CALLS calls in one graph, each on a different copy of the weight (the copies together
  over 512 MiB, so the 50 MB L2 holds none of them), one warm-up, the median of REPEATS evals.
  µs per call include MLX's dispatch, as a model pays it; GB/s = packed weight, scales and
  biases bytes / µs.
- ``--sweep``: every candidate layout (qmm.candidates) is first checked against MLX's
  quantized_matmul (float32 reference), then timed; the fastest per (shape, rows) goes into the
  table qmm.pick_config reads (``--tuned``, default kernels/affine/tuned_cuda.json, merged with
  what is there). ``--budget-s`` stops sweeping after that many seconds (the rest is timed with
  the table's or the default layout). MLX caches compiled kernels on disk (MLX_PTX_CACHE_DIR),
  so a second run on the same machine compiles nothing.
- ``--quick``: two shapes, rows 1, 4, 8, no sweep (under a minute on an H200).
- ``--prefill``: prefill-sized products instead (128 to 8,192 rows; 4- and 8-bit): MLX's
  ``quantized_matmul`` against what mlxd runs from ``linear.DEQUANTIZE_ROWS`` rows on (the
  weight dequantized to bf16, then a dense matmul), one call per evaluation, µs and TFLOPS.
  It also runs on the CPU: float32, 1B-llama shapes, 1 to 256 rows.

Every call of ours is checked against MLX first; any mismatch is printed and the run exits 1.

Model mode (``--model`` / ``--random-shape``): a decode step of B = 1, 2, 4, 8, 16 rows and a
forward of W = 2..6 tokens (the verify shape) of one sequence, each on a 32-token cache, and a
prefill of 512, 2,048 and 8,192 tokens into an empty cache, with
the variants "stock" (MLX's QuantizedLinear as loaded), "flat" (MLX's quantized_matmul with x
flattened to [rows, K]: the flattening alone) and "mlxd" (what ``kernels.affine.install`` gives:
the kernel or MLX's flattened, as its ROUTE says); ms and the ratio to the same variant's
one-row decode step. Before that, greedy tokens over GREEDY_STEPS steps of "stock" and "mlxd" are
compared and the first divergence reported (bf16 may differ in the last bits: a report, not a
failure).

Writes DIR/qmm.json and DIR/qmm.png; prints a compact table.
"""

from __future__ import annotations

import engine  # noqa: F401  (BLAS before mlx)

# isort: split

import argparse
import functools
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from bench import common
from kernels.affine import cpu as cpu_kernel
from kernels.affine import linear, qmm
from kernels.common import gpu_backend, swap_classes

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (6144, 4096), (28672, 4096)]
QUICK_SHAPES = [(4096, 4096), (14336, 4096)]
ROWS = [1, 2, 3, 4, 5, 8, 16]
QUICK_ROWS = [1, 4, 8]
BITS, GROUP, DTYPE = 4, 64, mx.bfloat16
WORKING_SET = 512 << 20
CALLS = 50
REPEATS = 5
GREEDY_STEPS = 16


def median_time(fn: Callable[[], Any], repeats: int = REPEATS) -> float:
    """Median wall time of fn() (which evaluates its own work) after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def weight_bytes(n: int, k: int, bits: int = BITS, group: int = GROUP) -> int:
    return n * k * bits // 8 + 2 * n * (k // group) * 2


def make_copies(n: int, k: int, working_set: int) -> list[tuple[mx.array, mx.array, mx.array]]:
    """Copies of a random 4-bit weight (speed does not depend on the values) over working_set."""
    copies = max(2, math.ceil(working_set / weight_bytes(n, k)))
    out = []
    for i in range(copies):
        key = mx.random.key(1000 + i)
        w = mx.random.randint(0, 2**31 - 1, (n, k * BITS // 32), key=key).astype(mx.uint32)
        scales = (mx.random.uniform(0.001, 0.01, (n, k // GROUP), key=mx.random.key(2000 + i))).astype(DTYPE)
        biases = (-8 * scales).astype(DTYPE)
        out.append((w, scales, biases))
        mx.eval(*out[-1])
    return out


def mlx_call(x: mx.array, w: tuple[mx.array, mx.array, mx.array]) -> mx.array:
    return qmm.twin(x, *w, bits=BITS, group=GROUP)


def ours_call(config: qmm.LaunchConfig | None) -> Callable[[mx.array, tuple], mx.array]:
    def call(x: mx.array, w: tuple[mx.array, mx.array, mx.array]) -> mx.array:
        return qmm.affine_qmm(x, *w, bits=BITS, group=GROUP, config=config)

    return call


def compiled_call(x: mx.array, w: tuple[mx.array, mx.array, mx.array]) -> mx.array:
    """What FewRowQuantizedLinear runs: the kernel call inside mx.compile."""
    return linear._compiled(BITS, GROUP, False)(x, *w)


def time_calls(call: Callable[[mx.array, tuple], mx.array], x: mx.array, copies: list, calls: int = CALLS) -> float:
    """µs per call: `calls` calls in one graph, call i on copy i % len(copies)."""

    def run() -> None:
        mx.eval([call(x, copies[i % len(copies)]) for i in range(calls)])

    return median_time(run) / calls * 1e6


def check(call: Callable[[mx.array, tuple], mx.array], x: mx.array, w: tuple) -> str | None:
    """None if call(x, w) agrees with MLX's quantized_matmul in float32, else why not."""
    try:
        got = call(x, w).astype(mx.float32)
        want = qmm.twin(x.astype(mx.float32), w[0], w[1].astype(mx.float32), w[2].astype(mx.float32), bits=BITS, group=GROUP)
        err = float(mx.abs(got - want).max())
        scale = float(mx.abs(want).max())
    except Exception as exc:  # noqa: BLE001 (a layout that does not compile or launch)
        return f"raised {type(exc).__name__}: {str(exc)[:300]}"
    if not (err <= 2e-2 * scale + 1e-6) or not math.isfinite(err):
        return f"max error {err:.3g} against max |y| {scale:.3g}"
    return None


def bench_kernels(args: argparse.Namespace, result: dict[str, Any], save: Callable[[], None]) -> list[str]:
    failures: list[str] = []
    shapes = args.shapes or (QUICK_SHAPES if args.quick else SHAPES)
    rows_list = args.rows or (QUICK_ROWS if args.quick else ROWS)
    working_set = int(args.working_set_mib * (1 << 20))
    tuned_path = Path(args.tuned) if args.tuned else qmm.TUNED_PATH
    tuned = {k: v.key() for k, v in qmm.load_tuned(tuned_path).items()} if args.sweep else {}
    t_start = time.perf_counter()
    result["kernels"] = []
    for n, k in shapes:
        copies = make_copies(n, k, working_set)
        wb = weight_bytes(n, k)
        for m in rows_list:
            x = (mx.random.normal((m, k), key=mx.random.key(m)) * 0.5).astype(DTYPE)
            row: dict[str, Any] = {"shape": [n, k], "rows": m, "copies": len(copies)}
            row["mlx_us"] = round(time_calls(mlx_call, x, copies), 2)
            sweeping = args.sweep and time.perf_counter() - t_start <= args.budget_s
            if args.sweep and not sweeping:
                print(f"budget spent: {n}x{k} rows {m} not swept (the table's or default layout)", flush=True)
            if sweeping:
                sweep: dict[str, float] = {}
                for cfg in qmm.candidates(DTYPE, m, BITS):
                    why = check(ours_call(cfg), x, copies[0])
                    if why is not None:
                        failures.append(f"{n}x{k} rows {m} layout {cfg.key()}: {why}")
                        print("MISMATCH", failures[-1], flush=True)
                        continue
                    sweep[cfg.key()] = round(time_calls(ours_call(cfg), x, copies), 2)
                row["sweep_us"] = sweep
                if sweep:
                    best = min(sweep, key=lambda key: sweep[key])
                    tuned[qmm.shape_key(BITS, GROUP, DTYPE, n, k, m)] = best
                    qmm.TUNED[qmm.shape_key(BITS, GROUP, DTYPE, n, k, m)] = qmm.LaunchConfig.parse(best)
            cfg = qmm.pick_config(BITS, GROUP, DTYPE, n, k, m)
            why = check(ours_call(None), x, copies[0])
            if why is not None:
                failures.append(f"{n}x{k} rows {m} layout {cfg.key()} (picked): {why}")
                print("MISMATCH", failures[-1], flush=True)
            else:
                row["ours_us"] = round(time_calls(ours_call(None), x, copies), 2)
                row["ours_layout"] = cfg.key()
                row["ours_GBps"] = round(wb / row["ours_us"] / 1e3, 1)
                row["ours_compiled_us"] = round(time_calls(compiled_call, x, copies), 2)
            row["mlx_GBps"] = round(wb / row["mlx_us"] / 1e3, 1)
            result["kernels"].append(row)
            print(json.dumps(row), flush=True)
            save()
        del copies
    if args.sweep and tuned:
        tuned_path.write_text(json.dumps(dict(sorted(tuned.items())), indent=1) + "\n")
        result["tuned_written"] = str(tuned_path)
        print(f"wrote the tuned layouts to {tuned_path}", flush=True)
    return failures


def kernel_table(rows: list[dict[str, Any]]) -> str:
    lines = ["shape        rows   mlx µs  ours µs  compiled  ours/mlx  ours/1row  ours GB/s  layout"]
    one: dict[tuple[int, int], float] = {}
    for r in rows:
        shape = tuple(r["shape"])
        ours = r.get("ours_us")
        if r["rows"] == 1 and ours:
            one[shape] = ours
        speed = f"{r['mlx_us'] / ours:8.2f}x" if ours else "       -"
        rel = f"{ours / one[shape]:9.2f}" if ours and shape in one else "        -"
        lines.append(
            f"{shape[0]:>5}x{shape[1]:<6} {r['rows']:>4} {r['mlx_us']:>8.1f} "
            f"{ours if ours else float('nan'):>8.1f} {r.get('ours_compiled_us', float('nan')):>9.1f} {speed} {rel} "
            f"{r.get('ours_GBps', float('nan')):>10.1f}  {r.get('ours_layout', 'FAILED')}"
        )
    return "\n".join(lines)


# ---- model mode ---------------------------------------------------------------------------


class FlatQuantizedLinear(nn.QuantizedLinear):
    """Variant "flat": MLX's quantized_matmul with x flattened to [rows, K] (on CUDA, as the
    product's MLX calls are), never the kernel: what the flattening alone is worth."""

    def __call__(self, x: mx.array) -> mx.array:
        y = linear.mlx_matmul(x, self["weight"], self["scales"], self.get("biases"), self.bits, self.group_size,
                              self.mode)
        return y + self["bias"] if "bias" in self else y


class FlatQuantizedEmbedding(nn.QuantizedEmbedding):
    """Variant "flat" for a tied head."""

    def as_linear(self, x: mx.array) -> mx.array:
        return linear.mlx_matmul(x, self["weight"], self["scales"], self.get("biases"), self.bits, self.group_size,
                                 self.mode)


FLAT: dict[type, type] = {nn.QuantizedLinear: FlatQuantizedLinear, nn.QuantizedEmbedding: FlatQuantizedEmbedding}
VARIANTS = ("stock", "flat", "mlxd")
DECODE_ROWS = (1, 2, 4, 8, 16)
VERIFY_WIDTHS = (2, 3, 4, 5, 6)
PREFILL_LENGTHS = (512, 2048, 8192)
PREFILL_ROWS = [128, 256, 512, 1024, 2048, 8192]
CPU_PREFILL_SHAPES = [(2048, 2048), (8192, 2048), (2048, 8192)]
CPU_PREFILL_ROWS = [1, 2, 4, 8, 15, 16, 32, 256]


def build_model(args: argparse.Namespace) -> tuple[Any, str]:
    if args.model is not None:
        from mlx_lm.utils import load_model

        model, _ = load_model(Path(args.model), lazy=False)
        return model, str(args.model)
    from mlx_lm.models import llama

    from bench.modelprep import SHAPES as MODEL_SHAPES

    cfg = dict(MODEL_SHAPES[args.random_shape], vocab_size=8192)
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(cfg))
    model.set_dtype(mx.bfloat16)
    nn.quantize(model, group_size=GROUP, bits=BITS)
    mx.eval(model.parameters())
    return model, f"random {args.random_shape} 4-bit g{GROUP}"


def _prefill(model: Any, batch: int, length: int = 32) -> list[Any]:
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    tokens = mx.random.randint(0, 8000, (batch, length), key=mx.random.key(batch)).astype(mx.int32)
    mx.eval(model(tokens, cache=cache))
    return cache


def prefill_ms(model: Any, length: int, steps: int) -> float:
    """Median ms of one forward of `length` tokens into an empty cache (the last row's logits)."""
    from mlx_lm.models.cache import make_prompt_cache

    tokens = mx.random.randint(0, 8000, (1, length), key=mx.random.key(length)).astype(mx.int32)

    def run() -> None:
        cache = make_prompt_cache(model)
        mx.eval(model(tokens, cache=cache)[:, -1])

    return median_time(run, repeats=steps) * 1e3


def step_ms(model: Any, batch: int, width: int, steps: int) -> float:
    """Median ms of a forward of [batch, width] tokens on a 32-token cache (trimmed back each time)."""
    cache = _prefill(model, batch)
    tokens = mx.random.randint(0, 8000, (batch, width), key=mx.random.key(7)).astype(mx.int32)

    def run() -> None:
        mx.eval(model(tokens, cache=cache))
        for c in cache:
            c.trim(width)

    return median_time(run, repeats=steps) * 1e3


def greedy_tokens(model: Any, prompt: list[int], steps: int) -> list[int]:
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt], dtype=mx.int32), cache=cache)
    out = []
    for _ in range(steps):
        tok = int(mx.argmax(logits[0, -1]).astype(mx.int32).tolist())  # type: ignore[arg-type]
        out.append(tok)
        logits = model(mx.array([[tok]], dtype=mx.int32), cache=cache)
    return out


def set_variant(model: Any, variant: str) -> None:
    """Put the model's quantized layers in one of VARIANTS (from any other)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}")
    linear.uninstall(model)
    swap_classes(model, {v: k for k, v in FLAT.items()})
    if variant == "flat":
        swap_classes(model, FLAT)
    elif variant == "mlxd":
        linear.install(model, force=True)


def bench_model(args: argparse.Namespace, result: dict[str, Any], save: Callable[[], None]) -> list[str]:
    model, name = build_model(args)
    result["model"] = name
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, 8000, 24)]
    set_variant(model, "stock")
    stock = greedy_tokens(model, prompt, GREEDY_STEPS)
    set_variant(model, "mlxd")
    ours = greedy_tokens(model, prompt, GREEDY_STEPS)
    first = next((i for i, (a, b) in enumerate(zip(stock, ours, strict=True)) if a != b), None)
    result["greedy"] = {"stock": stock, "mlxd": ours, "first_divergence": first}
    print(f"greedy over {GREEDY_STEPS} steps: " + ("identical" if first is None else f"first divergence at step {first}"), flush=True)
    rows = []
    for variant in VARIANTS:
        set_variant(model, variant)
        base = 0.0
        for batch in DECODE_ROWS:
            ms = step_ms(model, batch, 1, args.steps)
            base = base or ms
            rows.append({"variant": variant, "kind": "decode", "rows": batch, "ms": round(ms, 3), "ratio": round(ms / base, 2)})
            print(json.dumps(rows[-1]), flush=True)
        for width in VERIFY_WIDTHS:
            ms = step_ms(model, 1, width, args.steps)
            rows.append({"variant": variant, "kind": "verify", "rows": width, "ms": round(ms, 3), "ratio": round(ms / base, 2)})
            print(json.dumps(rows[-1]), flush=True)
        for length in PREFILL_LENGTHS:
            ms = prefill_ms(model, length, max(3, args.steps // 3))
            rows.append({"variant": variant, "kind": "prefill", "rows": length, "ms": round(ms, 3),
                         "ratio": round(ms / base, 2), "tok_s": round(length / ms * 1e3)})
            print(json.dumps(rows[-1]), flush=True)
        result["steps"] = rows
        save()
    set_variant(model, "stock")
    return []


def bench_prefill_kernels(args: argparse.Namespace, result: dict[str, Any], save: Callable[[], None]) -> list[str]:
    """MLX's quantized_matmul against dequantize + matmul (linear.affine_matmul's path from
    the device's DEQUANTIZE_ROWS rows on) for prefill-sized x, the latter checked against the
    product in float32; returns the failed checks. On the CPU: float32 (what mlxd computes
    there), 1B-llama shapes, fewer rows and repeats."""
    failures: list[str] = []
    out: list[dict[str, Any]] = result.setdefault("prefill_kernels", [])
    cpu = gpu_backend() is None
    dtype = mx.float32 if cpu else DTYPE
    result["prefill_dtype"] = str(dtype)
    repeats = 3 if cpu else 9
    for bits in (4, 8):
        for n, k in args.shapes or (CPU_PREFILL_SHAPES if cpu else SHAPES[:3]):
            w = (mx.random.normal((n, k), key=mx.random.key(n + k)) * 0.02).astype(dtype)
            wq, scales, biases = mx.quantize(w, group_size=GROUP, bits=bits)
            mx.eval(wq, scales, biases)
            del w
            for m in args.rows or (CPU_PREFILL_ROWS if cpu else PREFILL_ROWS):
                x = mx.random.normal((m, k), key=mx.random.key(m)).astype(dtype)
                mx.eval(x)

                theirs = functools.partial(qmm.twin, x, wq, scales, biases, bits=bits, group=GROUP)
                dense = functools.partial(linear.dense_matmul, x, wq, scales, biases, bits, GROUP)
                ref = x.astype(mx.float32) @ mx.dequantize(
                    wq, scales.astype(mx.float32), biases.astype(mx.float32), group_size=GROUP, bits=bits).T
                err, scale = float(mx.abs(dense().astype(mx.float32) - ref).max()), float(mx.abs(ref).max())
                if not err <= 2e-2 * scale:
                    failures.append(f"{bits}-bit {n}x{k} rows {m}: max error {err:.3g} against {scale:.3g}")
                t_mlx = median_time(lambda: mx.eval(theirs()), repeats) * 1e6  # noqa: B023 (called here)
                t_dq = median_time(lambda: mx.eval(dense()), repeats) * 1e6  # noqa: B023
                flops = 2 * m * n * k
                row = {"bits": bits, "shape": [n, k], "rows": m, "mlx_us": round(t_mlx, 1),
                       "dequantize_us": round(t_dq, 1), "mlx_tflops": round(flops / t_mlx / 1e6, 1),
                       "dequantize_tflops": round(flops / t_dq / 1e6, 1)}
                if cpu and cpu_kernel.takes(x, wq, scales, biases, bits, GROUP) and cpu_kernel.available():
                    # the CPU's few-row kernel (linear.affine_matmul's path below the dense rows)
                    few = functools.partial(cpu_kernel.qmm, x, wq, scales, biases, bits, GROUP)
                    got = few()
                    assert got is not None
                    err = float(mx.abs(got - ref).max())
                    if not err <= 1e-4 * scale:
                        failures.append(f"{bits}-bit {n}x{k} rows {m} (C++): max error {err:.3g} against {scale:.3g}")
                    row["cpu_kernel_us"] = round(median_time(lambda: mx.eval(few()), repeats) * 1e6, 1)  # noqa: B023
                out.append(row)
                print(json.dumps(out[-1]), flush=True)
            save()
    return failures


def prefill_kernel_table(rows: list[dict[str, Any]]) -> str:
    few = any("cpu_kernel_us" in r for r in rows)
    lines = [f"{'bits':>4} {'W (NxK)':>12} {'rows':>6} {'MLX µs':>10} {'dequant+mm µs':>14} {'speed-up':>9}"
             + (f" {'C++ µs':>10} {'speed-up':>9}" if few else "")]
    for r in rows:
        line = (f"{r['bits']:>4} {r['shape'][0]:>6}x{r['shape'][1]:<5} {r['rows']:>6} {r['mlx_us']:>10.1f} "
                f"{r['dequantize_us']:>14.1f} {r['mlx_us'] / r['dequantize_us']:>8.2f}x")
        if "cpu_kernel_us" in r:
            line += f" {r['cpu_kernel_us']:>10.1f} {r['mlx_us'] / r['cpu_kernel_us']:>8.2f}x"
        lines.append(line)
    return "\n".join(lines)


def model_table(rows: list[dict[str, Any]]) -> str:
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    keys = list(dict.fromkeys((r["kind"], r["rows"]) for r in rows))
    lines = ["step            " + "".join(f"{v:>22}" for v in variants)]
    for kind, m in keys:
        cells = []
        for v in variants:
            r = next((r for r in rows if r["variant"] == v and r["kind"] == kind and r["rows"] == m), None)
            cells.append(f"{r['ms']:>10.2f} ms {r['ratio']:>6.2f}x" if r else " " * 22)
        lines.append(f"{kind:<7} rows {m:<4}" + "".join(f"{c:>22}" for c in cells))
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(12, 5))
    rows = result.get("kernels") or []
    pre = result.get("prefill_kernels") or []
    if pre:
        labels = [f"{r['bits']}b {r['shape'][0]}x{r['shape'][1]}\n{r['rows']}" for r in pre]
        xs = np.arange(len(pre))
        ax.bar(xs, [r["mlx_tflops"] for r in pre], 0.4, label="mx.quantized_matmul")
        ax.bar(xs + 0.4, [r["dequantize_tflops"] for r in pre], 0.4, label="dequantize + matmul")
        ax.set_xticks(xs + 0.2)
        ax.set_xticklabels(labels, fontsize=5)
        ax.set_ylabel("TFLOPS")
        ax.set_title("affine g64 bf16 matmul, prefill-sized x")
    elif rows:
        labels = [f"{r['shape'][0]}x{r['shape'][1]}\n{r['rows']}" for r in rows]
        xs = np.arange(len(rows))
        for i, (key, name) in enumerate([("mlx_us", "mx.quantized_matmul"), ("ours_us", "ours"),
                                         ("ours_compiled_us", "ours, compiled")]):
            ax.bar(xs + i * 0.27, [r.get(key, 0) for r in rows], 0.27, label=name)
        ax.set_xticks(xs + 0.27)
        ax.set_xticklabels(labels, fontsize=6)
        ax.set_ylabel(f"µs per call ({CALLS} calls in one graph)")
        ax.set_title("affine 4-bit g64 bf16 matmul, rows of x")
    else:
        steps = result.get("steps") or []
        variants = list(dict.fromkeys(r["variant"] for r in steps))
        for v in variants:
            pts = [r for r in steps if r["variant"] == v and r["kind"] != "prefill"]
            ax.plot([f"{r['kind'][0]}{r['rows']}" for r in pts], [r["ms"] for r in pts], marker="o", label=v)
        ax.set_ylabel("ms per forward (d = decode rows, v = verify width)")
        ax.set_title(str(result.get("model", "")))
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_shape(text: str) -> tuple[int, int]:
    n, k = text.lower().split("x")
    return int(n), int(k)


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("qmm", help="few-row affine quantized matmul on CUDA: speed, sweep, model steps",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="two shapes, rows 1 4 8, no sweep")
    p.add_argument("--sweep", action="store_true", help="check and time every candidate layout")
    p.add_argument("--prefill", action="store_true", help="prefill-sized products: MLX's against dequantize + matmul")
    p.add_argument("--shapes", type=parse_shape, nargs="+", default=None, help="NxK ...")
    p.add_argument("--rows", type=int, nargs="+", default=None)
    p.add_argument("--tuned", default=None, help="the table --sweep writes (default kernels/affine/tuned_cuda.json)")
    p.add_argument("--budget-s", type=float, default=150.0, help="--sweep: stop sweeping after this (seconds)")
    p.add_argument("--working-set-mib", type=float, default=WORKING_SET / (1 << 20))
    p.add_argument("--model", type=Path, default=None, help="model mode: a quantized mlx-lm model directory")
    p.add_argument("--random-shape", default=None, help="model mode: a random 4-bit model of a bench.modelprep shape")
    p.add_argument("--steps", type=int, default=9, help="model mode: timed forwards per point (median)")
    common.add_out_arg(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if gpu_backend() != "cuda" and not (args.prefill and gpu_backend() is None):
        print("bench qmm needs MLX-CUDA (the kernel is CUDA only; --prefill also runs on the CPU)",
              file=sys.stderr)
        return 2
    out = common.out_dir(args, "qmm")
    path = out / "qmm.json"
    result: dict[str, Any] = {"device": str(mx.default_device()), "bits": BITS, "group": GROUP, "dtype": "bfloat16",
                              "calls_per_graph": CALLS}

    def save() -> None:
        common.write_json(path, "qmm", result, args)

    model_mode = args.model is not None or args.random_shape is not None
    if model_mode:
        failures = bench_model(args, result, save)
    elif args.prefill:
        failures = bench_prefill_kernels(args, result, save)
    else:
        failures = bench_kernels(args, result, save)
    save()
    plot(result, path.with_suffix(".png"))
    print()
    if model_mode:
        print(model_table(result["steps"]))
    elif args.prefill:
        print(prefill_kernel_table(result["prefill_kernels"]))
    else:
        print(kernel_table(result["kernels"]))
    print(f"wrote {path}")
    if failures:
        print(f"\nFAILED: {len(failures)} correctness check(s) against mx.quantized_matmul:", file=sys.stderr)
        for f in failures:
            print("  " + f, file=sys.stderr)
        return 1
    return 0
