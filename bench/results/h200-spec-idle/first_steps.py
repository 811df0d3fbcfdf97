"""Diagnostic (H200, 2026-11-30): wall ms of the first steps of fresh engines in one process,
plain and with forced speculation; first-steps.log is its output.

    PYTHONPATH=/tmp/site:. python3 bench/results/h200-spec-idle/first_steps.py DRAFT_DIR
"""

from __future__ import annotations

import engine  # noqa: F401  (BLAS before mlx)

# isort: split

import json
import sys
import threading
import time

from engine.api import Request, SamplingParams
from engine.core import Engine, EngineConfig
from engine.loader import load_model
from engine.scheduler import SchedulerConfig
from engine.spec import SpecConfig
from mlxd import DEFAULT_MODEL_DIR

lm = load_model(str(DEFAULT_MODEL_DIR), dtype="bfloat16")
draft = load_model(sys.argv[1], dtype="bfloat16")
prompt = lm.tokenizer.encode("def fib(n):")


def run(tag: str, spec: SpecConfig | None, no_release: bool = False, tokens: int = 40) -> None:
    cfg = EngineConfig(SchedulerConfig(max_num_seqs=1), prefix_cache_bytes=0, spec=spec)
    if no_release:  # the engine's memory release (mx.clear_cache, cache limit) off
        Engine._apply_cache_limit = lambda self, limit: 0  # type: ignore[method-assign]
    eng = Engine(lm, cfg)
    if no_release:
        eng._release_memory = lambda: None  # type: ignore[method-assign]
    times: list[float] = []
    orig = eng._step

    def step() -> None:
        t0 = time.perf_counter()
        orig()
        times.append(round((time.perf_counter() - t0) * 1e3, 2))

    eng._step = step  # type: ignore[method-assign]
    done = threading.Event()
    eng.start()
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    eng.add(Request(tag, list(prompt), params),
            lambda evs: done.set() if any(e.finish_reason for e in evs) else None)
    done.wait(600)
    eng.stop()
    out = {"tag": tag, "first": times[:14], "median": sorted(times)[len(times) // 2]}
    print(json.dumps(out), flush=True)


for _ in range(2):
    run("plain", None)
    run("draft-k1", SpecConfig(method="draft", draft_model=draft, num_draft_tokens=1, adaptive=False))
    run("ngram-k2", SpecConfig(method="ngram", num_draft_tokens=2, adaptive=False))
    run("draft-k1-again",
        SpecConfig(method="draft", draft_model=draft, num_draft_tokens=1, adaptive=False))
for _ in range(2):
    run("draft-k1-norelease",
        SpecConfig(method="draft", draft_model=draft, num_draft_tokens=1, adaptive=False), True)
    run("plain-norelease", None, True)
