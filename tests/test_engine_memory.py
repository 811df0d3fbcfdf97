"""The engine bounds and gives back the memory it does not use, and keeps no per-request state
once requests are over (the soak's leak checks, made cheap: docs/reliability.md)."""

from __future__ import annotations

import time

import httpx
import mlx.core as mx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.api import Request, SamplingParams
from engine.core import Engine, EngineConfig
from engine.host_memory import background_trims, memory_readings, release_idle_memory
from engine.scheduler import SchedulerConfig
from tests.tiny_models import greedy, greedy_deviations, loaded, submit, tiny_model


@pytest.fixture(scope="module")
def lm():
    model, cfg = tiny_model("llama")
    return loaded(model, cfg)


@pytest.fixture()
def restore_cache_limit():
    before = mx.set_cache_limit(0)
    mx.set_cache_limit(before)
    yield
    mx.set_cache_limit(before)


def _engine(lm, **cfg) -> Engine:
    sched = {k: cfg.pop(k) for k in list(cfg) if k in ("max_num_seqs", "max_queue")}
    eng = Engine(lm, EngineConfig(SchedulerConfig(**sched), prefix_block_size=4, **cfg))
    eng.start()
    return eng


def _wait(pred, timeout: float = 10.0) -> bool:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


def test_cache_limit_is_applied_and_reported(lm, restore_cache_limit):
    eng = Engine(lm, EngineConfig(SchedulerConfig(), mlx_cache_limit=5 << 20))
    assert mx.set_cache_limit(5 << 20) == 5 << 20  # what the engine set is in force
    assert eng.stats().memory.mlx_cache_limit == 5 << 20
    # default: MLX's own limit, but at most a tenth of the memory budget
    mx.set_cache_limit(1 << 40)
    eng = Engine(lm, EngineConfig(SchedulerConfig(), memory_budget=300 << 20))
    assert eng.mlx_cache_limit == 30 << 20
    assert mx.set_cache_limit(30 << 20) == 30 << 20


def test_prefix_cache_size_follows_the_memory_budget(lm):
    """By default the prefix cache may hold a quarter of the memory budget; a size given is
    kept; 0 turns it off. What it reports is what it may hold."""
    auto = Engine(lm, EngineConfig(SchedulerConfig(), memory_budget=400 << 20))
    assert auto.prefix.cache.max_bytes == 100 << 20
    assert auto.stats().prefix_cache.max_bytes == 100 << 20
    given = Engine(lm, EngineConfig(SchedulerConfig(), memory_budget=400 << 20,
                                    prefix_cache_bytes=8 << 20))
    assert given.prefix.cache.max_bytes == 8 << 20
    off = Engine(lm, EngineConfig(SchedulerConfig(), prefix_cache_bytes=0))
    assert off.stats().prefix_cache is None


def test_idle_engine_empties_the_buffer_cache(lm, restore_cache_limit):
    eng = _engine(lm, idle_release_s=0.2)
    try:
        out = submit(eng, greedy("a", list(range(1, 40)), 12))
        assert out.done.wait(60)
        assert _wait(lambda: eng.stats().memory.num_releases >= 1)
        mem = eng.stats().memory
        assert mem.mlx_cache == 0
        releases = mem.num_releases
        time.sleep(0.5)  # nothing ran since: no more releases
        assert eng.stats().memory.num_releases == releases
    finally:
        eng.stop()


def test_busy_engine_releases_memory_periodically(lm, restore_cache_limit):
    eng = _engine(lm, release_every_s=0.0, idle_release_s=3600.0)  # every step
    try:
        trims = background_trims()
        out = submit(eng, greedy("a", list(range(1, 20)), 8))
        assert out.done.wait(60)
        assert eng.stats().memory.num_releases >= 8
        if memory_readings().get("malloc_free") is not None:  # glibc: the trims ran off-thread
            assert _wait(lambda: background_trims() > trims)
    finally:
        eng.stop()


def test_no_per_request_state_left_after_finish_and_aborts(lm):
    """Finished, cut mid-stream and cut-while-waiting requests leave nothing behind."""
    eng = _engine(lm, max_num_seqs=2, prefix_cache_bytes=1 << 20)
    try:
        outs = []
        for i in range(12):
            prompt = [1 + (i * 7 + j) % 500 for j in range(5 + 9 * i)]
            params = SamplingParams(temperature=0.7, max_tokens=6 + i, seed=i,
                                    logprobs=i % 2 == 0, top_logprobs=2 * (i % 2))
            outs.append(submit(eng, Request(f"r{i}", prompt, params)))
        for i in (3, 7, 11):  # some mid-flight, some still waiting (2 rows at a time)
            eng.abort(f"r{i}")
        assert all(o.done.wait(60) for o in outs)
        assert _wait(lambda: eng.stats().num_running == 0 and eng.stats().kv_bytes == 0)
        assert eng._sinks == {}
        assert eng.scheduler.prefix._looked == {}
        assert not eng.scheduler.waiting and eng.scheduler.prefill is None
        assert eng.stats().active_requests == 0
    finally:
        eng.stop()


def test_a_long_prompt_aborted_mid_prefill_leaves_no_chunk_behind(lm):
    """A long prompt's chunks are launched, not waited for; cut off between two chunks, it
    leaves nothing running, and a prompt prefilled in such chunks next is exact."""
    eng = Engine(lm, EngineConfig(SchedulerConfig(prefill_chunk=64, prefill_budget=64),
                                  prefix_block_size=16))
    events: list = []
    prompt = [1 + j % 400 for j in range(600)]
    eng.add(Request("long", prompt, SamplingParams(temperature=0.0, max_tokens=4)), events.extend)
    eng.turn()
    eng.turn()
    group = eng.scheduler.prefill
    assert group is not None and 0 < group.done < len(prompt)  # between two chunks
    eng.abort("long")
    while eng.has_pending():
        eng.turn()
    assert eng.scheduler.prefill is None and eng.stats().kv_bytes == 0
    assert events and events[-1].finish_reason == "abort"
    # a prompt prefilled in several launched-ahead chunks decodes as in one forward
    short = prompt[:300]
    got: list = []
    eng.add(Request("again", short, SamplingParams(temperature=0.0, max_tokens=8)), got.extend)
    while eng.has_pending():
        eng.turn()
    tokens = [t for e in got for t in e.token_ids]
    assert len(tokens) == 8 and greedy_deviations(lm.model, short, tokens) == (0, 0.0)


def test_memory_readings_by_owner():
    mem = memory_readings()
    for key in ("mlx_active", "mlx_cache", "mlx_peak", "python_blocks"):
        assert mem[key] >= 0
    if "malloc_free" in mem:  # glibc
        assert mem["rss"] > 0 and mem["malloc_in_use"] > 0
    a = mx.ones((1 << 18,))
    mx.eval(a)
    del a
    release_idle_memory()
    assert mx.get_cache_memory() == 0


def test_health_and_metrics_report_memory(real_server):
    mem = httpx.get(real_server.url + "/health").json()["engine"]["memory"]
    assert mem["mlx_cache_limit"] > 0 and mem["mlx_active"] > 0
    text = httpx.get(real_server.url + "/metrics").text
    owners = {s.labels["owner"] for fam in text_string_to_metric_families(text)
              if fam.name == "mlxd_memory_bytes" for s in fam.samples}
    assert {"mlx_active", "mlx_cache", "mlx_cache_limit"} <= owners
