"""`attention`: decode attention over rows of different lengths, mlxd's kernel
(kernels/attention/decode.py) against MLX's masked attention, per shape.

    python -m bench attention                                   # on a CUDA GPU
    python -m bench attention --heads 32x8x64,32x8x128 --rows 1,16,64 --contexts 1024,8192,16384

Each case: B rows with one query each, Hq query heads over Hkv KV heads of D dims (bf16), keys a
slice of a buffer 256 columns wider (what the engine's layouts hand over), row lengths drawn in
[C/2, C] with the first row at C. Timed as `--layers` dependent-free calls per evaluation (one
decode step of a model with that many layers), the fastest of `--repeats` evaluations after a
warm-up; the kernel's largest difference from the masked result is checked. Where the kernel
cannot run (no MLX-CUDA), only the masked route is timed. Writes `attention.json` and
`attention.png`.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from bench import common


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("attention", help="decode attention over rows of different lengths: "
                       "kernel vs MLX's masked attention", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", type=_heads, default=[(32, 8, 64), (32, 8, 128), (16, 8, 128)],
                   help="query x KV heads x head dim, comma-separated (default Llama-3.2-1B, "
                        "Llama-3-8B, Qwen3-style)")
    p.add_argument("--rows", type=common.int_list, default=[1, 16, 64])
    p.add_argument("--contexts", type=common.int_list, default=[1024, 8192, 16384])
    p.add_argument("--layers", type=int, default=16, help="calls per evaluation")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    common.add_out_arg(p)
    p.set_defaults(func=cmd_attention)


def _heads(text: str) -> list[tuple[int, int, int]]:
    out = []
    for part in text.split(","):
        hq, hkv, d = (int(x) for x in part.lower().split("x"))
        out.append((hq, hkv, d))
    return out


def _fastest_ms(fn: Any, inputs: tuple[Any, ...], layers: int, repeats: int) -> float:
    """The fastest of `repeats` evaluations of `layers` calls `fn(*inputs)`, after one warm-up."""
    import mlx.core as mx

    mx.eval([fn(*inputs) for _ in range(layers)])
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval([fn(*inputs) for _ in range(layers)])
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def run(args: argparse.Namespace) -> dict[str, Any]:
    import mlx.core as mx
    import numpy as np

    from kernels.attention import decode
    from kernels.common import gpu_backend

    kernel = gpu_backend() == "cuda"
    rng = np.random.default_rng(args.seed)
    rows_out = []
    for hq, hkv, d in args.heads:
        for b in args.rows:
            for c in args.contexts:
                shape = (b, hkv, c + 256, d)
                q = mx.array(rng.normal(size=(b, hq, 1, d))).astype(mx.bfloat16)
                k = mx.array(rng.normal(size=shape)).astype(mx.bfloat16)[:, :, :c]
                v = mx.array(rng.normal(size=shape)).astype(mx.bfloat16)[:, :, :c]
                lens_np = rng.integers(c // 2, c + 1, size=b)
                lens_np[0] = c
                lens = mx.array(lens_np.astype(np.int32))
                scale = d ** -0.5
                row: dict[str, Any] = dict(q_heads=hq, kv_heads=hkv, head_dim=d, rows=b,
                                           context=c, keys=int(lens_np.sum()))
                inputs = (q, k, v, lens, scale)
                row["masked_ms"] = _fastest_ms(decode.twin, inputs, args.layers, args.repeats)
                if kernel:
                    want = decode.twin(q, k, v, lens, scale).astype(mx.float32)
                    got = decode.decode_attention(q, k, v, lens, scale).astype(mx.float32)
                    row["max_abs_err"] = float(mx.abs(got - want).max())
                    row["kernel_ms"] = _fastest_ms(decode.decode_attention, inputs, args.layers,
                                                   args.repeats)
                    row["speedup"] = row["masked_ms"] / row["kernel_ms"]
                    # bytes of K and V the rows' queries read, over the kernel's time
                    kv_bytes = 2 * row["keys"] * hkv * d * 2 * args.layers
                    row["kernel_gb_s"] = kv_bytes / (row["kernel_ms"] / 1e3) / 1e9
                rows_out.append(row)
                print(" ".join(f"{key}={val:.3g}" if isinstance(val, float) else f"{key}={val}"
                               for key, val in row.items()), flush=True)
    return {"layers": args.layers, "kernel": kernel, "machine": common.machine_info(),
            "rows": rows_out}


def plot(result: dict[str, Any], png: Any) -> Any:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    groups: dict[tuple[int, int, int, int], list[dict[str, Any]]] = {}
    for r in result["rows"]:
        groups.setdefault((r["q_heads"], r["kv_heads"], r["head_dim"], r["rows"]), []).append(r)
    for (hq, hkv, d, b), rs in groups.items():
        xs = [r["context"] for r in rs]
        line = ax.plot(xs, [r["masked_ms"] for r in rs], linestyle="--", marker="o",
                       label=f"masked {hq}/{hkv}x{d}, {b} rows")[0]
        if result.get("kernel"):
            ax.plot(xs, [r["kernel_ms"] for r in rs], color=line.get_color(), marker="s",
                    label=f"kernel {hq}/{hkv}x{d}, {b} rows")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (keys of the longest row)")
    ax.set_ylabel(f"ms per {result['layers']} calls")
    ax.set_title("decode attention over rows of different lengths")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


def cmd_attention(args: argparse.Namespace) -> int:
    out = common.out_dir(args, "attention")
    result = run(args)
    path = common.write_json(out / "attention.json", "attention", result, args)
    plot(result, path.with_suffix(".png"))
    print(f"wrote {path}, {path.with_suffix('.png')}")
    return 0
