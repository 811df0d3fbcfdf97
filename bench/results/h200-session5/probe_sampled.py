"""GPU probe (session 5): which op of the sampled draft chain makes MLX-CUDA raise
`cudaGraphAddKernelNode ... invalid argument` (tests/test_spec_engine.py::
test_sampled_distribution_end_to_end_matches_the_model on the H200, session 4).

    python probe_sampled.py child VOCAB REQUESTS MAX_SEQS [instrument]
    python probe_sampled.py            # parent: every config in a child, with/without graphs

With `instrument`, every stage of the draft chain is evaluated on its own and the first stage
that raises is printed with the shapes it was handed."""
import json, os, subprocess, sys, time, traceback

STAGES = []


def child(vocab, n, seqs, instrument):
    import mlx.core as mx
    import numpy as np
    from engine.api import Request, SamplingParams
    from engine.core import Engine, EngineConfig
    from engine.scheduler import SchedulerConfig
    from engine.spec import SpecConfig
    import engine.spec.draft_model as dm
    import engine.sampling as smp
    from tests.test_spec_engine import _perturbed
    from tests.tiny_models import loaded, submit, tiny_model

    failed = {}

    def guard(stage, arrays, info):
        if not instrument or failed:
            return
        try:
            mx.eval(*[a for a in arrays if isinstance(a, mx.array)])
        except Exception as e:  # noqa: BLE001
            failed.update(stage=stage, error=str(e)[:300], info=info)
            print("FAILED STAGE", json.dumps(failed), flush=True)
            raise

    def shapes(xs):
        return [(tuple(x.shape), str(x.dtype)) for x in xs if isinstance(x, mx.array)]

    if instrument:
        o_process, o_draw, o_first = dm.process_logits, dm.draw_stream, dm.DraftModelDrafter._first_logits
        o_catch, o_record = dm.DraftModelDrafter._catch_up, smp.SamplerState.record

        def process_logits(logits, state):
            guard("draft_logits", [logits], shapes([logits]))
            fields = [getattr(state, f) for f in state.__slots__ if isinstance(getattr(state, f, None), mx.array)]
            guard("sampler_state", fields, shapes(fields))
            out = o_process(logits, state)
            guard("process_logits", [out], shapes([logits, out]))
            return out

        def draw_stream(processed, state, stream):
            out = o_draw(processed, state, stream)
            guard("draw_stream", [out], shapes([processed, out, state.seeds, state.steps]))
            return out

        def first_logits(self, layouts, pending, lengths, nxt):
            out = o_first(self, layouts, pending, lengths, nxt)
            guard("first_logits", [out], {"lengths": lengths.tolist()[:16], "B": len(lengths), "out": shapes([out])})
            return out

        def catch_up(self, state, token_lists):
            o_catch(self, state, token_lists)
            arrs = [a for l in state.layouts for a in (getattr(l, "state", None) or []) if isinstance(a, mx.array)]
            guard("catch_up", arrs, {"B": len(token_lists), "lens": [len(t) for t in token_lists][:32]})

        def record(self, tokens):
            out = o_record(self, tokens)
            guard("record", [out.steps, out.counts, out.seen], shapes([tokens]))
            return out

        dm.process_logits, dm.draw_stream = process_logits, draw_stream
        dm.DraftModelDrafter._first_logits, dm.DraftModelDrafter._catch_up = first_logits, catch_up
        smp.SamplerState.record = record

    m, cfg = tiny_model("llama", vocab_size=vocab)
    draft = _perturbed(m, cfg, 0.5, seed=5)
    eng = Engine(loaded(m, cfg), EngineConfig(SchedulerConfig(max_num_seqs=seqs, max_queue=4096),
                 spec=SpecConfig("draft", draft_model=draft, num_draft_tokens=2, adaptive=False)))
    eng.start()
    t0 = time.time()
    try:
        prompt = [1, 5, 2, 7, 3, 1, 5]
        outs = [submit(eng, Request(f"r{i}", list(prompt), SamplingParams(temperature=1.0, seed=i, max_tokens=2))) for i in range(n)]
        for o in outs:
            o.done.wait(300)
        fin = [o.finish for o in outs]
        errs = [ev.error for o in outs for ev in o.events if ev.error]
        res = {"finish": {str(f): fin.count(f) for f in set(fin)}, "errors": len(errs),
               "first_error": errs[0][:200] if errs else None, "failed_stage": failed or None,
               "s": round(time.time() - t0, 1)}
    finally:
        eng.stop()
    print("RESULT", json.dumps(res), flush=True)


def parent():
    out = []
    configs = [(8, 3000, 256), (8, 600, 256), (8, 256, 256), (512, 3000, 256), (8, 3000, 64), (8, 3000, 128)]
    for vocab, n, seqs in configs:
        for env_extra, instr in (({}, True), ({"MLX_USE_CUDA_GRAPHS": "0"}, False), ({}, False)):
            env = dict(os.environ, **env_extra)
            cmd = [sys.executable, __file__, "child", str(vocab), str(n), str(seqs)] + (["instrument"] if instr else [])
            t0 = time.time()
            try:
                p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
                lines = (p.stdout + p.stderr).splitlines()
            except subprocess.TimeoutExpired as e:
                lines = ["TIMEOUT"]
            res = [l for l in lines if l.startswith(("RESULT", "FAILED STAGE", "TIMEOUT"))]
            tail = [l for l in lines if "Error" in l][-3:]
            row = {"vocab": vocab, "n": n, "seqs": seqs, "env": env_extra, "instrument": instr,
                   "s": round(time.time() - t0, 1), "out": res, "err_tail": tail}
            print(json.dumps(row), flush=True)
            out.append(row)
            if time.time() - T0 > float(os.environ.get("PROBE_BUDGET", 240)):
                break
        if time.time() - T0 > float(os.environ.get("PROBE_BUDGET", 240)):
            print("budget spent", flush=True)
            break
    path = os.path.join(os.environ.get("OUT", "/tmp"), "probe_sampled.json")
    json.dump(out, open(path, "w"), indent=1)


T0 = time.time()
if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        child(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), len(sys.argv) > 5)
    else:
        parent()
