"""A decode step writes its KV columns in place only when nothing in flight still holds the
buffer: once a batch's KV is large, the runner waits for what was launched before
(`engine.runner._settle`) after it has built a step's graph and before it evaluates it."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from engine import runner as runner_mod
from engine.kv.attention import PlainLayout
from tests.tiny_models import greedy, loaded, make_engine, submit, tiny_model

ROWS, HEADS, DIM = 4, 8, 128


def _filled_layout() -> PlainLayout:
    """Rows of different lengths (so a decode step scatters its columns), ~3k columns each."""
    lay = PlainLayout(ROWS)
    lengths = [3000, 2990, 2980, 2970]
    lay.prepare(lengths=lengths)
    kv = mx.random.normal((ROWS, HEADS, max(lengths), DIM))
    lay.update_and_fetch(kv, kv)
    lay.finalize()
    mx.eval(lay._bufs)
    return lay


def _pipelined_decode_peak(settle: bool, monkeypatch) -> tuple[int, int]:
    """Peak bytes above the start while step t + 1 is dispatched with step t (a heavy read of
    the buffers) still running, and one K buffer's bytes. The layout (~100 MB) counts as large
    (`SETTLE_BYTES`) when `settle`, as small otherwise."""
    lay = _filled_layout()
    threshold = lay.nbytes if settle else lay.nbytes + 1
    monkeypatch.setattr(runner_mod, "SETTLE_BYTES", threshold)
    q = mx.random.normal((ROWS, HEADS, 64, DIM))
    mx.eval(q)
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    previous = None
    for _ in range(3):
        new = mx.random.normal((ROWS, HEADS, 1, DIM))
        keys, values = lay.update_and_fetch(new, new)
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.1).sum()
        runner_mod._settle([lay])
        mx.async_eval(out, *lay._bufs)
        if previous is not None:
            previous.item()
        previous = out
    previous.item()
    return mx.get_peak_memory() - base, lay._bufs[0].nbytes


def test_a_step_settled_before_dispatch_writes_its_kv_in_place(monkeypatch):
    grown, buffer = _pipelined_decode_peak(True, monkeypatch)
    assert grown < buffer, (grown, buffer)  # the attention's own scores, no copy


def test_a_step_dispatched_while_the_previous_reads_the_buffer_copies_it(monkeypatch):
    """Why the runner settles large batches: MLX copies a buffer that an in-flight step still
    holds (and below the threshold the runner lets it)."""
    grown, buffer = _pipelined_decode_peak(False, monkeypatch)
    assert grown >= buffer, (grown, buffer)


def _recorder(events: list[str], name: str, fn):
    def recorded(*args, **kwargs):
        events.append(name)
        return fn(*args, **kwargs)

    return recorded


def _drive(eng, cfg, prefix: str, rows: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    outs = [submit(eng, greedy(f"{prefix}{i}", rng.integers(3, cfg["vocab_size"], 20).tolist(), 12))
            for i in range(rows)]
    try:
        for o in outs:
            assert o.done.wait(120)
    finally:
        eng.stop()


def test_every_decode_step_is_settled_between_its_graph_and_its_dispatch(monkeypatch):
    events: list[str] = []
    monkeypatch.setattr(runner_mod, "_settle", _recorder(events, "settle", runner_mod._settle))
    monkeypatch.setattr(runner_mod.mx, "async_eval", _recorder(events, "dispatch", mx.async_eval))
    model, cfg = tiny_model("llama")
    eng = make_engine(loaded(model, cfg))
    eng.runner._forward = _recorder(events, "forward", eng.runner._forward)  # type: ignore[method-assign]
    eng.runner._launch = _recorder(events, "launch", eng.runner._launch)  # type: ignore[method-assign]
    _drive(eng, cfg, "r", 3, seed=0)
    launches = [i for i, e in enumerate(events) if e == "launch"]
    assert len(launches) >= 11
    for i in launches:  # the step's forward, then the wait, then its dispatch
        assert events[i + 1 : i + 4] == ["forward", "settle", "dispatch"], events[i : i + 6]


def test_every_verify_forward_is_settled_before_its_evaluation(monkeypatch):
    """The verify step's forward writes its columns into the same buffers: it waits too."""
    from engine.core import Engine, EngineConfig
    from engine.scheduler import SchedulerConfig
    from engine.spec import SpecConfig

    events: list[str] = []
    monkeypatch.setattr(runner_mod, "_settle", _recorder(events, "settle", runner_mod._settle))
    monkeypatch.setattr(runner_mod.mx, "eval", _recorder(events, "eval", mx.eval))
    model, cfg = tiny_model("llama")
    draft, _ = tiny_model("llama", seed=1)
    spec = SpecConfig("draft", draft_model=draft, num_draft_tokens=3, adaptive=False, warmup=False)
    eng = Engine(loaded(model, cfg), EngineConfig(SchedulerConfig(), spec=spec))
    eng.start()
    eng.runner._forward = _recorder(events, "forward", eng.runner._forward)  # type: ignore[method-assign]
    eng.runner.verify = _recorder(events, "verify", eng.runner.verify)  # type: ignore[method-assign]
    _drive(eng, cfg, "v", 2, seed=1)
    rounds = [i for i, e in enumerate(events) if e == "verify"]
    assert len(rounds) >= 3
    for i in rounds:  # the target's forward (the draft's steps come before it), the wait, the eval
        j = events.index("forward", i)
        assert events[j + 1 : j + 3] == ["settle", "eval"], events[i : j + 4]
