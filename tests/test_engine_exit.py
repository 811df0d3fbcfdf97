"""A script that runs an engine, stops it and exits ends with status 0.

MLX keeps `mx.compile`'s cache per thread; the engine thread's holds Python objects (mlx-lm's
compiled activations), freed by the OS thread's destructors after `Thread.join` has returned.
If the interpreter is finalizing by then, the process aborts ("terminate called without an
active exception", status 134): without `EngineThread.stop` waiting for the OS thread, about
half of such runs did.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import threading
import engine  # noqa: F401 (BLAS before MLX)
from engine.api import Request, SamplingParams
from engine.core import Engine, EngineConfig
from engine.loader import load_model
from engine.scheduler import SchedulerConfig

lm = load_model({model!r})
eng = Engine(lm, EngineConfig(SchedulerConfig(), warmup=False))
eng.start()
done = threading.Event()
eng.add(Request("r", lm.tokenizer.encode("def f(x):"), SamplingParams(temperature=0.0, max_tokens=80)),
        lambda events: [done.set() for ev in events if ev.finish_reason])
assert done.wait(120)
eng.stop()
print("stopped")
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="the wait reads /proc (Linux)")
def test_a_script_that_stops_its_engine_exits_cleanly(tinycoder_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    code = SCRIPT.format(model=str(tinycoder_path))
    for _ in range(4):
        proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0 and "stopped" in proc.stdout, (proc.returncode, proc.stderr[-800:])
        assert "terminate called" not in proc.stderr
