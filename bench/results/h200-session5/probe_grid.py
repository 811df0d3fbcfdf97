"""GPU probe (session 5): which attention / copy shapes make MLX-CUDA 0.32.4 fail with
`invalid argument` at kernel launch (CUDA caps gridDim.y at 65,535; MLX PR #3666 moved the
overflow of non-contiguous copies to gridDim.z, mid-2026). One child process per case: a
failed launch can poison the stream."""
import json, os, subprocess, sys, time


def case(spec):
    import mlx.core as mx
    kind = spec["kind"]
    if kind == "copy":
        B, H, C, D, T = spec["shape"]
        x = mx.zeros((B, H, C, D), mx.bfloat16)
        y = x[..., :T, :]
        mx.eval(mx.contiguous(y) if spec.get("contig") else y + 1)
        return
    B, Hq, Hkv, D, N, K, mask, sliced = (spec[k] for k in ("B", "Hq", "Hkv", "D", "N", "K", "mask", "sliced"))
    q = mx.zeros((B, Hq, N, D), mx.bfloat16)
    cap = K + 256 if sliced else K
    kb = mx.zeros((B, Hkv, cap, D), mx.bfloat16)
    vb = mx.zeros((B, Hkv, cap, D), mx.bfloat16)
    mx.eval(q, kb, vb)
    k, v = (kb[..., :K, :], vb[..., :K, :]) if sliced else (kb, vb)
    m = None
    if mask == "array":
        m = mx.ones((B, 1, N, K), mx.bool_)
    elif mask == "causal":
        m = "causal"
    out = mx.fast.scaled_dot_product_attention(q, k, v, scale=D ** -0.5, mask=m)
    mx.eval(out)


def main():
    cases = []
    for B in (64, 128, 256):
        cases.append({"kind": "copy", "shape": [B, 2, 512, 16, 256]})
        cases.append({"kind": "copy", "shape": [B, 2, 512, 64, 256], "contig": True})
    for D in (16, 64):
        for N in (1, 3):
            for B in (32, 64, 256):
                for mask in ("none", "array"):
                    for sliced in (False, True):
                        cases.append(dict(kind="sdpa", B=B, Hq=4 if D == 16 else 6, Hkv=2, D=D, N=N, K=256, mask=mask, sliced=sliced))
    rows = []
    t0 = time.time()
    for c in cases:
        p = subprocess.run([sys.executable, __file__, json.dumps(c)], capture_output=True, text=True, timeout=60)
        err = [l for l in (p.stdout + p.stderr).splitlines() if "Error" in l or "error" in l][-1:]
        row = dict(c, ok=p.returncode == 0, error=err[0][:160] if err else None)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if time.time() - t0 > float(os.environ.get("PROBE_BUDGET", 90)):
            break
    json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "probe_grid.json"), "w"), indent=1)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        case(json.loads(sys.argv[1]))
    else:
        main()
