"""Warm start with the bundled model: the engine runs the first requests' shapes before it serves
(engine.runner, `Runner.warm_up`), and the first requests' prefill chunks and decode batches
were all among them (the GPU warm-up, forced on the CPU); the CPU's own warm-up runs one short
prompt and times one chunk, and sets the prefill budget from it."""

from __future__ import annotations

import random

from engine.core import WARM_DECODE_ROWS, Engine, EngineConfig
from engine.scheduler import SchedulerConfig
from tests.tiny_models import greedy, submit


def _engine(tinycoder_path, monkeypatch=None) -> Engine:
    from engine.loader import load_model

    if monkeypatch is not None:  # the GPU's warm-up: every shape the first requests use
        monkeypatch.setattr("engine.core.shapes_build_on_first_use", lambda: True)

    lm = load_model(str(tinycoder_path), dtype="float32")
    lm.eos_token_ids = ()
    return Engine(lm, EngineConfig(SchedulerConfig(max_num_seqs=8), warmup=True))


def test_first_requests_run_only_warmed_shapes(tinycoder_path, monkeypatch):
    eng = _engine(tinycoder_path, monkeypatch)
    runner, chunk = eng.runner, eng.prefix.chunk
    warmed = dict(runner.shapes)
    rows = min(8, WARM_DECODE_ROWS)
    assert set(warmed) == set(runner.warm_up_shapes(chunk, rows))
    assert eng.warm_up.prefill_tokens_per_s > 0
    assert eng.scheduler.prefill_budget >= chunk  # the auto budget, sized from that rate
    # covered: prompts whose prefill is whole chunks (one long prompt at a time), decode at the
    # batch sizes 1..4 they reach together
    rng = random.Random(0)
    lens = [chunk, 2 * chunk, 3 * chunk, 2 * chunk]  # one chunk: it could group
    reqs = [greedy(f"r{i}", [rng.randrange(3, 4000) for _ in range(n)], 40)
            for i, n in enumerate(lens)]
    outs = [submit(eng, r) for r in reqs]  # all queued before the first step
    eng.start()
    try:
        for out in outs:
            assert out.done.wait(300)
            assert len(out.tokens) == 40
        used = {s for s, n in runner.shapes.items() if n > warmed.get(s, 0)}
        assert ("prefill", 1, chunk) in used
        assert {("decode", k, 1) for k in range(1, 5)} <= used
        assert used <= set(warmed), used - set(warmed)
        # not covered (no padding): a prompt whose prefill is not whole chunks runs its own width
        odd = submit(eng, greedy("odd", [rng.randrange(3, 4000) for _ in range(100)], 2))
        assert odd.done.wait(300)
        assert ("prefill", 1, 100) in set(runner.shapes) - set(warmed)
    finally:
        eng.stop()


def test_warm_up_leaves_nothing_behind(tinycoder_path):
    eng = _engine(tinycoder_path)
    try:
        stats = eng.stats()
        assert stats.num_running == 0 and stats.kv_bytes == 0
        assert not eng.runner.in_flight
        assert stats.prefix_cache is not None and stats.prefix_cache.blocks == 0
    finally:
        eng.stop()


def test_cpu_warm_up_runs_a_short_prompt_and_times_one_chunk(tinycoder_path):
    eng = _engine(tinycoder_path)
    runner, chunk = eng.runner, eng.prefix.chunk
    try:
        assert set(runner.shapes) == set(runner.warm_up_shapes(chunk, 8, per_shape=False))
        assert ("prefill", 1, chunk) in runner.shapes and ("decode", 1, 1) in runner.shapes
        assert eng.warm_up.prefill_tokens_per_s > 0
        assert eng.scheduler.prefill_budget >= chunk  # the auto budget, sized from that rate
        assert not runner.in_flight and eng.stats().kv_bytes == 0
        eng.start()
        out = submit(eng, greedy("r", list(range(3, 3 + 2 * chunk + 5)), 8))
        assert out.done.wait(300) and len(out.tokens) == 8
    finally:
        eng.stop()


def test_the_server_warms_up_on_the_thread_that_serves(monkeypatch):
    """MLX keeps per-thread state (CUDA: cuDNN attention graphs, compiled functions, command
    encoders, default streams): `mlxd serve`'s engine, single or pooled, is built and warmed up
    on the thread whose loop then runs the requests, never on the caller's."""
    import asyncio
    import threading

    from engine.api import Request, SamplingParams
    from engine.runner import Runner
    from mlxd.runtime import build_client

    seen: dict[str, set[int]] = {}

    def recorded(name, fn):
        def wrapped(self, *args, **kwargs):
            seen.setdefault(name, set()).add(threading.get_ident())
            return fn(self, *args, **kwargs)
        return wrapped

    monkeypatch.setattr(Runner, "warm_up", recorded("warm_up", Runner.warm_up))
    monkeypatch.setattr(Runner, "run", recorded("run", Runner.run))

    async def tokens(client) -> list[int]:
        req = Request("r", [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=3))
        return [t async for ev in await client.submit(req) for t in ev.token_ids]

    for opts in ({"model": None}, {"models": [("coder", "")]}):
        seen.clear()
        client = build_client(dtype="float32", **opts)
        client.start()
        try:
            assert len(asyncio.run(tokens(client))) == 3
        finally:
            client.stop()
        assert len(seen["warm_up"]) == 1, opts
        assert seen["run"] == seen["warm_up"], opts  # the warm-up's steps and the request's
        assert threading.get_ident() not in seen["run"], opts


def test_spawn_raises_the_build_error_on_the_callers_thread():
    """`EngineThread.spawn`: what the build raised comes back to the caller, and nothing is
    left running; a built object runs its loop on the thread that built it until stopped."""
    import threading

    import pytest

    from engine.core import EngineThread

    class Broken(EngineThread):
        def __init__(self) -> None:
            raise ValueError("no such model")

    before = set(threading.enumerate())
    with pytest.raises(ValueError, match="no such model"):
        Broken.spawn()
    for t in set(threading.enumerate()) - before:  # the build's thread ends with it
        t.join(5)
        assert not t.is_alive()

    class Looping(EngineThread):
        def __init__(self) -> None:
            self.built_on = threading.get_ident()
            self._wake = threading.Condition()
            self._stopping = False
            self._thread = None

        def _loop(self) -> None:
            self.looped_on = threading.get_ident()
            with self._wake:
                while not self._stopping:
                    self._wake.wait()

    obj = Looping.spawn()
    thread = obj._thread
    try:
        assert thread is not None and thread.ident == obj.built_on != threading.get_ident()
        obj.start()  # a no-op: the loop already runs
        assert obj._thread is thread
    finally:
        obj.stop()
    assert obj.looped_on == obj.built_on and not thread.is_alive()
