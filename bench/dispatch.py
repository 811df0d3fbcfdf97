"""What one custom-kernel call costs inside an evaluated graph, by launch path (MLX-CUDA).

    python -m bench.dispatch [--chain 96] [--repeats 7] [--out FILE] [--png FILE] [--only GROUPS]

Every row is a chain of `--chain` dependent calls (each call's output is the next call's input)
evaluated once; per call it reports the median of `--repeats` chains: `us` (build + eval),
`build_us` (the Python call and MLX's graph construction, nothing evaluated) and `eval_us`
(mx.eval of the built chain: MLX's eval_gpu, the CUDA graph, the GPU). Groups:

  * `builtin`: x * c (a built-in op) and, per kernel group, MLX's own op for the same work;
  * `trivial`: y = x + 1 over 4096 floats as mx.fast.cuda_kernel (no template arguments; 14 int
    template arguments like trellis; a 32 KB header) and as mx.fast.precompiled_cuda_kernel fed
    our NVRTC cubin or PTX on every call (bench/precompiled.py);
  * `trellis`: kernels/trellis mat-vec, 4096x4096 3-bit L16 1MAD, batch 1, float16: the wrapper
    (trellis_matvec), the bare cuda_kernel object, the precompiled cubin, MLX affine 4-bit
    quantized_matmul and the f16 gemv;
  * every kernel also once through mx.compile(one call) (MLX replays the traced primitive: no
    Python or binding work per call after the first);
  * `skinny`: kernels/skinny at 384x384 and 4096x4096, M = 2 and 8, bfloat16: skinny_matmul, the
    bare object, the precompiled cubin and MLX's x @ W.T (cuBLASLt).

(A 'lean' precompiled path, b'' after the first call, was measured once and removed: MLX 0.32.4
fails to load it, "Binary format for key='0', ident='' is not recognized".)

Every non-current path's single-call output is compared with the current path's (`max_abs_diff`,
`equal`). A path that fails records its error and the run goes on. Also recorded: MLX's PTX
cache directory listing (does MLX write custom kernels there?), the GPU arch, the include dirs.
Without a CUDA GPU it only times `builtin` on the CPU and marks the rest skipped (CI smoke).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlxd import blas  # noqa: E402

blas.load()

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from bench import precompiled as pc  # noqa: E402
from kernels import common  # noqa: E402

GROUPS = ("builtin", "trivial", "trellis", "skinny")


def chain_time(step, x0: mx.array, chain: int, repeats: int) -> dict:
    """Median per-call µs of `chain` dependent calls: total, graph build only, eval only."""

    def build():
        x = x0
        for _ in range(chain):
            x = step(x)
        return x

    mx.eval(build())  # warm-up: compiles, loads modules, fills the per-shape caches
    mx.synchronize()
    tot, bld, ev = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        y = build()
        t1 = time.perf_counter()
        mx.eval(y)
        t2 = time.perf_counter()
        tot.append(t2 - t0)
        bld.append(t1 - t0)
        ev.append(t2 - t1)
    per = 1e6 / chain
    return {
        "us": round(statistics.median(tot) * per, 2),
        "build_us": round(statistics.median(bld) * per, 2),
        "eval_us": round(statistics.median(ev) * per, 2),
        "min_us": round(min(tot) * per, 2),
    }


def compare(ref: mx.array, out: mx.array) -> dict:
    a = np.array(ref.astype(mx.float32))
    b = np.array(out.astype(mx.float32))
    if a.shape != b.shape:
        return {"equal": False, "shape": [list(a.shape), list(b.shape)]}
    finite = np.isfinite(a) & np.isfinite(b)
    return {
        "equal": bool(np.array_equal(a, b, equal_nan=True)),
        "max_abs_diff": float(np.max(np.abs(a[finite] - b[finite]))) if finite.any() else None,
        "ref_max_abs": float(np.max(np.abs(a[finite]))) if finite.any() else None,
    }


class Runner:
    def __init__(self, args, result: dict):
        self.args = args
        self.result = result
        self.rows = result["rows"]

    def save(self) -> None:
        if self.args.out:
            Path(self.args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(self.args.out).write_text(json.dumps(self.result, indent=1))

    phase = 0  # 1: the current paths and MLX's ops; 2: the precompiled ones (after, so that a
    # precompiled failure inside MLX's eval cannot spoil the baseline rows)

    @staticmethod
    def precompiled_path(path: str) -> bool:
        return "precompiled" in path.lower()

    def wants(self, path: str) -> bool:
        return self.precompiled_path(path) == (self.phase == 2)

    def row(
        self, group: str, case: str, path: str, step, x0, ref_step=None, **extra
    ) -> dict | None:
        """Time one path; with ref_step, compare one call's output with the reference path's."""
        if not self.wants(path):
            return None
        row = {"group": group, "case": case, "path": path, **extra}
        t0 = time.perf_counter()
        try:
            if ref_step is not None:
                out = step(x0)
                ref = ref_step(x0)
                row["check"] = compare(ref, out)
            row.update(chain_time(step, x0, self.args.chain, self.args.repeats))
        except Exception as exc:  # noqa: BLE001 (record and go on)
            row["error"] = f"{type(exc).__name__}: {exc}"[:1500]
            row["trace"] = traceback.format_exc()[-1500:]
        row["wall_s"] = round(time.perf_counter() - t0, 2)
        self.rows.append(row)
        shown = {k: v for k, v in row.items() if k != "trace"}
        print(json.dumps(shown), flush=True)
        self.save()
        return row


# ---- groups -------------------------------------------------------------------------------------


def group_builtin(r: Runner) -> None:
    x = mx.random.normal((1, 4096)).astype(mx.float16)
    mx.eval(x)
    r.row("builtin", "x*c 1x4096 f16", "builtin", lambda v: v * 1.0001, x)


TRIVIAL_SRC = """
    const unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < 4096u) {
        y[i] = x[i] + 1.0f;
    }
"""


def group_trivial(r: Runner) -> None:
    x = mx.zeros((4096,), dtype=mx.float32)
    mx.eval(x)
    base = {
        "grid": (4096, 1, 1),
        "threadgroup": (256, 1, 1),
        "output_shapes": [(4096,)],
        "output_dtypes": [mx.float32],
    }
    spec = pc.KernelSpec("mlxd_trivial_add", ("x",), ("y",), TRIVIAL_SRC, "")
    plain = mx.fast.cuda_kernel(
        name="mlxd_trivial_add", input_names=["x"], output_names=["y"], source=TRIVIAL_SRC
    )

    def ck(v):
        return plain(inputs=[v], **base)[0]

    r.row("trivial", "add 4096 f32", "cuda_kernel", ck, x)
    r.row(
        "trivial",
        "add 4096 f32",
        "cuda_kernel, mx.compile per call",
        mx.compile(ck),
        x,
        ref_step=ck,
    )
    tmpl = [(f"T{i}", i + 1) for i in range(14)]
    r.row(
        "trivial",
        "add 4096 f32",
        "cuda_kernel+14 template",
        lambda v: plain(inputs=[v], template=tmpl, **base)[0],
        x,
        ref_step=ck,
    )
    big = mx.fast.cuda_kernel(
        name="mlxd_trivial_add_big",
        input_names=["x"],
        output_names=["y"],
        source=TRIVIAL_SRC,
        header="// " + "x" * 32768 + "\n",
    )
    r.row(
        "trivial",
        "add 4096 f32",
        "cuda_kernel+32KB header",
        lambda v: big(inputs=[v], **base)[0],
        x,
        ref_step=ck,
    )
    add_precompiled(r, "trivial", "add 4096 f32", spec, base, [mx.float32], lambda v: [v], x, ck)
    # PTX instead of a cubin (MLX JITs it once at module load)
    if not r.wants("precompiled ptx blob"):
        return
    try:
        func = "mlxd_trivial_add_ptx"
        src = pc.precompiled_source(spec, func, [], [mx.float32], [mx.float32])
        ptx = pc.nvrtc_compile(src, pc.gpu_arch(), cubin=False)
        kw = {
            "name": func,
            "compiled_source": ptx,
            "scalars": [],
            "ensure_row_contiguous": True,
            **base,
        }
        r.row(
            "trivial",
            "add 4096 f32",
            "precompiled ptx blob",
            lambda v: mx.fast.precompiled_cuda_kernel(inputs=[v], **kw)[0],
            x,
            ref_step=ck,
            blob_bytes=len(ptx),
        )
    except Exception as exc:  # noqa: BLE001
        r.rows.append(
            {
                "group": "trivial",
                "case": "add 4096 f32",
                "path": "precompiled ptx blob",
                "error": str(exc)[:1500],
            }
        )


def add_precompiled(
    r: Runner, group, case, spec, args, input_dtypes, inputs_of, x0, ref_step
) -> None:
    """Row 'precompiled blob' for one kernel call `args`: our cubin passed on every call."""
    if not r.wants("precompiled blob"):
        return
    try:
        t0 = time.perf_counter()
        fn, kw = pc.precompiled_call(spec, args, input_dtypes)
        compile_s = round(time.perf_counter() - t0, 3)
    except Exception as exc:  # noqa: BLE001
        r.rows.append(
            {
                "group": group,
                "case": case,
                "path": "precompiled blob",
                "error": f"compile: {exc}"[:3000],
            }
        )
        print(json.dumps(r.rows[-1]), flush=True)
        return
    r.row(
        group,
        case,
        "precompiled blob",
        lambda v: fn(inputs=inputs_of(v), **kw)[0],
        x0,
        ref_step=ref_step,
        blob_bytes=len(kw["compiled_source"]),
        compile_s=compile_s,
    )


def group_trellis(r: Runner) -> None:
    from kernels.trellis import matvec

    n_out = n_in = 4096
    bits, L, block = 3, 16, 256
    rng = np.random.default_rng(7)
    packed = mx.array(rng.integers(0, 2**32, size=(n_out, n_in * bits // 32), dtype=np.uint32))
    scales = mx.full((n_out,), 1.0 / 64.0, dtype=mx.float16)
    x = mx.random.normal((1, n_in)).astype(mx.float16)
    mx.eval(packed, scales, x)
    case = "4096x4096 3-bit b1 f16"
    kw = {"bits": bits, "L": L, "block": block}
    cfg = matvec.default_config(n_out, n_in, 1, "cuda", bits)
    variant = matvec.kernel_variant("cuda")
    r.result["trellis_config"] = {"layout": cfg.key(), "variant": variant}

    def wrapper(v):
        return matvec.trellis_matvec(v, packed, scales, **kw)

    r.row("trellis", case, "wrapper (current)", wrapper, x)
    r.row(
        "trellis",
        case,
        "wrapper, mx.compile per call",
        mx.compile(wrapper),
        x,
        ref_step=wrapper,
    )
    kern = matvec._kernel("cuda", variant, cfg.body)
    args = matvec._launch_args(
        n_out, n_in, 1, bits, L, block, "1mad", mx.float16, cfg, (1,), mx.float16, mx.float16
    )
    r.row(
        "trellis",
        case,
        "kernel object",
        lambda v: kern(inputs=[packed, scales, v], **args)[0],
        x,
        ref_step=wrapper,
    )
    add_precompiled(
        r,
        "trellis",
        case,
        pc.trellis_spec(variant, cfg.body),
        args,
        [packed.dtype, scales.dtype, mx.float16],
        lambda v: [packed, scales, v],
        x,
        wrapper,
    )
    # the product path: TrellisLinear (sign flip, Hadamard, kernel) op by op and as one
    # mx.compile'd function (kernels/trellis/matvec.fused_decode, MLXD_TRELLIS_COMPILE)
    from kernels.trellis.linear import TrellisLinear

    layer = TrellisLinear(n_in, n_out, bits, L, "1mad", block)
    layer.packed, layer.scales = packed, scales
    x3 = x.reshape(1, 1, n_in)
    saved = matvec.COMPILE
    try:
        matvec.COMPILE = False
        plain = layer(x3)
        mx.eval(plain)
        r.row("trellis", case, "TrellisLinear, MLXD_TRELLIS_COMPILE=0", layer, x3)
        matvec.COMPILE = True
        r.row(
            "trellis",
            case,
            "TrellisLinear, compiled decode",
            layer,
            x3,
            ref_step=lambda v: plain,
        )
    finally:
        matvec.COMPILE = saved
    # MLX's own ops on the same shape: affine 4-bit g64 quantized_matmul and a float16 gemv
    w = (mx.random.normal((n_out, n_in)) / 64).astype(mx.float16)
    wq, sq, bq = mx.quantize(w, group_size=64, bits=4)
    mx.eval(w, wq, sq, bq)
    r.row(
        "trellis",
        case,
        "mlx quantized_matmul 4-bit g64",
        lambda v: mx.quantized_matmul(v, wq, sq, bq, transpose=True, group_size=64, bits=4),
        x,
    )
    r.row("trellis", case, "mlx f16 gemv x @ W.T", lambda v: v @ w.T, x)


def group_skinny(r: Runner) -> None:
    from kernels.skinny import kernel as sk

    for n in (384, 4096):
        w = (mx.random.normal((n, n)) / np.sqrt(n)).astype(mx.bfloat16)
        mx.eval(w)
        for m in (2, 8):
            case = f"{n}x{n} M={m} bf16"
            x = mx.random.normal((m, n)).astype(mx.bfloat16)
            mx.eval(x)

            def current(v, w=w):
                return sk.skinny_matmul(v, w)

            r.row("skinny", case, "skinny_matmul (current)", current, x)
            r.row(
                "skinny",
                case,
                "skinny_matmul, mx.compile per call",
                mx.compile(current),
                x,
                ref_step=current,
            )
            args, dims = sk.launch_args(m, n, n, mx.bfloat16, (m,)), sk._dims(n, n)
            kern = sk._kernel()
            r.row(
                "skinny",
                case,
                "kernel object",
                lambda v, w=w, a=args, d=dims, k=kern: k(inputs=[w, v, d], **a)[0],
                x,
                ref_step=current,
            )
            add_precompiled(
                r,
                "skinny",
                case,
                pc.skinny_spec(),
                args,
                [mx.bfloat16, mx.bfloat16, mx.int32],
                lambda v, w=w, d=dims: [w, v, d],
                x,
                current,
            )
            r.row("skinny", case, "mlx x @ W.T", lambda v, w=w: v @ w.T, x)
        x1 = mx.random.normal((1, n)).astype(mx.bfloat16)
        mx.eval(x1)
        r.row("skinny", f"{n}x{n} M=1 bf16", "mlx gemv x @ W.T", lambda v, w=w: v @ w.T, x1)


# ---- the rest -----------------------------------------------------------------------------------


def environment() -> dict:
    env = {
        "mlx": mx.__version__,
        "python": platform.python_version(),
        "chain_note": "chained calls, one weight (L2-warm)",
    }
    try:
        env["device_info"] = {
            k: (v if isinstance(v, (int, float, str)) else str(v))
            for k, v in mx.device_info().items()
        }
    except Exception as exc:  # noqa: BLE001
        env["device_info_error"] = str(exc)
    env["backend"] = common.gpu_backend()
    if env["backend"] == "cuda":
        for key, fn in (("arch", pc.gpu_arch), ("include_dirs", pc.cuda_include_dirs)):
            try:
                env[key] = fn()
            except Exception as exc:  # noqa: BLE001
                env[key + "_error"] = str(exc)
        env["libnvrtc"] = pc._find_loaded("libnvrtc")
    return env


def ptx_cache_listing() -> dict:
    import tempfile

    cache = os.environ.get("MLX_PTX_CACHE_DIR") or os.path.join(
        tempfile.gettempdir(), "mlx", mx.__version__, "ptx"
    )
    if not os.path.isdir(cache):
        return {"dir": cache, "exists": False}
    names = sorted(os.listdir(cache))
    return {
        "dir": cache,
        "exists": True,
        "files": len(names),
        "custom_kernel_files": [n for n in names if n.startswith("custom_kernel_")][:40],
        "sample": names[:20],
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if "us" in r]
    if not rows:
        return
    labels = [f"{r['group']}: {r['case']} | {r['path']}" for r in rows]
    fig, ax = plt.subplots(figsize=(12, 0.28 * len(rows) + 1.5))
    ys = list(range(len(rows)))[::-1]
    ax.barh(ys, [r["build_us"] for r in rows], color="#1f77b4", label="graph build (host)")
    ax.barh(
        ys,
        [max(0.0, r["us"] - r["build_us"]) for r in rows],
        left=[r["build_us"] for r in rows],
        color="#ff7f0e",
        label="eval",
    )
    ax.set_yticks(ys)
    ax.set_yticklabels(labels, fontsize=7)
    ax.set_xlabel(f"µs per call (median of chains of {result['chain']})")
    ax.legend(fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(
        f"custom-kernel dispatch ({result['env'].get('device_info', {}).get('device_name', '?')}, mlx {result['env']['mlx']})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# reruns of some groups in a child process under other MLX settings (read once per process)
CHILDREN = {
    # kernels launched one by one on the stream instead of through CUDA graphs: does the graph
    # node handling account for the difference between a built-in op and a custom kernel?
    "no_cuda_graphs": ({"MLX_USE_CUDA_GRAPHS": "0"}, "builtin,trivial,trellis"),
}


def run_child(name: str, args) -> dict:
    import subprocess
    import tempfile

    if name not in CHILDREN:
        return {"error": f"unknown child {name!r}"}
    env_extra, only = CHILDREN[name]
    out = Path(tempfile.mkdtemp(prefix="mlxd-dispatch-")) / f"{name}.json"
    cmd = [
        sys.executable,
        "-m",
        "bench.dispatch",
        "--only",
        only,
        "--repeats",
        "5",
        "--children",
        "",
    ]
    cmd += ["--chain", str(args.chain), "--out", str(out), "--png", str(out.with_suffix(".png"))]
    env = {**os.environ, **env_extra}
    env.pop("OUT", None)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd,
            env=env,
            cwd=str(Path(__file__).resolve().parent.parent),
            capture_output=True,
            text=True,
            timeout=args.child_timeout,
        )
        tail = (proc.stdout + proc.stderr)[-1500:]
        rc = proc.returncode
    except subprocess.TimeoutExpired as exc:
        tail, rc = f"timeout after {args.child_timeout} s: {str(exc.stdout or '')[-800:]}", None
    res = {"env": env_extra, "rc": rc, "wall_s": round(time.perf_counter() - t0, 1)}
    if out.exists():
        child = json.loads(out.read_text())
        res["rows"] = [{k: v for k, v in row.items() if k != "trace"} for row in child["rows"]]
    if rc != 0:
        res["tail"] = tail
    print(json.dumps({"child": name, "rc": rc, "rows": len(res.get("rows", []))}), flush=True)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chain", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--only", default=",".join(GROUPS), help="comma list of " + ",".join(GROUPS))
    ap.add_argument(
        "--out", default=None, help="JSON path (default $OUT/dispatch.json when $OUT is set)"
    )
    ap.add_argument("--png", default=None, help="PNG path (default next to --out)")
    ap.add_argument(
        "--children",
        default="no_cuda_graphs",
        help="comma list of reruns in a child process under other MLX settings ('' for none): "
        + ",".join(CHILDREN),
    )
    ap.add_argument("--child-timeout", type=float, default=75.0)
    ap.add_argument(
        "--budget", type=float, default=165.0, help="seconds: children only while within it"
    )
    args = ap.parse_args(argv)
    if args.out is None and os.environ.get("OUT"):
        args.out = os.path.join(os.environ["OUT"], "dispatch.json")
    groups = [g for g in args.only.split(",") if g]
    bad = [g for g in groups if g not in GROUPS]
    if bad:
        ap.error(f"unknown groups {bad}")
    t_start = time.perf_counter()
    result = {
        "chain": args.chain,
        "repeats": args.repeats,
        "env": environment(),
        "rows": [],
        "skipped": [],
    }
    r = Runner(args, result)
    cuda = result["env"]["backend"] == "cuda"
    for g in groups:
        if g != "builtin" and not cuda:
            result["skipped"].append({"group": g, "why": "needs a CUDA GPU (mx.fast.cuda_kernel)"})
    for phase in (1, 2):
        r.phase = phase
        for g in groups:
            if g != "builtin" and not cuda:
                continue
            try:
                fn = {
                    "builtin": group_builtin,
                    "trivial": group_trivial,
                    "trellis": group_trellis,
                    "skinny": group_skinny,
                }
                fn[g](r)
            except Exception as exc:  # noqa: BLE001 (a group's setup failed: record, go on)
                result["rows"].append(
                    {
                        "group": g,
                        "phase": phase,
                        "error": f"{type(exc).__name__}: {exc}"[:1500],
                        "trace": traceback.format_exc()[-1500:],
                    }
                )
                print(json.dumps(result["rows"][-1]), flush=True)
            r.save()
        if phase == 1:
            result["ptx_cache_after_current_paths"] = ptx_cache_listing()
    result["ptx_cache"] = ptx_cache_listing()
    if cuda:
        for name in [c for c in args.children.split(",") if c]:
            left = args.budget - (time.perf_counter() - t_start)
            if left < 20:
                result.setdefault("children", {})[name] = {"skipped": f"budget: {left:.0f} s left"}
                continue
            args.child_timeout = min(args.child_timeout, left)
            result.setdefault("children", {})[name] = run_child(name, args)
            r.save()
    result["wall_s"] = round(time.perf_counter() - t_start, 1)
    r.save()
    if args.out:
        png = Path(args.png or Path(args.out).with_suffix(".png"))
        try:
            plot(result, png)
        except Exception as exc:  # noqa: BLE001
            print(f"plot failed: {exc}", flush=True)
    print(
        json.dumps(
            {
                "done": True,
                "wall_s": result["wall_s"],
                "rows": len(result["rows"]),
                "errors": sum(1 for x in result["rows"] if "error" in x),
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
