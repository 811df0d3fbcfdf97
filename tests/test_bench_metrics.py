"""The benchmark's metrics math, the prompt builder and the sweep table (no server)."""

from __future__ import annotations

import random

import pytest

from bench.loadgen import spread_tokens
from bench.metrics import RequestRecord, level_ratios, percentile, summarize
from bench.sweep import requests_for, table


def _rec(start: float, ttft: float, gaps: list[float], ok: bool = True,
         error: str | None = None) -> RequestRecord:
    times = [start + ttft]
    for g in gaps:
        times.append(times[-1] + g)
    r = RequestRecord(start=start, end=times[-1], ttft=ttft, chunk_times=times,
                      chunk_tokens=[1] * len(times), output_tokens=len(times), ok=ok,
                      error=error, prompt_tokens=128, finish_reason="length" if ok else None)
    return r


def test_percentile_matches_numpy_linear():
    np = pytest.importorskip("numpy")
    rng = random.Random(1)
    xs = [rng.random() for _ in range(37)]
    for q in (0, 1, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0


def test_summarize_throughput_ttft_itl():
    recs = [_rec(0.0, 0.5, [0.1] * 9), _rec(0.0, 1.5, [0.2] * 9),
            RequestRecord(start=0.0, end=0.1, error="http_429", status=429)]
    s = summarize(recs, wall_s=4.0)
    assert s["num_requests"] == 3 and s["num_completed"] == 2 and s["num_failed"] == 1
    assert s["failures"] == {"http_429": 1}
    assert s["output_tokens"] == 20
    assert s["output_tok_s"] == pytest.approx(5.0)
    assert s["request_per_s"] == pytest.approx(0.5)
    assert s["ttft_s"]["p50"] == pytest.approx(1.0)
    assert s["itl_s"]["p50"] == pytest.approx(0.15)  # 9 gaps of 0.1 and 9 of 0.2
    assert s["itl_s"]["p99"] == pytest.approx(0.2)
    # TPOT of the first request: (1.4 - 0.5) / 9
    assert s["tpot_s"]["p50"] == pytest.approx(((0.9 / 9) + (1.8 / 9)) / 2)
    assert s["finish_reasons"] == {"length": 2}


def test_multi_token_chunks_spread_gaps():
    r = RequestRecord(start=0.0, end=1.0, ttft=0.2, chunk_times=[0.2, 0.6],
                      chunk_tokens=[1, 4], output_tokens=5, ok=True)
    assert r.itl_gaps() == pytest.approx([0.1] * 4)


def test_spread_tokens():
    assert spread_tokens(0, 5) == []
    assert spread_tokens(3, 3) == [1, 1, 1]
    assert spread_tokens(3, 2) == [1, 1, 1]  # more chunks than tokens: one each
    assert spread_tokens(4, 10) == [1, 3, 3, 3]
    assert sum(spread_tokens(7, 128)) == 128


def test_ratios():
    mine = summarize([_rec(0, 0.1, [0.05] * 9)], 1.0)
    peer = summarize([_rec(0, 0.4, [0.1] * 9)], 2.0)
    r = level_ratios(mine, peer)
    assert r["output_tok_s"] == pytest.approx(2.0)
    assert r["ttft_p99"] == pytest.approx(0.25)
    assert r["itl_p50"] == pytest.approx(0.5)
    empty = summarize([], 1.0)
    assert level_ratios(mine, empty)["ttft_p50"] is None


def test_requests_per_level():
    levels = [1, 4, 16, 64]
    assert [requests_for(c, None, levels) for c in levels] == [8, 8, 32, 128]
    assert [requests_for(c, "8,8,32,64", levels) for c in levels] == [8, 8, 32, 64]
    assert requests_for(16, "5", levels) == 5


def test_table_renders():
    s = summarize([_rec(0, 0.1, [0.05] * 9)], 1.0)
    result = {"servers": {"mlxd": {"label": "mlxd"}, "p": {"label": "peer"}},
              "levels": [{"concurrency": 1, "results": {"mlxd": s, "p": s},
                          "ratios": {"p": level_ratios(s, s)}}]}
    md = table(result)
    assert "| 1 | mlxd |" in md and "1.00x" in md


def test_exact_length_prompts(tinycoder_path):
    from bench.workload import load_tokenizer, make_prompts

    prompts = make_prompts(tinycoder_path, 6, 128, seed=3)
    tok = load_tokenizer(tinycoder_path)
    for p in prompts:
        assert p.num_tokens == 128
        assert len(tok.encode(p.text, add_special_tokens=False)) == 128
    assert len({p.text for p in prompts}) == 6
    assert [p.text for p in make_prompts(tinycoder_path, 6, 128, seed=3)] == [p.text for p in prompts]
