"""`--trace-steps`: one JSON line per engine step with its phases' seconds and its rows
(engine.steptrace), consistent with what the engine ran."""

from __future__ import annotations

import json
import random

from engine.core import PREFIX_BLOCK_SIZE, Engine, EngineConfig
from engine.loader import load_model
from engine.scheduler import SchedulerConfig
from tests.tiny_models import drive, greedy


def test_each_step_is_traced_with_its_phases_and_rows(tinycoder_path, tmp_path):
    lm = load_model(str(tinycoder_path), dtype="float32")
    lm.eos_token_ids = ()
    rng = random.Random(2)
    path = tmp_path / "steps.jsonl"
    eng = Engine(lm, EngineConfig(SchedulerConfig(prefill_chunk=256), warmup=True,
                                  trace_steps=str(path)))
    shared = [rng.randrange(3, 8000) for _ in range(700)]  # a long prompt: three chunks
    first = greedy("a", shared, 6)
    drive(eng, [first])
    second = greedy("b", shared + [rng.randrange(3, 8000) for _ in range(40)], 6)
    (got,) = drive(eng, [second])
    eng.shutdown()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == eng.stats().num_steps  # warm-up forwards are not steps
    for rec in lines:
        phases = [rec.get(k, 0.0) for k in
                  ("schedule", "prefill", "launch", "collect", "update", "emit")]
        assert min(phases) >= 0 and sum(phases) <= rec["seconds"] + 1e-6
        assert rec.get("prefill_wait", 0.0) + rec.get("store", 0.0) <= rec.get("prefill", 0.0)
        assert (rec["prefill_rows"] > 0) == ("prefill" in rec)
    prefilled = [r for r in lines if r["prefill_rows"]]
    # the first prompt in three chunks, nothing cached; the second: its uncached tail
    cached = got.events[-1].num_cached_tokens
    assert cached == len(shared) // PREFIX_BLOCK_SIZE * PREFIX_BLOCK_SIZE
    assert sum(r["prefill_cols"] for r in prefilled) == len(shared) + len(second.prompt_ids) - cached
    assert [r["prefill_cached"] for r in prefilled if r["prefill_cached"]] == [cached]
    assert sum("prefill_wait" in r for r in prefilled) == 2  # each prompt's last chunk
    assert sum(r["joined"] for r in lines) == 2
    assert any(r["decode_rows"] == 1 and "launch" in r and not r["prefill_rows"] for r in lines)

    # `python -m bench steps` sorts them into kinds and writes its JSON and PNG
    from bench.__main__ import main

    assert main(["steps", str(path), "--out", str(tmp_path / "out")]) == 0
    result = json.loads((tmp_path / "out" / "steps.json").read_text())
    assert (tmp_path / "out" / "steps.png").stat().st_size > 0
    kinds = {k["kind"]: k for k in result["kinds"]}
    assert result["steps"] == len(lines) == sum(k["steps"] for k in kinds.values())
    assert sum(k["steps"] for name, k in kinds.items() if "join" in name) == 2
    assert kinds["decode"]["steps"] == sum(not r["prefill_rows"] for r in lines)
    assert kinds["decode"]["prefill_median"] == 0 and kinds["decode"]["launch_median"] > 0


def test_a_speculative_round_is_traced_with_its_own_phases(tinycoder_path, tmp_path):
    """Verify steps carry propose .. observe instead of launch / collect, within the step's
    seconds, and `bench steps` counts them as their own kind."""
    from engine.spec import SpecConfig

    lm = load_model(str(tinycoder_path), dtype="float32")
    lm.eos_token_ids = ()
    path = tmp_path / "steps.jsonl"
    eng = Engine(lm, EngineConfig(SchedulerConfig(), trace_steps=str(path),
                                  spec=SpecConfig(method="prediction", adaptive=False)))
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 8000) for _ in range(40)] for _ in range(2)]
    plain = drive(eng, [greedy(f"plain{i}", p, 16) for i, p in enumerate(prompts)])
    reqs = [greedy(f"spec{i}", p, 16) for i, p in enumerate(prompts)]
    for r, out in zip(reqs, plain, strict=True):  # the answer, one token in its middle changed
        r.prediction_ids = out.tokens[:8] + [(out.tokens[8] + 1) % 8000] + out.tokens[9:]
    drive(eng, reqs)
    eng.shutdown()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    rounds = [r for r in lines if r["width"] > 1]
    spec = eng.stats().spec
    assert rounds and len(rounds) == spec.spec_steps and spec.accepted_tokens > 0
    verify_phases = ("propose", "verify_build", "verify_wait", "verdict", "commit", "observe")
    for rec in rounds:
        assert all(k in rec for k in verify_phases) and "launch" not in rec
        phases = [rec[k] for k in verify_phases] + [rec["schedule"], rec["update"], rec["emit"]]
        assert min(phases) >= 0 and sum(phases) <= rec["seconds"] + 1e-6

    from bench.__main__ import main

    assert main(["steps", str(path), "--out", str(tmp_path / "out")]) == 0
    result = json.loads((tmp_path / "out" / "steps.json").read_text())
    kinds = {k["kind"]: k for k in result["kinds"]}
    assert kinds["verify"]["steps"] == sum(not r["prefill_rows"] for r in rounds)
    assert kinds["verify"]["verify_wait_median"] > 0 and kinds["verify"]["launch_median"] == 0
    assert set(verify_phases) <= set(result["phases"])

    # two traces: each summarised, and their kinds side by side
    plain_trace = tmp_path / "plain.jsonl"
    plain_trace.write_text("".join(json.dumps(r) + "\n" for r in lines if r["width"] <= 1))
    assert main(["steps", str(plain_trace), str(path), "--out", str(tmp_path / "both")]) == 0
    runs = json.loads((tmp_path / "both" / "steps.json").read_text())["runs"]
    assert [r["trace"] for r in runs] == [str(plain_trace), str(path)]
    assert "verify" not in {k["kind"] for k in runs[0]["kinds"]}
    assert runs[1]["kinds"] == result["kinds"] and runs[1]["phases"] == result["phases"]
