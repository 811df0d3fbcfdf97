"""engine.pool: several models by name on the one engine thread (float32, CPU).

Exact tier: each model's greedy tokens, served from the pool next to another model's rows,
equal those of the same model served alone. Scheduling: while two models have rows, the thread
alternates their steps; a load runs a slice between two steps of the serving model. Memory:
the least-recently-used idle model is unloaded for a new one and reloaded on demand; a
keep-alive unloads an idle model. A broken model fails its own requests only; a name that is
not configured is a 404 that reads no file.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from engine.api import (
    MODEL_LOADED,
    MODEL_LOADING,
    MODEL_UNLOADED,
    EngineError,
    Request,
    SamplingParams,
)
from engine.core import AsyncEngine, Engine, EngineConfig
from engine.loader import load_model
from engine.pool import EnginePool, ModelSpec, PoolConfig
from engine.pool_client import AsyncPool
from engine.scheduler import SchedulerConfig
from mlxd import DEFAULT_MODEL_DIR
from tests.model_dirs import bad_config_dir, no_weights_dir, tiny_model_dir

PROMPTS = [[1, 17, 300, 42, 9, 77], [5, 6, 7, 8, 400, 12, 3, 3, 90]]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pool")
    return {
        "a": tiny_model_dir(root / "a", seed=1),
        "b": tiny_model_dir(root / "b", seed=2),
        "c": tiny_model_dir(root / "c", seed=3),
        "noweights": no_weights_dir(root / "noweights"),
        "badconfig": bad_config_dir(root / "badconfig"),
    }


@contextmanager
def serving(specs: list[ModelSpec], **pool_kw: Any) -> Iterator[AsyncPool]:
    engine_kw = pool_kw.pop("engine", {})
    config = PoolConfig(EngineConfig(SchedulerConfig(), **engine_kw), **pool_kw)
    client = AsyncPool(EnginePool(specs, config))
    client.start()
    try:
        yield client
    finally:
        client.stop()


def greedy(req_id: str, prompt: list[int], max_tokens: int, model: str | None,
           **kw: Any) -> Request:
    keep_alive = kw.pop("keep_alive", None)
    return Request(req_id, list(prompt), SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw),
                   model=model, keep_alive=keep_alive)


async def tokens_of(client: Any, request: Request) -> list[int]:
    out: list[int] = []
    async for ev in await client.submit(request):
        assert ev.error is None, ev.error
        out.extend(ev.token_ids)
    return out


def run(coro: Any, timeout: float = 120) -> Any:
    """A regression that loses rows fails here instead of hanging the suite."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


def alone(path: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy tokens with the model served alone, one request at a time."""
    client = AsyncEngine(Engine(load_model(str(path), dtype="float32"),
                                EngineConfig(SchedulerConfig())))
    client.start()
    try:
        async def go() -> list[list[int]]:
            return [await tokens_of(client, greedy(f"alone-{i}", p, max_tokens, None))
                    for i, p in enumerate(prompts)]
        return run(go())
    finally:
        client.stop()


def state_of(client: AsyncPool, name: str) -> str:
    return next(s.state for s in client.list_models() if s.name == name)


def wait_for(predicate: Callable[[], bool], timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def test_two_models_by_name_equal_each_alone(dirs):
    """Rows of the bundled model and of a tiny random model decode side by side on one thread;
    every row's tokens equal its model served alone."""
    want_coder = alone(DEFAULT_MODEL_DIR, PROMPTS, 12)
    want_tiny = alone(dirs["a"], PROMPTS, 12)
    specs = [ModelSpec("coder", str(DEFAULT_MODEL_DIR)), ModelSpec("tiny", str(dirs["a"]))]
    with serving(specs) as client:
        assert [s.state for s in client.list_models()] == [MODEL_LOADED, MODEL_UNLOADED]

        async def go() -> list[list[int]]:
            reqs = [greedy(f"{m}-{i}", p, 12, m) for m in ("coder", "tiny")
                    for i, p in enumerate(PROMPTS)]
            return list(await asyncio.gather(*(tokens_of(client, r) for r in reqs)))

        got = run(go())
        assert got[:2] == want_coder and got[2:] == want_tiny
        assert want_coder != want_tiny
        assert [s.state for s in client.list_models()] == [MODEL_LOADED, MODEL_LOADED]
        # None selects the default model
        assert run(tokens_of(client, greedy("d", PROMPTS[0], 12, None))) == want_coder[0]


def test_steps_alternate_between_models_with_rows(dirs):
    """While both models have rows, no model runs two steps in a row (a scheduler-order check:
    the pool's trace of engine turns, not timings)."""
    specs = [ModelSpec("a", str(dirs["a"])), ModelSpec("b", str(dirs["b"]))]
    with serving(specs) as client:
        run(tokens_of(client, greedy("warm", PROMPTS[0], 1, "b")))  # b loaded
        trace: list[str] = []
        client.pool.on_turn = trace.append

        async def go() -> None:
            await asyncio.gather(*(tokens_of(client, greedy(f"{m}{i}", p, 20, m, ignore_eos=True))
                                   for m in ("a", "b") for i, p in enumerate(PROMPTS)))

        run(go())
        client.pool.on_turn = None
    turns = [t for t in trace if not t.startswith("load:")]
    both = range(max(turns.index("a"), turns.index("b")),
                 min(len(turns) - turns[::-1].index("a"), len(turns) - turns[::-1].index("b")))
    assert len(both) >= 20, turns
    window = [turns[i] for i in both]
    assert all(x != y for x, y in zip(window, window[1:], strict=False)), window


def test_a_load_runs_in_slices_between_the_other_models_steps(dirs, caplog):
    """A model loads while another decodes: at most one load unit between two of the decoding
    model's steps, several slices in all, progress visible while loading; concurrent requests
    for the loading model wait for the one load and then run."""
    specs = [ModelSpec("a", str(dirs["a"])), ModelSpec("b", str(dirs["b"]))]
    caplog.set_level(logging.INFO, logger="mlxd.engine")
    with serving(specs, load_slice_bytes=128 << 10) as client:
        pool = client.pool
        trace: list[str] = []
        progress: list[tuple[str, float | None]] = []

        def on_turn(what: str) -> None:
            trace.append(what)
            if what == "load:b":
                status = next(s for s in pool.statuses() if s.name == "b")
                progress.append((status.state, status.progress))

        pool.on_turn = on_turn

        async def go() -> tuple[list[int], list[list[int]]]:
            await client.model_info("b")  # its tokenizer read: the load starts at submit
            long_a = asyncio.ensure_future(tokens_of(
                client, greedy("long", PROMPTS[0], 400, "a", ignore_eos=True)))
            while "a" not in trace:
                await asyncio.sleep(0.005)
            bs = await asyncio.gather(*(tokens_of(client, greedy(f"b{i}", p, 6, "b"))
                                        for i, p in enumerate(PROMPTS * 2)))
            return await long_a, list(bs)

        got_a, got_b = run(go())
        pool.on_turn = None
    assert len(got_a) == 400 and all(len(t) == 6 for t in got_b)
    assert got_b[0] == got_b[2] and got_b[1] == got_b[3]
    loads = [i for i, t in enumerate(trace) if t == "load:b"]
    assert len(loads) >= 5, trace  # build, room, slices of 128 KiB (a tensor at least), engine
    a_steps = [i for i, t in enumerate(trace) if t == "a"]
    # between two steps of a (while it decodes), at most one load unit
    for x, y in zip(a_steps, a_steps[1:], strict=False):
        assert sum(1 for i in loads if x < i < y) <= 1, trace[x:y + 1]
    assert sum(1 for i in loads if a_steps[0] < i < a_steps[-1]) == len(loads)  # a kept decoding
    fractions = [p for s, p in progress if s == MODEL_LOADING and p is not None]
    assert fractions == sorted(fractions) and 0 < fractions[len(fractions) // 2] < 1, progress
    lines = [r.getMessage() for r in caplog.records if "model b" in r.getMessage()]
    assert len([m for m in lines if m.startswith("loading model b")]) == 1, lines
    loaded = [m for m in lines if m.startswith("loaded model b")]
    assert len(loaded) == 1 and " s (" in loaded[0] and "of weights" in loaded[0], lines


def test_least_recently_used_idle_model_makes_room_and_reloads(dirs, caplog):
    """Under a budget that holds two of three tiny models, loading the third unloads the
    least-recently-used idle one; asking for it again reloads it (and unloads the next LRU),
    with the same tokens as before."""
    weights = load_model(str(dirs["a"]), dtype="float32").model
    from mlx.utils import tree_flatten

    w = sum(int(v.nbytes) for _, v in tree_flatten(weights.parameters()))
    specs = [ModelSpec(m, str(dirs[m])) for m in ("a", "b", "c")]
    caplog.set_level(logging.INFO, logger="mlxd.engine")
    with serving(specs, engine={"memory_budget": 2 * w + (1 << 20)}) as client:
        first_a = run(tokens_of(client, greedy("a1", PROMPTS[0], 8, "a")))
        run(tokens_of(client, greedy("b1", PROMPTS[0], 8, "b")))
        states = {s.name: s.state for s in client.list_models()}
        assert states == {"a": MODEL_LOADED, "b": MODEL_LOADED, "c": MODEL_UNLOADED}
        run(tokens_of(client, greedy("c1", PROMPTS[0], 8, "c")))
        states = {s.name: s.state for s in client.list_models()}
        assert states == {"a": MODEL_UNLOADED, "b": MODEL_LOADED, "c": MODEL_LOADED}
        assert run(tokens_of(client, greedy("a2", PROMPTS[0], 8, "a"))) == first_a
        states = {s.name: s.state for s in client.list_models()}
        assert states == {"a": MODEL_LOADED, "b": MODEL_UNLOADED, "c": MODEL_LOADED}
    unloads = [r.getMessage() for r in caplog.records if r.getMessage().startswith("unloaded")]
    assert unloads == [f"unloaded model a (to make room for c), {w / 2**20:.1f} MiB of weights freed",
                       f"unloaded model b (to make room for a), {w / 2**20:.1f} MiB of weights freed"]


def test_a_busy_model_is_not_unloaded_for_another(dirs, caplog):
    """A load that needs the room of a model with running rows waits until they finish (and
    says so once in the log)."""
    caplog.set_level(logging.INFO, logger="mlxd.engine")
    from mlx.utils import tree_flatten

    w = sum(int(v.nbytes) for _, v in
            tree_flatten(load_model(str(dirs["a"]), dtype="float32").model.parameters()))
    specs = [ModelSpec("a", str(dirs["a"])), ModelSpec("b", str(dirs["b"]))]
    with serving(specs, engine={"memory_budget": w + (1 << 20)}) as client:
        trace: list[str] = []
        client.pool.on_turn = trace.append

        async def go() -> tuple[list[int], list[int]]:
            await client.model_info("b")
            long_a = asyncio.ensure_future(tokens_of(
                client, greedy("long", PROMPTS[0], 300, "a", ignore_eos=True)))
            while "a" not in trace:
                await asyncio.sleep(0.005)
            got_b = await tokens_of(client, greedy("b", PROMPTS[0], 4, "b"))
            return await long_a, got_b

        got_a, got_b = run(go())
        client.pool.on_turn = None
    assert len(got_a) == 300 and len(got_b) == 4
    last_a = len(trace) - 1 - trace[::-1].index("a")
    first_b = trace.index("b")
    assert trace.index("load:b") < last_a  # b's load began (and waited) while a was decoding
    assert last_a < first_b  # b's rows ran only after a's had finished and a was unloaded
    assert state_of(client, "a") == MODEL_UNLOADED
    waits = [r.getMessage() for r in caplog.records if "waits for room" in r.getMessage()]
    assert len(waits) == 1 and waits[0].startswith("model b waits for room"), waits


def test_keep_alive_unloads_an_idle_model(dirs):
    """--keep-alive: a model idle that long is unloaded; a request's keep_alive -1 keeps it,
    0 unloads it as soon as its rows are done."""
    specs = [ModelSpec("a", str(dirs["a"])), ModelSpec("b", str(dirs["b"]))]
    with serving(specs, keep_alive=0.3) as client:
        t0 = time.monotonic()
        run(tokens_of(client, greedy("b1", PROMPTS[0], 4, "b")))
        assert state_of(client, "b") == MODEL_LOADED
        assert wait_for(lambda: state_of(client, "b") == MODEL_UNLOADED, 2.0)
        assert time.monotonic() - t0 >= 0.3
        assert wait_for(lambda: state_of(client, "a") == MODEL_UNLOADED, 2.0)  # the default too

        run(tokens_of(client, greedy("b2", PROMPTS[0], 4, "b", keep_alive=-1.0)))
        time.sleep(0.8)
        status = next(s for s in client.list_models() if s.name == "b")
        assert status.state == MODEL_LOADED and status.keep_alive is None
        assert status.idle_seconds is not None and status.idle_seconds >= 0.7

        run(tokens_of(client, greedy("b3", PROMPTS[0], 4, "b", keep_alive=0.0)))
        assert wait_for(lambda: state_of(client, "b") == MODEL_UNLOADED, 1.0)
        # the unloaded default still answers (it is loaded again)
        assert len(run(tokens_of(client, greedy("a1", PROMPTS[0], 4, None)))) == 4


def test_a_broken_model_fails_its_requests_and_the_others_serve(dirs):
    specs = [ModelSpec("a", str(dirs["a"])), ModelSpec("noweights", str(dirs["noweights"])),
             ModelSpec("badconfig", str(dirs["badconfig"]))]
    with serving(specs) as client:
        for _ in range(2):  # a second request tries again and fails the same way
            with pytest.raises(EngineError) as ei:
                run(tokens_of(client, greedy("x", PROMPTS[0], 4, "noweights")))
            assert ei.value.status == 503 and ei.value.code == "model_load_failed"
            assert "weights" in ei.value.message and str(dirs["noweights"]) not in ei.value.message
        with pytest.raises(EngineError) as ei:
            run(client.model_info("badconfig"))
        assert ei.value.status == 503 and "config.json" in ei.value.message
        assert str(dirs["badconfig"]) not in ei.value.message
        assert len(run(tokens_of(client, greedy("ok", PROMPTS[0], 4, "a")))) == 4
        status = {s.name: s for s in client.list_models()}
        assert status["noweights"].state == MODEL_UNLOADED and "weights" in (status["noweights"].error or "")
        assert status["a"].state == MODEL_LOADED and status["a"].error is None


@contextmanager
def file_access() -> Iterator[list[str]]:
    """Paths the process opens, lists or stats while inside (audit events plus os.stat)."""
    seen: list[str] = []
    active = True

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if active and event in ("open", "os.listdir", "os.scandir") and args:
            seen.append(str(args[0]))

    sys.addaudithook(hook)  # cannot be removed: `active` turns it off
    real_stat = os.stat

    def stat(path: Any, *a: Any, **kw: Any) -> Any:
        seen.append(str(path))
        return real_stat(path, *a, **kw)

    os.stat = stat  # type: ignore[assignment]
    try:
        yield seen
    finally:
        os.stat = real_stat
        active = False


def test_a_name_not_configured_is_a_404_without_file_access(dirs):
    """A client naming a real model directory (or any name the server was not given) gets 404,
    and nothing on disk is looked at for it."""
    specs = [ModelSpec("a", str(dirs["a"]))]
    with serving(specs) as client:
        for name in (str(dirs["b"]), "owner/repo", "gpt-4"):
            with file_access() as seen:
                with pytest.raises(EngineError) as ei:
                    run(tokens_of(client, greedy("x", PROMPTS[0], 4, name)))
                with pytest.raises(EngineError) as ej:
                    run(client.model_info(name))
            assert ei.value.status == ej.value.status == 404 and ei.value.code == "model_not_found"
            assert not [p for p in seen if name in p or str(dirs["b"]) in p], seen
        assert state_of(client, "a") == MODEL_LOADED


def test_shared_budget_admits_rows_next_to_what_the_other_models_hold():
    """Admission leaves out what the other models hold (`MemoryBudget.others`, set by the pool
    before each turn); whether a request can ever run (`fits_alone`) does not depend on it."""
    from engine.core import Engine, EngineConfig
    from engine.scheduler import SchedulerConfig
    from tests.tiny_models import loaded, tiny_model

    lm = loaded(*tiny_model("llama"))
    eng = Engine(lm, EngineConfig(SchedulerConfig(), memory_budget=64 << 20))
    free = eng.scheduler._free()
    alone = eng.budget.fits_alone(200, 50, eng.prefix.chunk)
    eng.budget.others = 5 << 20
    assert eng.scheduler._free() == free - (5 << 20)
    assert eng.budget.fits_alone(200, 50, eng.prefix.chunk) == alone
