"""GPU probe (session 5): find the MLX op whose CUDA launch fails, by evaluating the result of
every wrapped mx / mx.fast / nn call as soon as it is made (inputs are then already evaluated,
so the first failing eval names the op). Two scenarios, each in a child process:

    python probe_ops.py sampled     # tests' sampled draft case: vocab 8, 256 rows
    python probe_ops.py ngramk      # tinycoder, n-gram forced k=8, 4 rows, dev prompts
"""
import json, os, subprocess, sys, time

FIRST = {}


def instrument():
    import mlx.core as mx
    import mlx.nn as nn

    def shapes(xs):
        out = []
        for x in xs:
            if isinstance(x, mx.array):
                out.append([list(x.shape), str(x.dtype).replace("mlx.core.", "")])
            elif isinstance(x, (list, tuple)) and x and isinstance(x[0], mx.array):
                out.append(f"list[{len(x)}] first {list(x[0].shape)}")
            elif isinstance(x, (int, float, str)) or x is None:
                out.append(x)
        return out

    def wrap(owner, name):
        fn = getattr(owner, name)

        def w(*a, **k):
            r = fn(*a, **k)
            if FIRST:
                return r
            rs = r if isinstance(r, (list, tuple)) else [r]
            try:
                mx.eval([x for x in rs if isinstance(x, mx.array)])
            except Exception as e:  # noqa: BLE001
                if "function transformations" in str(e):
                    return r  # inside mx.compile's trace: evaluated with the compiled graph
                FIRST.update(op=f"{getattr(owner, '__name__', owner)}.{name}", args=shapes(a),
                             kwargs={kk: shapes([v])[0] if shapes([v]) else str(type(v)) for kk, v in k.items()},
                             error=str(e)[:200])
                print("FIRST FAILING OP", json.dumps(FIRST, default=str), flush=True)
                raise
            return r
        setattr(owner, name, w)

    names = [n for n in dir(mx) if not n.startswith("_") and callable(getattr(mx, n))
             and n not in ("eval", "async_eval", "array", "compile", "stream", "default_device",
                           "set_default_device", "new_stream", "default_stream", "Dtype", "Device",
                           "Stream", "synchronize", "clear_cache", "get_active_memory", "get_peak_memory",
                           "get_cache_memory", "reset_peak_memory", "set_cache_limit", "set_memory_limit",
                           "set_wired_limit", "export_to_dot", "disable_compile", "enable_compile",
                           "dtype", "finfo", "iinfo", "issubdtype", "DtypeCategory", "ArrayAt", "vmap",
                           "grad", "value_and_grad", "vjp", "jvp", "checkpoint", "custom_function",
                           "load", "save", "savez", "savez_compressed", "save_safetensors", "save_gguf",
                           "export_function", "import_function", "exporter", "device_info", "is_available",
                           "random", "fast", "linalg", "fft", "distributed", "metal", "cuda")]
    for n in names:
        try:
            wrap(mx, n)
        except Exception:  # noqa: BLE001
            pass
    for n in ("scaled_dot_product_attention", "rope", "rms_norm", "layer_norm"):
        wrap(mx.fast, n)
    # operators on arrays (matmul, getitem, arithmetic) are not wrapped: Linear covers matmuls
    orig = nn.Linear.__call__

    def lin(self, x):
        r = orig(self, x)
        if not FIRST:
            try:
                mx.eval(r)
            except Exception as e:  # noqa: BLE001
                if "function transformations" in str(e):
                    return r
                FIRST.update(op="nn.Linear", args=shapes([x, self.weight]), error=str(e)[:200])
                print("FIRST FAILING OP", json.dumps(FIRST), flush=True)
                raise
        return r
    nn.Linear.__call__ = lin


def sampled():
    from engine.api import Request, SamplingParams
    from engine.core import Engine, EngineConfig
    from engine.scheduler import SchedulerConfig
    from engine.spec import SpecConfig
    from tests.test_spec_engine import _perturbed
    from tests.tiny_models import loaded, submit, tiny_model
    m, cfg = tiny_model("llama", vocab_size=8)
    draft = _perturbed(m, cfg, 0.5, seed=5)
    instrument()
    eng = Engine(loaded(m, cfg), EngineConfig(SchedulerConfig(max_num_seqs=256, max_queue=4096),
                 spec=SpecConfig("draft", draft_model=draft, num_draft_tokens=2, adaptive=False)))
    eng.start()
    try:
        outs = [submit(eng, Request(f"r{i}", [1, 5, 2, 7, 3, 1, 5], SamplingParams(temperature=1.0, seed=i, max_tokens=2))) for i in range(256)]
        for o in outs:
            o.done.wait(120)
        fin = [o.finish for o in outs]
        print("RESULT", json.dumps({str(f): fin.count(f) for f in set(fin)}), flush=True)
    finally:
        eng.stop()


def ngramk():
    from engine.api import Request, SamplingParams
    from engine.core import Engine, EngineConfig
    from engine.loader import load_model
    from engine.scheduler import SchedulerConfig
    from engine.spec import SpecConfig
    from tests.tiny_models import submit
    lm = load_model(os.environ["MODEL"], dtype="bfloat16")
    rows = [json.loads(l) for l in open(os.environ["DATA"])][:64]
    instrument()
    eng = Engine(lm, EngineConfig(SchedulerConfig(max_num_seqs=4, max_queue=4096),
                 spec=SpecConfig("ngram", num_draft_tokens=8, adaptive=False)))
    eng.start()
    t0 = time.time()
    try:
        done = 0
        for start in range(0, 64, 4):
            outs = []
            for i in range(start, start + 4):
                text = rows[i].get("text") or json.dumps(rows[i])
                ids = lm.tokenizer.encode(text)[:200]
                outs.append(submit(eng, Request(f"r{i}", ids, SamplingParams(temperature=0.0, max_tokens=256))))
            for o in outs:
                o.done.wait(120)
            done += len(outs)
            if FIRST or time.time() - t0 > float(os.environ.get("NGRAM_BUDGET", 100)):
                break
        print("RESULT", json.dumps({"requests": done, "s": round(time.time() - t0, 1), "stats": eng.stats().spec}, default=str)[:600], flush=True)
    finally:
        eng.stop()


if __name__ == "__main__":
    if len(sys.argv) > 1:
        {"sampled": sampled, "ngramk": ngramk}[sys.argv[1]]()
    else:
        for s in ("sampled", "ngramk"):
            p = subprocess.run([sys.executable, __file__, s], capture_output=True, text=True, timeout=200)
            print(s, "rc", p.returncode)
            lines = (p.stdout + p.stderr).splitlines()
            for l in lines:
                if l.startswith(("FIRST FAILING OP", "RESULT")) or "what()" in l or "terminate" in l:
                    print("  ", l[:900])
