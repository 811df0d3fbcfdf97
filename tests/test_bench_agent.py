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
            assert 200 - 4 <= r.num_tokens <= 400 + 4  # the header line counts; re-encoding
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
    assert interp([100, 300], [1.0, 5.0], 20) == pytest.approx(0.2)  # proportional below
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
    assert s["new_tokens_turn2plus_mean"] == 500 and s["reprefilled_turn2plus_mean"] == 608
    assert set(s["ttft_by_turn"]) == {"1", "2"}


def test_ideal_in_context_interpolates_over_the_prefix():
    fresh = {"prompt_tokens": [100, 1000], "ttft_s": [0.1, 1.0]}
    in_ctx = {"levels": [
        {"prefix": 1000, "cached_tokens": [990, 1010], "new_tokens": [100, 1000],
         "ttft_s": [0.2, 2.0]},
        {"prefix": 2000, "cached_tokens": [2000], "new_tokens": [100, 1000], "ttft_s": [0.3, 3.0]},
    ]}
    ideal = agent.ideal_in_context
    assert ideal(fresh, in_ctx, 0, 500) == pytest.approx(0.5)  # no prefix: the fresh prompt
    assert ideal(fresh, None, 1500, 500) == pytest.approx(0.5)  # no in-context calibration
    assert ideal(fresh, in_ctx, 1000, 500) == pytest.approx(1.0)
    assert ideal(fresh, in_ctx, 500, 500) == pytest.approx(0.75)  # between prefix 0 and 1000
    assert ideal(fresh, in_ctx, 1500, 100) == pytest.approx(0.25)
    assert ideal(fresh, in_ctx, 3000, 1000) == pytest.approx(4.0)  # past the longest prefix
    recs = [TurnRecord(0, 0, 2, 0.0, 1.0, 2.0, 1500, 992, 10, reusable_tokens=1000, ok=True)]
    agent.fill_ideal(recs, fresh, in_ctx)
    assert recs[0].ideal_ttft == pytest.approx(1.0) and recs[0].ideal_fresh_ttft == pytest.approx(0.5)
    s = summarize_run(recs, Counter({"turns": 1}), wall=1.0)
    assert s["ttft_over_ideal_turn2plus"]["p50"] == pytest.approx(2.0)
    assert s["ttft_over_ideal_fresh_turn2plus"]["p50"] == pytest.approx(4.0)


def test_in_context_levels_fit_the_context():
    levels = agent.in_context_levels(4096, [128, 512, 1024, 2048, 3072])
    assert [p for p, _ in levels] == [1024, 2048, 3072]
    assert levels[0][1] == [128, 512, 1024, 2048] and levels[2][1] == [128, 512]
    assert all(p + n < 4096 for p, news in levels for n in news)


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
    levels = e["calibration_in_context"]["levels"]
    assert [lv["prefix"] for lv in levels] == [1024, 2048, 3072]
    for lv in levels:  # the server reports the prefix as cached, up to its last partial block
        assert all(lv["prefix"] - 64 <= c <= lv["prefix"] + 8 for c in lv["cached_tokens"])
        assert all(t > 0 for t in lv["ttft_s"]) and lv["new_tokens"] == sorted(lv["new_tokens"])
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
    assert s["turns_per_min"] > 0 and s["output_tok_s"] > 0 and s["server_cpu_s"] > 0
    # the sessions' TTFT in parts, from mlxd's /metrics: the parts fit inside the TTFT
    parts = s["ttft_parts_mean_s"]
    assert set(parts) == {"preprocess", "queue", "prefill", "ttft"}
    assert all(v >= 0 for v in parts.values()) and parts["prefill"] > 0
    assert parts["queue"] + parts["prefill"] <= parts["ttft"] + 0.05
    assert "| mlxd | 4 |" in (out / "table.md").read_text()


def _sse_server(prompt_tokens: list[int], seen: list[dict]):
    """A chat endpoint that streams one content chunk and a usage block per request."""
    import httpx

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        n = prompt_tokens[len(seen) - 1]
        chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant"}}]},
                  {"choices": [{"index": 0, "delta": {"content": f"answer {len(seen)}"}}]},
                  {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
                  {"choices": [], "usage": {"prompt_tokens": n, "completion_tokens": 50,
                                            "prompt_tokens_details": {"cached_tokens": n // 2}}}]
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handler)


def test_session_sends_the_whole_history_and_ends_at_the_context(tok):
    import asyncio

    import httpx

    work = make_workload(tok, sessions=1, turns=4, agents=1, seed=0, tool_tokens=(200, 200),
                         system_tokens=600)
    seen: list[dict] = []
    cfg = agent.RunConfig("http://test", "m", max_tokens=100, context=1600, turns=4)

    records: list[TurnRecord] = []

    async def go():
        async with httpx.AsyncClient(transport=_sse_server([700, 1000, 1300, 1600], seen)) as c:
            return await agent.run_session(c, cfg, work, work.sessions[0], records)

    why = asyncio.run(go())
    # after turn 2: 1000 + 50 + ~210 (tool) + 32 + 100 = ~1392 fits 1600; after turn 3 ~1692 not
    assert why == "context" and [r.turn for r in records] == [1, 2, 3]
    assert [r.cached_tokens for r in records] == [350, 500, 650]
    assert records[1].reusable_tokens == 750 and records[2].reusable_tokens == 1050
    assert all(r.ok and r.ttft is not None and r.finish_reason == "stop" for r in records)
    last = seen[-1]["messages"]
    assert [m["role"] for m in last] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert last[2] == {"role": "assistant", "content": "answer 1"}
    assert last[3]["content"].endswith(work.sessions[0].tool_results[0].text)
    assert seen[0]["tools"] == agent.TOOLS and seen[0]["stream"] is True


def test_random_model_context_for_the_long_prompt_case(tmp_path: Path):
    assert main(["random-model", str(tmp_path / "m"), "--shape", "tiny", "--bits", "0",
                 "--context", "32768"]) == 0
    assert agent.context_of(str(tmp_path / "m")) == 32768
    assert agent.context_of(str(default_model())) == 4096


def test_prefill_toy_run_against_raw(tmp_path: Path):
    out = tmp_path / "prefill"
    assert agent.clip_sizes([1024, 8192, 32768], 4096) == [1024, 4088]
    assert main(["prefill", "--sizes", "200,64", "--repeats", "1", "--peers", "",
                 "--out", str(out)]) == 0
    result = json.loads((out / "prefill.json").read_text())
    assert result["bench"] == "prefill" and (out / "prefill.png").read_bytes()[:8] == PNG_MAGIC
    c = result["servers"]["mlxd"]["calibration"]
    assert result["config"]["sizes"] == c["sizes"] == c["prompt_tokens"] == [64, 200]
    assert all(v > 0 for v in c["prefill_tok_s"] + c["cpu_s_per_request"])
    raw = result["raw"]
    assert raw["prompt_tokens"] == [64, 200] and all(v > 0 for v in raw["cpu_s"])
    eng = result["engine"]
    assert eng["sizes"] == eng["prompt_tokens"] == [64, 200] and all(v > 0 for v in eng["prefill_s"])
    # mlxd splits its TTFT: the parts are positive and add up to no more than the client's TTFT
    # of the request (the fastest one here is the only one)
    for t, part in zip(c["ttft_s"], c["ttft_parts_mean_s"], strict=True):
        assert set(part) >= {"preprocess", "queue", "prefill"} and min(part.values()) >= 0
        assert 0 < sum(part[k] for k in ("preprocess", "queue", "prefill")) <= t
    table = (out / "table.md").read_text()
    assert "| 200 |" in table and "engine alone / raw" in table and "TTFT in parts" in table


def test_deadline_keeps_the_turns_that_finished(tok):
    import asyncio

    import httpx

    work = make_workload(tok, sessions=2, turns=3, agents=1, seed=0, tool_tokens=(200, 200),
                         system_tokens=600)
    seen: list[dict] = []
    answer = _sse_server([700] * 8, seen)

    async def handler(request: httpx.Request) -> httpx.Response:
        if len(json.loads(request.content)["messages"]) > 2:  # second turns hang
            await asyncio.sleep(30)
        return answer.handle_request(request)

    cfg = agent.RunConfig("http://test", "m", max_tokens=100, context=4096, turns=3)
    records, ended, wall = asyncio.run(agent.run_sessions(
        cfg, work, deadline_s=1.0, timeout_s=60, transport=httpx.MockTransport(handler)))
    assert ended == Counter({"deadline": 2}) and wall < 20
    assert sorted((r.session, r.turn) for r in records) == [(0, 1), (1, 1)]
    assert all(r.ok and r.start >= 0 and r.end > r.start for r in records)


def test_staggered_sessions_and_tool_time(tok):
    """--stagger spreads the sessions' first turns, --tool-seconds waits between a session's
    turns; the texts of a seed stay the same whatever the timing."""
    import asyncio

    kw = dict(sessions=3, turns=3, agents=1, seed=0, tool_tokens=(200, 200), system_tokens=600)
    plain = make_workload(tok, **kw)
    work = make_workload(tok, **kw, stagger_s=0.6, tool_seconds=(0.2, 0.3))
    assert [p.tool_results for p in work.sessions] == [p.tool_results for p in plain.sessions]
    assert [p.start_s for p in work.sessions] == pytest.approx([0.0, 0.2, 0.4])
    assert all(len(p.tool_s) == 2 and all(0.2 <= t <= 0.3 for t in p.tool_s)
               for p in work.sessions)
    assert work == make_workload(tok, **kw, stagger_s=0.6, tool_seconds=(0.2, 0.3))
    assert all(p.start_s == 0 and p.tool_s == [0.0, 0.0] for p in plain.sessions)

    seen: list[dict] = []
    cfg = agent.RunConfig("http://test", "m", max_tokens=100, context=4096, turns=3)
    records, ended, _ = asyncio.run(agent.run_sessions(
        cfg, work, deadline_s=30, timeout_s=30,
        transport=_sse_server([700] * 9, seen)))
    assert ended == Counter({"turns": 3})
    for p in work.sessions:
        rs = sorted((r for r in records if r.session == p.index), key=lambda r: r.turn)
        assert rs[0].start >= p.start_s - 0.01
        for k in (1, 2):  # the next turn waits for the tool after the answer
            assert rs[k].start - rs[k - 1].end >= p.tool_s[k - 1] - 0.01
