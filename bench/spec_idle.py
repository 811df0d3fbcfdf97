"""What an engine with a drafter costs while it decodes plainly (a script, not a test).

    python -m bench.spec_idle [--rows 1] [--tokens 400] [--rounds 3] [--out FILE]

Runs the same greedy requests through engines side by side, in alternating order:
  * `plain`        — no speculation;
  * `plain-slack`  — no speculation, but the target's KV built with the ring slack a spec
                     engine gets (`KVConfig.max_draft = 4`): the layouts alone;
  * `ngram-idle`, `draft-idle` — the adaptive drafters with a controller that has measured that
                     speculation does not pay (its cost cells pre-filled: a wide step costs 10x
                     a plain one), so every step is plain and only the idle path is exercised;
  * `ngram`, `draft` — the adaptive drafters as shipped (exploration included).

Per mode, per step: the engine thread's CPU time (`time.thread_time`: host work — graph
building, Python bookkeeping; on MLX's CPU backend the kernels run on the stream's own thread,
so waiting for them is not counted) and the wall time; plus the draft model's forward calls.
On a compute-bound CPU the wall time hides host work, the thread time does not: on a GPU,
where a 16M model's plain step is ~1.8 ms of mostly host work, the host time is the step.
"""

from __future__ import annotations

import engine  # noqa: F401  (BLAS before mlx)

# isort: split

import argparse
import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from engine.api import Request, SamplingParams
from engine.core import Engine, EngineConfig
from engine.loader import load_model
from engine.scheduler import SchedulerConfig
from engine.spec import SpecConfig
from mlxd import DEFAULT_MODEL_DIR

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"


def _idle(eng: Engine) -> None:
    """Teach the controller that speculation never pays here (every step then decodes plainly)."""
    costs = eng.spec.controller.costs
    for bucket in (1, 2, 4, 8, 16, 32):
        for _ in range(costs.min_samples):
            costs.observe(bucket, 1, 1e-3, 0)
            for w in range(2, 10):
                costs.observe(bucket, w, 1e3 * w, 0)  # never displaced: no wide step runs
        eng.spec.controller._chosen_spec[bucket] = False
        eng.spec.controller._next_probe[bucket] = 1 << 40


class _CountingModel:
    """Wraps the draft model to count its forwards."""

    def __init__(self, model: Any) -> None:
        self.model, self.calls = model, 0

    def __call__(self, *a: Any, **k: Any) -> Any:
        self.calls += 1
        return self.model(*a, **k)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def run(
    lm: Any, draft: Any, mode: str, prompts: list[list[int]], tokens: int,
    concurrency: int = 0, ignore_eos: bool = True,
) -> dict[str, Any]:
    concurrency = concurrency or len(prompts)
    spec = None
    kv_slack = 0
    if mode == "plain-slack":
        kv_slack = 4
    elif mode != "plain":
        method = mode.split("-")[0]
        spec = SpecConfig(method=method, draft_model=draft if method == "draft" else None)
    cfg = EngineConfig(SchedulerConfig(max_num_seqs=concurrency), prefix_cache_bytes=0, spec=spec)
    if kv_slack:  # KVConfig.max_draft is gone (4b122c3): the target's rings have no slack now
        raise SystemExit("plain-slack: the engine no longer builds rings with slack")
    eng = Engine(lm, cfg)
    counter = None
    if eng.spec is not None and hasattr(eng.spec.drafter, "model"):
        counter = _CountingModel(eng.spec.drafter.model)
        eng.spec.drafter.model = counter
    if mode.endswith("-idle"):
        _idle(eng)
    cpu: list[float] = []
    wall: list[float] = []
    widths: list[int] = []
    orig = eng._step

    def step() -> None:
        c0, w0 = time.thread_time(), time.perf_counter()
        orig()
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - w0)
        widths.append(eng.spec.controller._last_width if eng.spec is not None else 1)

    eng._step = step  # type: ignore[method-assign]
    lock = threading.Condition()
    state = {"next": 0, "done": 0, "tokens": 0}

    def submit_next() -> None:  # closed loop: `concurrency` requests in flight
        i = state["next"]
        if i >= len(prompts):
            return
        state["next"] += 1
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=ignore_eos)
        eng.add(Request(f"r{i}", list(prompts[i]), params), sink)

    def sink(events) -> None:  # noqa: ANN001  (engine thread)
        with lock:
            for ev in events:
                state["tokens"] += len(ev.token_ids)
                if ev.finish_reason is not None:
                    state["done"] += 1
                    submit_next()
            lock.notify_all()

    eng.start()
    t0 = time.perf_counter()
    try:
        with lock:
            for _ in range(min(concurrency, len(prompts))):
                submit_next()
            while state["done"] < len(prompts):
                lock.wait(1.0)
        total = time.perf_counter() - t0
        stats = eng.stats()
    finally:
        eng.stop()
    plain = [i for i, w in enumerate(widths) if w <= 1][2:]  # skip prefill-ish first steps
    out = {
        "mode": mode,
        "steps": len(cpu),
        "plain_steps": len(plain),
        "wall_s": round(total, 3),
        "tokens": state["tokens"],
        "tokens_per_s": round(state["tokens"] / total, 2),
        "host_ms_per_plain_step": round(statistics.median(cpu[i] for i in plain) * 1e3, 4),
        "host_ms_mean_plain_step": round(statistics.mean(cpu[i] for i in plain) * 1e3, 4),
        "wall_ms_per_plain_step": round(statistics.median(wall[i] for i in plain) * 1e3, 4),
        "host_s_total": round(sum(cpu), 3),
    }
    spec_ms = [(widths[i], round(wall[i] * 1e3, 2)) for i, w in enumerate(widths) if w > 1]
    if spec_ms:  # (width, ms) of each speculative step, and the step after it
        out["spec_step_ms"] = spec_ms[:24]
        out["after_spec_ms"] = [round(wall[i + 1] * 1e3, 2) for i, w in enumerate(widths[:-1])
                                if w > 1 and widths[i + 1] <= 1][:12]
    if counter is not None:
        out["draft_calls"] = counter.calls
    if stats.spec:
        ((_, st),) = stats.spec.items()
        out["spec_steps"] = st["spec_steps"]
        out["warmup_s"] = st.get("warmup_s")  # the engine's speculative warm-up (GPU)
    return out


def skeleton(path: str) -> Any:
    """The model's architecture (layers, layer types, window, vocabulary) with tiny widths:
    compute is negligible, so a step's wall time is the host work a GPU would see."""
    import importlib

    import mlx.core as mx

    from engine.loader import LoadedModel

    cfg = json.loads((Path(path) / "config.json").read_text())
    cfg.update(hidden_size=32, intermediate_size=64, num_attention_heads=2,
               num_key_value_heads=1, head_dim=16)
    module = importlib.import_module(f"mlx_lm.models.{cfg['model_type']}")
    mx.random.seed(0)
    model = module.Model(module.ModelArgs.from_dict(cfg))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    real = load_model(path)
    return LoadedModel(model=model, tokenizer=real.tokenizer, config=cfg, path=Path(path),
                       model_id=cfg["model_type"], eos_token_ids=(), context_length=4096,
                       chat_template=None, dtype="float32", vocab_size=cfg["vocab_size"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    p.add_argument("--draft-model", default=str(SHARED / "models" / "tinycoder-draft-4m"))
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--tokens", type=int, default=400)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--modes", default="plain,ngram-idle,draft-idle")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--dev", type=int, default=0,
                   help="this many of bench.spec's dev prompts instead of one short prompt a row")
    p.add_argument("--data", default=str(SHARED / "data" / "tinycoder-dev.jsonl"))
    p.add_argument("--out", default="")
    p.add_argument("--skeleton", action="store_true",
                   help="same architectures with tiny widths: step time = host time")
    a = p.parse_args(argv)
    if a.skeleton:
        lm, draft = skeleton(a.model), skeleton(a.draft_model)
    else:
        lm, draft = load_model(a.model, dtype=a.dtype), load_model(a.draft_model, dtype=a.dtype)
    concurrency, ignore_eos = a.rows, True
    if a.dev:  # bench.spec's dev prompts, closed loop at `--rows` streams, EOS honoured
        from bench.spec import _rows, dev_prompts

        rows = _rows(Path(a.data))
        prompts = dev_prompts(rows, lm.tokenizer, a.dev)
        ignore_eos = False
    else:
        prompts = [lm.tokenizer.encode(f"def f{i}(x):") for i in range(a.rows)]
    modes = [m for m in a.modes.split(",") if m]
    for mode in modes:  # warm-up (MLX-CUDA JIT, cuDNN graphs)
        run(lm, draft, mode, prompts[: max(concurrency, 2)], 64, concurrency, ignore_eos)
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for r in range(a.rounds):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            res = run(lm, draft, mode, prompts, a.tokens, concurrency, ignore_eos)
            results[mode].append(res)
            print(json.dumps(res), flush=True)
    base = statistics.median(x["host_ms_per_plain_step"] for x in results[modes[0]])
    summary = {}
    for mode, rs in results.items():
        host = statistics.median(x["host_ms_per_plain_step"] for x in rs)
        summary[mode] = {"host_ms_per_plain_step": round(host, 4),
                         "host_vs_first": round(host / base, 3),
                         "wall_ms_per_plain_step": round(
                             statistics.median(x["wall_ms_per_plain_step"] for x in rs), 4),
                         "draft_calls": [x.get("draft_calls") for x in rs],
                         "tps_ratio_vs_first": round(statistics.median(
                             x["tokens_per_s"] / y["tokens_per_s"]
                             for x, y in zip(rs, results[modes[0]], strict=True)), 3)}
        print(f"{mode:12s} host {host:.3f} ms/step ({host / base:.3f}x)  "
              f"wall {summary[mode]['wall_ms_per_plain_step']:.3f} ms  "
              f"tok/s ratio {summary[mode]['tps_ratio_vs_first']}  "
              f"draft calls {summary[mode]['draft_calls']}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"args": vars(a), "summary": summary,
                                           "runs": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
