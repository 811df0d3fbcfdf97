"""Queue places under disconnects, with the events put in order by hand (the storm in
test_reliability_ci.py only catches these races when the timing happens to line up).

A cut request must stop counting against --max-queue the moment the server calls `abort`, not
when the engine thread gets round to reaping it; aborts of rows that already started must not
make room either. The engine thread is not started here: each test drains and steps by hand.
"""

from __future__ import annotations

import asyncio

import pytest

from engine.api import EngineOverloaded, Request, SamplingParams
from engine.core import OVERLOAD_SETTLE_TURNS, AsyncEngine, Engine, EngineConfig
from engine.scheduler import SchedulerConfig
from server.sse import SSEResponse
from tests.tiny_models import loaded, tiny_model


@pytest.fixture(scope="module")
def lm():
    model, cfg = tiny_model("llama")
    return loaded(model, cfg)


def _engine(lm, max_queue: int) -> Engine:
    return Engine(lm, EngineConfig(SchedulerConfig(max_num_seqs=1, max_queue=max_queue)))


def _req(i: int) -> Request:
    return Request(f"r{i}", [1, 2, 3, 4 + i], SamplingParams(max_tokens=1000, ignore_eos=True))


def _add(eng: Engine, i: int) -> None:
    eng.add(_req(i), lambda events: None)


def _busy(eng: Engine, max_queue: int) -> None:
    """r0 running (the only seat), r1..r{max_queue} waiting in the scheduler: the queue is full."""
    _add(eng, 0)
    eng._drain_inbox()
    eng._step()
    assert len(eng.scheduler.running) == 1
    for i in range(1, max_queue + 1):
        _add(eng, i)
    eng._drain_inbox()
    assert len(eng.scheduler.waiting) == max_queue
    with pytest.raises(EngineOverloaded):
        _add(eng, 99)


def test_abort_frees_the_queue_place_before_the_engine_reaps_it(lm):
    eng = _engine(lm, max_queue=2)
    _busy(eng, 2)
    eng.abort("r1")  # the engine thread has not run since: r1 is still in scheduler.waiting
    _add(eng, 3)
    with pytest.raises(EngineOverloaded):
        _add(eng, 4)


def test_place_stays_free_while_the_engine_thread_reaps_the_abort(lm):
    # the race behind the CI flake: the event loop admits a request while the engine thread is
    # between taking the abort from its inbox and removing the row from the waiting queue
    eng = _engine(lm, max_queue=2)
    _busy(eng, 2)
    eng.abort("r1")
    reap = eng.scheduler.abort
    arrivals: list[str] = []

    def reap_with_an_arrival(req_id: str):
        _add(eng, 3)  # what the event-loop thread does at this moment
        arrivals.append("r3")
        return reap(req_id)

    eng.scheduler.abort = reap_with_an_arrival  # type: ignore[method-assign]
    eng._drain_inbox()
    assert arrivals == ["r3"]
    eng._drain_inbox()
    assert [r.req_id for r in eng.scheduler.waiting] == ["r2", "r3"]
    with pytest.raises(EngineOverloaded):  # and the count is exact afterwards
        _add(eng, 4)


def test_aborts_of_started_rows_make_no_room(lm):
    eng = _engine(lm, max_queue=1)
    _busy(eng, 1)
    eng.abort("r0")  # running, not queued; the server aborts twice (generation + stream close)
    eng.abort("r0")
    with pytest.raises(EngineOverloaded):  # r1 alone fills the queue still
        _add(eng, 2)
    eng._drain_inbox()
    eng._step()  # r1 takes the free seat and leaves the queue
    _add(eng, 2)


def test_abort_of_a_request_still_in_the_inbox(lm):
    eng = _engine(lm, max_queue=1)
    _add(eng, 1)
    with pytest.raises(EngineOverloaded):
        _add(eng, 2)
    eng.abort("r1")
    _add(eng, 2)
    assert [k for k, _ in eng._inbox] == ["add"]


def test_overload_waits_for_a_disconnect_already_on_the_loop(lm):
    # the disconnect was seen by the event loop but its abort runs a turn later (the SSE watcher):
    # the new request must get the place, not a 429
    async def go() -> None:
        eng = _engine(lm, max_queue=1)
        aeng = AsyncEngine(eng)
        await aeng.submit(_req(1))
        loop = asyncio.get_running_loop()
        loop.call_soon(lambda: loop.call_soon(eng.abort, "r1"))  # two turns from now
        await aeng.submit(_req(2))
        with pytest.raises(EngineOverloaded):  # nothing leaving: refused after the turns
            await aeng.submit(_req(3))
        assert list(eng._queued) == ["r2"]

    assert OVERLOAD_SETTLE_TURNS >= 2
    asyncio.run(go())


def test_sse_aborts_as_soon_as_the_disconnect_is_seen():
    # the abort (on_close) runs in the watcher's own turn, before the stream is even cancelled
    async def go() -> list[str]:
        order: list[str] = []
        gone = asyncio.Event()

        async def receive():
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            pass

        async def source():
            try:
                yield b"data: 1\n\n"
                await asyncio.Event().wait()  # a queued request: no token yet
            finally:
                order.append("stream closed")

        response = SSEResponse(source(), on_close=lambda: order.append("abort"))
        task = asyncio.create_task(response({"type": "http"}, receive, send))
        for _ in range(5):
            await asyncio.sleep(0)
        gone.set()
        await asyncio.wait_for(task, 5)
        return order

    assert asyncio.run(go()) == ["abort", "stream closed"]


def test_a_failed_step_ends_the_rows_it_took_and_frees_their_places(lm, monkeypatch):
    """A step that fails after taking rows off the waiting queue but before their prefill group
    exists (here: the KV caches cannot be made) must still end those requests with an error and
    give their queue places back; before, they hung and held their places for good."""
    from engine.api import FINISH_ERROR

    eng = _engine(lm, max_queue=2)
    got: dict[str, list] = {}
    for i in (1, 2):
        eng.add(_req(i), lambda evs, i=i: got.setdefault(f"r{i}", []).extend(evs))
    eng._drain_inbox()
    sched = eng.scheduler
    owner, name = (sched.prefix, "group_caches") if sched.prefix is not None else (sched, "_make_caches")
    make = getattr(owner, name)

    def no_room(*args):
        raise MemoryError("no room for the caches")

    monkeypatch.setattr(owner, name, no_room)
    with pytest.raises(MemoryError):
        eng._step()
    # r1 (the one seat) was taken off the queue, then lost with the failed step; r2 still waits
    assert [r.req_id for r in sched.waiting] == ["r2"] and sched.prefill is None
    eng._fail_all("MemoryError: no room for the caches")  # what the engine loop does next
    assert set(got) == {"r1", "r2"}
    assert all(evs[-1].finish_reason == FINISH_ERROR and evs[-1].error for evs in got.values())
    assert eng.stats().num_queued == 0 and not eng._sinks
    monkeypatch.setattr(owner, name, make)
    _add(eng, 3)
    _add(eng, 4)  # both places are free again
    with pytest.raises(EngineOverloaded):
        _add(eng, 5)
