"""`python -m bench agent` and `prefill`: the workload generator, the summary arithmetic, and a
toy-size real run against mlxd with the bundled model (CPU) that writes its JSON and PNG."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from bench import agent
from bench.__main__ import build_parser, main
from bench.agent import TurnRecord, interp, make_workload, summarize_run
from bench.common import default_model

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tok():
    from bench.workload import load_tokenizer

    return load_tokenizer(default_model())


def _work(tok, seed: int):
    return make_workload(tok, sessions=3, turns=3, agents=2, seed=seed, tool_tokens=(200, 400),
                         system_tokens=700)


def test_workload_is_deterministic_under_a_seed(tok):
    a, b, c = _work(tok, 0), _work(tok, 0), _work(tok, 1)
    assert a == b
    assert [p.tool_results for p in a.sessions] != [p.tool_results for p in c.sessions]
    assert a.system_prompts != c.system_prompts


def test_workload_shape(tok):
    w = _work(tok, 0)
    assert len(w.system_prompts) == 2 and [p.agent for p in w.sessions] == [0, 1, 0]
    for p in w.sessions:
        assert len(p.tool_results) == 2  # one after every turn but the last
        for r in p.tool_results:
            # real text of the checkout: the named file's first line is in the excerpt
            first = (agent.common.REPO / r.path).read_text().splitlines()[0]
            assert r.text.startswith(f"==> {r.path} <==\n") and first[:20] in r.text
            assert 200 <= r.num_tokens <= 400 + 16  # the header line and re-encoding
    for text, n in zip(w.system_prompts, w.system_tokens, strict=True):
        assert '"name": "read_file"' in text and 690 <= n <= 760


def test_tool_messages_answer_each_call():
    result = agent.ToolResult("a.py", "text", 1)
    plain = agent._tool_messages({"role": "assistant", "content": "hi"}, result)
    assert plain == [{"role": "user", "content": "Output of read_file a.py:\ntext"}]
    calls = {"role": "assistant", "content": "", "tool_calls": [{"id": "c1"}, {"id": "c2"}]}
    msgs = agent._tool_messages(calls, result)
    assert [(m["role"], m["tool_call_id"], m["content"]) for m in msgs] == [
        ("tool", "c1", "text"), ("tool", "c2", "(no output)")]


def test_streamed_tool_call_deltas_merge():
    msg: dict = {"role": "assistant", "content": ""}
    calls: dict = {}
    assert agent._merge_delta(msg, calls, {"content": "Let me look."})
    assert agent._merge_delta(msg, calls, {"tool_calls": [
        {"index": 0, "id": "call_1", "function": {"name": "read_file", "arguments": '{"pa'}}]})
    assert agent._merge_delta(msg, calls, {"tool_calls": [
        {"index": 0, "function": {"arguments": 'th": "x"}'}}]})
    assert not agent._merge_delta(msg, calls, {"role": "assistant"})
    assert msg["content"] == "Let me look."
    assert calls[0]["id"] == "call_1" and calls[0]["function"] == {
        "name": "read_file", "arguments": '{"path": "x"}'}


def test_interp_and_summary_arithmetic():
    assert interp([100, 300], [1.0, 3.0], 200) == pytest.approx(2.0)
    assert interp([100, 300], [1.0, 3.0], 600) == pytest.approx(6.0)  # extrapolated
    assert interp([100], [0.5], 300) == pytest.approx(1.5)
    recs = [
        TurnRecord(0, 0, 1, 0.0, 2.0, 1.0, 1000, 0, 100, reusable_tokens=500, ok=True),
        TurnRecord(0, 0, 2, 2.0, 4.0, 0.5, 1600, 992, 100, reusable_tokens=1100, ok=True),
        TurnRecord(1, 1, 1, 0.0, 1.0, None, None, error="http_400"),
    ]
    agent.fill_ideal(recs, {"prompt_tokens": [100, 1000], "ttft_s": [0.1, 1.0]})
    assert recs[1].new_tokens == 500 and recs[1].ideal_ttft == pytest.approx(0.5)
    s = summarize_run(recs, Counter({"turns": 1, "error": 1}), wall=60.0)
    assert s["turns_completed"] == 2 and s["turns_failed"] == 1
    assert s["failures"] == {"http_400": 1}
    assert s["turns_per_min"] == pytest.approx(2.0) and s["output_tok_s"] == pytest.approx(200 / 60)
    assert s["prefix_hit_ratio"] == pytest.approx(992 / 2600)
    assert s["reprefilled_tokens"] == 2600 - 992
    assert s["cached_of_reusable_turn2plus"] == pytest.approx(992 / 1100)
    assert s["ttft_over_ideal_turn2plus"]["p50"] == pytest.approx(1.0)
    assert set(s["ttft_by_turn"]) == {"1", "2"}


def test_parsers():
    args = build_parser().parse_args(["agent", "--tool-tokens", "300,900", "--peers", ""])
    assert args.tool_tokens == (300, 900) and args.peers == "" and callable(args.func)
    args = build_parser().parse_args(["prefill", "--sizes", "1024,4096"])
    assert args.sizes == [1024, 4096]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["agent", "--tool-tokens", "900,300"])


def test_agent_toy_run_writes_its_json(tmp_path: Path):
    out = tmp_path / "agent"
    rc = main(["agent", "--sessions", "2", "--turns", "2", "--tool-tokens", "100,200",
               "--max-tokens", "24", "--calib-sizes", "64,256", "--calib-repeats", "1",
               "--peers", "", "--out", str(out)])
    assert rc == 0
    result = json.loads((out / "agent.json").read_text())
    assert result["bench"] == "agent" and result["command"].startswith("python -m bench agent")
    assert (out / "agent.png").read_bytes()[:8] == PNG_MAGIC
    assert result["raw"]["prefill_tok_s"][0] > 0
    e = result["servers"]["mlxd"]
    assert len(e["calibration"]["ttft_s"]) == 2 and min(e["calibration"]["ttft_s"]) > 0
    turns = e["turns"]
    assert sorted((t["session"], t["turn"]) for t in turns) == [(0, 1), (0, 2), (1, 1), (1, 2)]
    for t in turns:
        assert t["ok"] and t["ttft"] > 0 and t["e2e"] >= t["ttft"]
        assert 0 <= t["cached_tokens"] <= t["prompt_tokens"]
        assert 0 < t["output_tokens"] <= 24 and t["ideal_ttft"] > 0
    for t in (t for t in turns if t["turn"] == 2):
        first = next(u for u in turns if u["session"] == t["session"] and u["turn"] == 1)
        assert t["reusable_tokens"] == first["prompt_tokens"] + first["output_tokens"]
        assert t["prompt_tokens"] > t["reusable_tokens"]  # the tool result came after
    s = e["summary"]
    assert s["turns_completed"] == 4 and s["turns_failed"] == 0 and s["sessions"] == 2
    assert s["ended_by"] == {"turns": 2}
    assert 0 <= s["prefix_hit_ratio"] <= 1 and s["ttft_turn2plus_s"]["n"] == 2
    assert s["turns_per_min"] > 0 and s["output_tok_s"] > 0
    assert "| mlxd | 4 |" in (out / "table.md").read_text()
