"""While no rows decode, several waiting long prompts are prefilled side by side (one group,
chunk by chunk, rows x chunk columns within the group budget): the scheduler's order bound still
holds, and each output equals the prompt prefilled alone (exact tier, float32), with prefix-cache
hits of different lengths in the group and with a row aborted mid-prefill."""

from __future__ import annotations

import random

from engine.core import Engine, EngineConfig
from engine.scheduler import SchedulerConfig
from tests.test_sched_prefill import CHUNK, FakeRunner, _drive, _passes, _row, _scheduler
from tests.tiny_models import Collected, greedy, loaded, run_alone, submit, tiny_model


def test_long_prompts_share_a_group_only_while_nothing_decodes():
    idle = _scheduler(prefill_budget=2 * CHUNK, idle_budget_factor=2)  # 4 rows x one chunk
    for i in range(6):
        idle.add(_row(f"l{i}", 3 * CHUNK + i, 4))
    group = idle.schedule().prefill
    assert [r.req_id for r in group.rows] == ["l0", "l1", "l2", "l3"]
    busy = _scheduler(prefill_budget=2 * CHUNK, idle_budget_factor=2)
    busy.add(_row("d", 5, 100))
    busy.update(plan := busy.schedule(), FakeRunner().run(plan))
    for i in range(3):
        busy.add(_row(f"l{i}", 3 * CHUNK + i, 4))
    assert [r.req_id for r in busy.schedule().prefill.rows] == ["l0"]


def test_no_request_is_passed_in_more_than_max_passed_steps_with_idle_spells():
    """Long and short prompts arriving in bursts with quiet gaps (rows finish, the batch
    empties, long prompts group): nobody is passed by later ones in more than max_passed
    steps, and every prompt gets its first token."""
    rng = random.Random(7)
    arrivals: dict[int, list] = {}
    arrived: dict[str, int] = {}
    order: list[str] = []
    step = 0
    for i in range(50):
        step += rng.choice([0, 1, 1, 2, 30])
        plen = rng.choice([rng.randint(2 * CHUNK, 8 * CHUNK), rng.randint(2, CHUNK)])
        rid = f"p{i}"
        arrivals.setdefault(step, []).append(_row(rid, plen, rng.randint(2, 12)))
        arrived[rid], order = step, order + [rid]
    runner = _drive(_scheduler(max_passed=3), arrivals)
    passes = _passes(runner, arrived, order)
    assert max(passes.values()) <= 3, passes
    assert set(runner.joined) == set(order)
    long_groups = [ids for _, ids in runner.groups
                   if sum(1 for rid in ids if arrivals_len(arrivals, rid) > CHUNK) > 1]
    assert long_groups, "no two long prompts ever shared a group: the test shows nothing"


def arrivals_len(arrivals: dict[int, list], rid: str) -> int:
    return next(r.num_prompt_tokens for rows in arrivals.values() for r in rows if r.req_id == rid)


def _lm():
    model, cfg = tiny_model("llama")
    return loaded(model, cfg)


def _engine(lm, prefix_bytes: int = 0) -> Engine:
    # 32 columns per chunk (16 with the prefix cache: the ring of 24), budget: 4 rows of a chunk
    sched = SchedulerConfig(prefill_chunk=32, prefill_budget=32 if prefix_bytes == 0 else 16,
                            idle_budget_factor=4)
    return Engine(lm, EngineConfig(sched, prefix_cache_bytes=prefix_bytes, prefix_block_size=8))


def _grouped(eng: Engine, reqs) -> dict[str, Collected]:
    """Queue all requests before the engine thread starts, so the first step sees them all."""
    outs = {r.req_id: submit(eng, r) for r in reqs}
    eng.start()
    try:
        assert all(o.done.wait(120) for o in outs.values())
    finally:
        eng.stop()
    return outs


def _alone(lm, reqs, prefix_bytes: int = 0, warm=None) -> dict[str, list[int]]:
    eng = _engine(lm, prefix_bytes)
    eng.start()
    try:
        if warm is not None:
            run_alone(eng, warm)
        return {r.req_id: run_alone(eng, greedy(r.req_id, r.prompt_ids, r.params.max_tokens)).tokens
                for r in reqs}
    finally:
        eng.stop()


def test_grouped_long_prefill_equals_alone():
    lm = _lm()
    rng = random.Random(11)
    reqs = [greedy(f"g{i}", [rng.randrange(3, 500) for _ in range(n)], 10)
            for i, n in enumerate((70, 95, 121, 150))]
    eng = _engine(lm)
    got = _grouped(eng, reqs)
    assert eng.runner.shapes[("prefill", 4, 32)] > 0  # the four went side by side
    assert {k: v.tokens for k, v in got.items()} == _alone(lm, reqs)


def test_grouped_long_prefill_with_prefix_hits_of_different_lengths_equals_alone():
    lm = _lm()
    rng = random.Random(12)
    shared = [rng.randrange(3, 500) for _ in range(60)]
    warm = greedy("warm", shared + [7], 2)
    reqs = [greedy("hit-a", shared + [rng.randrange(3, 500) for _ in range(40)], 10),
            greedy("hit-b", shared[:33] + [rng.randrange(3, 500) for _ in range(90)], 10),
            greedy("miss", [rng.randrange(3, 500) for _ in range(110)], 10)]
    eng = _engine(lm, prefix_bytes=1 << 20)
    first = submit(eng, warm)
    while eng._drain_inbox() or eng.scheduler.has_work() or eng.runner.in_flight:
        eng._step()  # on this thread: the engine's thread starts with the group below
    assert first.finish == "length"
    got = _grouped(eng, reqs)
    cached = {k: v.events[-1].num_cached_tokens for k, v in got.items()}
    assert cached["hit-a"] > cached["hit-b"] > 0 == cached["miss"], cached
    assert any(rows == 3 for kind, rows, _ in eng.runner.shapes if kind == "prefill")
    assert {k: v.tokens for k, v in got.items()} == _alone(lm, reqs, 1 << 20, warm)


def test_a_row_aborted_mid_group_prefill_leaves_the_others_exact():
    """Prompts of 40, 45 and 200 tokens prefill together in 32-column chunks; the long one is
    aborted once the two short ones are through their prompts (so no forward is left to
    finish the group), and in another run after the first chunk."""
    lm = _lm()
    rng = random.Random(13)
    reqs = [greedy(f"a{i}", [rng.randrange(3, 500) for _ in range(n)], 12)
            for i, n in enumerate((40, 45, 200))]
    want = _alone(lm, reqs[:2])
    for abort_after in (2, 1):
        eng = _engine(lm)
        outs: dict[str, list[int]] = {r.req_id: [] for r in reqs}
        finish: dict[str, str | None] = {}
        def sink(events, outs=outs, finish=finish):
            for ev in events:
                outs[ev.req_id].extend(ev.token_ids)
                finish[ev.req_id] = ev.finish_reason

        for r in reqs:
            eng.add(greedy(r.req_id, r.prompt_ids, 12), sink)
        for step in range(200):
            eng._drain_inbox()
            if step == abort_after:
                assert eng.scheduler.prefill is not None and len(eng.scheduler.prefill.rows) == 3
                eng.abort("a2")
                continue
            if not (eng.scheduler.has_work() or eng.runner.in_flight):
                break
            eng._step()
        assert finish == {"a0": "length", "a1": "length", "a2": "abort"}, finish
        assert {k: outs[k] for k in ("a0", "a1")} == want, abort_after
