"""GPU probe (session 5): where MLX-CUDA's own `mx.fast.rope` stops launching (per-row offsets,
the engine's form), one child process per shape; sets the default of engine/cuda_guard.ROWS."""
import json, os, subprocess, sys, time


def case(c):
    import mlx.core as mx
    x = mx.zeros((c["B"], c["H"], c["N"], c["D"]), getattr(mx, c["dtype"]))
    off = mx.arange(c["B"], dtype=mx.int32) if c["offset"] == "array" else 7
    mx.eval(mx.fast.rope(x, c["D"], traditional=False, base=1e4, scale=1.0, offset=off))


def main():
    cases = []
    for H, D, dt in ((4, 16, "float32"), (6, 64, "bfloat16")):
        for N in (1, 9):
            for B in (32, 64, 128, 192, 256, 512):
                cases.append(dict(B=B, H=H, N=N, D=D, dtype=dt, offset="array"))
    cases += [dict(B=256, H=4, N=1, D=16, dtype="float32", offset="int"),
              dict(B=256, H=4, N=1, D=16, dtype="bfloat16", offset="array"),
              dict(B=1, H=6, N=512, D=64, dtype="bfloat16", offset="array"),
              dict(B=1, H=6, N=512, D=64, dtype="bfloat16", offset="int")]
    rows, t0 = [], time.time()
    for c in cases:
        p = subprocess.run([sys.executable, __file__, json.dumps(c)], capture_output=True, text=True, timeout=60)
        err = [l for l in (p.stdout + p.stderr).splitlines() if "rror" in l][-1:]
        row = dict(c, rows=c["B"] * c["H"] * c["N"], ok=p.returncode == 0, error=err[0][:120] if err else None)
        rows.append(row)
        print(("OK  " if row["ok"] else "FAIL"), json.dumps({k: v for k, v in row.items() if k not in ("ok",)}), flush=True)
        if time.time() - t0 > float(os.environ.get("PROBE_BUDGET", 60)):
            break
    json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "probe_rope.json"), "w"), indent=1)


if __name__ == "__main__":
    case(json.loads(sys.argv[1])) if len(sys.argv) > 1 else main()
