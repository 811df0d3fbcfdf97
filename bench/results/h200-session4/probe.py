"""GPU probe (session 4): which configurations fail on MLX-CUDA, each in try/except."""
import json, os, sys, time, traceback
import mlx.core as mx
import numpy as np

out = {}

def rec(name, fn):
    t0 = time.perf_counter()
    try:
        out[name] = {"ok": True, "result": fn()}
    except Exception as e:  # noqa: BLE001
        out[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:400]}
    out[name]["s"] = round(time.perf_counter() - t0, 2)
    print(name, json.dumps(out[name])[:300], flush=True)

from engine.models import make_batch_layouts
from tests.tiny_models import tiny_model, loaded, submit, greedy
from engine.api import Request, SamplingParams

def kv_forward(model, bits, group):
    layouts = make_batch_layouts(model, 2, kv_bits=bits, kv_group_size=group)
    model(mx.array(np.random.default_rng(0).integers(1, 200, (2, 20))), cache=layouts)
    y = model(mx.array([[3], [4]]), cache=layouts)
    y = model(mx.array([[3, 5, 6], [4, 7, 8]]), cache=layouts)
    mx.eval(y)
    return float(y.astype(mx.float32).abs().max().item())

for dt in ("float32", "bfloat16"):
    for arch, extra in (("llama", {"head_dim": 32, "hidden_size": 128}), ("llama", {"head_dim": 64, "hidden_size": 256})):
        m, cfg = tiny_model(arch, **extra)
        m.set_dtype(getattr(mx, dt))
        for bits, group in ((8, 32), (8, 64), (4, 32), (4, 64)):
            rec(f"kv{bits}g{group}-{dt}-hd{extra['head_dim']}", lambda: kv_forward(m, bits, group))

from engine.core import Engine, EngineConfig
from engine.scheduler import SchedulerConfig
from engine.spec import SpecConfig
from tests.test_spec_engine import _perturbed

def sampled(vocab, rows, seqs=None):
    m, cfg = tiny_model("llama", vocab_size=vocab)
    draft = _perturbed(m, cfg, 0.5, seed=5)
    eng = Engine(loaded(m, cfg), EngineConfig(SchedulerConfig(max_num_seqs=seqs or max(rows, 8), max_queue=4096),
                 spec=SpecConfig("draft", draft_model=draft, num_draft_tokens=2, adaptive=False)))
    eng.start()
    try:
        outs = [submit(eng, Request(f"r{i}", [1, 5, 2, 7, 3, 1, 5], SamplingParams(temperature=1.0, seed=i, max_tokens=2))) for i in range(rows)]
        for o in outs:
            o.done.wait(120)
        fin = [o.finish for o in outs]
        errs = [ev.error for o in outs for ev in o.events if ev.error]
        return {"finish": {f: fin.count(f) for f in set(fin)}, "first_error": errs[0][:200] if errs else None}
    finally:
        eng.stop()

for vocab, rows, seqs in ((512, 16, None), (8, 16, None), (8, 64, None), (512, 256, None), (8, 256, None), (8, 3000, 256), (512, 3000, 256)):
    rec(f"sampled-draft-v{vocab}-r{rows}-s{seqs}", lambda: sampled(vocab, rows, seqs))

os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "probe.json"), "w"), indent=1)
