"""GPU probe for the next session: where MLX-CUDA aborts with `cudaStreamEndCapture ... previous
error during capture` while speculating (docs/speculative.md, Session 5; seen twice in bench.spec
runs, right after or during forced n-gram rounds).

The abort is a std::terminate: nothing survives it. So every attention call's shapes are kept
in memory and each engine step appends them to a file (flushed) before the step's eval can
abort; the file's last record is the step that died. Then `replay` runs that step's attention
calls alone, each in a child process, under CUDA graphs.

    python probe_abort.py run MODEL DATA OUTDIR [SECONDS]   # edit-like prompts, ngram-k, c=1 and 4
    python probe_abort.py replay OUTDIR/steps.jsonl          # the last step's calls, one by one
"""
import json, os, subprocess, sys, time


def run(model, data, out, seconds):
    import mlx.core as mx
    from engine.api import Request, SamplingParams
    from engine.core import Engine, EngineConfig
    from engine.loader import load_model
    from engine.scheduler import SchedulerConfig
    from engine.spec import SpecConfig
    from tests.tiny_models import submit

    calls = []
    orig = mx.fast.scaled_dot_product_attention

    def sdpa(q, k, v, *a, **kw):
        m = kw.get("mask")
        calls.append({"q": list(q.shape), "k": list(k.shape), "v": list(v.shape), "dtype": str(q.dtype),
                      "k_strides_contig": bool(k.flags.row_contiguous) if hasattr(k, "flags") else None,
                      "mask": m if isinstance(m, (str, type(None))) else [list(m.shape), str(m.dtype)]})
        return orig(q, k, v, *a, **kw)

    mx.fast.scaled_dot_product_attention = sdpa
    os.makedirs(out, exist_ok=True)
    log = open(os.path.join(out, "steps.jsonl"), "a", buffering=1)
    lm = load_model(model, dtype="bfloat16")
    import engine.core as core
    step0 = core.Engine._step

    def step(self):
        calls.clear()
        step0(self)
        log.write(json.dumps(calls[:64]) + "\n")  # flushed per line
        log.flush(); os.fsync(log.fileno())

    core.Engine._step = step
    rows = [json.loads(l) for l in open(data)]
    t0 = time.time()
    for conc in (1, 4, 1, 4):
        eng = Engine(lm, EngineConfig(SchedulerConfig(max_num_seqs=conc, max_queue=4096),
                     spec=SpecConfig("ngram", num_draft_tokens=8, adaptive=False)))
        eng.start()
        try:
            for start in range(0, 32, conc):
                outs = []
                for i in range(start, start + conc):
                    code = (rows[i].get("text") or "")[:1200]
                    ids = lm.tokenizer.encode("Rewrite this with the name f_v2:\n" + code + "\n\n" + code[:200])
                    outs.append(submit(eng, Request(f"r{conc}-{i}", ids, SamplingParams(temperature=0.0, max_tokens=256))))
                for o in outs:
                    o.done.wait(120)
                if time.time() - t0 > seconds:
                    break
        finally:
            eng.stop()
        if time.time() - t0 > seconds:
            break
    print("no abort in", round(time.time() - t0, 1), "s")


def replay(path):
    lines = [l for l in open(path) if l.strip()]
    last = json.loads(lines[-1])
    print(len(lines), "steps logged; replaying the last step's", len(last), "attention calls")
    for c in last:
        p = subprocess.run([sys.executable, __file__, "one", json.dumps(c)], capture_output=True, text=True, timeout=60)
        print("OK  " if p.returncode == 0 else f"FAIL({p.returncode})", json.dumps(c), (p.stderr.strip().splitlines() or [""])[-1][:160])


def one(c):
    import mlx.core as mx
    dt = getattr(mx, c["dtype"].replace("mlx.core.", ""))
    q, k, v = (mx.zeros(c[n], dt) for n in ("q", "k", "v"))
    m = c["mask"]
    if isinstance(m, list):
        m = mx.ones(m[0], mx.bool_)
    mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=q.shape[-1] ** -0.5, mask=m))


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "run":
        run(sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5]) if len(sys.argv) > 5 else 400)
    elif cmd == "replay":
        replay(sys.argv[2])
    else:
        one(json.loads(sys.argv[2]))
