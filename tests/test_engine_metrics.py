"""/metrics from a real run: the bundled model with n-gram speculation and the prefix cache on,
requests through the real app (uvicorn), and the exported figures equal the engine's stats."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from engine.core import AsyncEngine, Engine, EngineConfig
from engine.loader import load_model
from engine.scheduler import SchedulerConfig
from engine.spec import SpecConfig
from server.app import create_app
from server.config import ServerConfig
from tests.fake_engine import ServerThread


def _samples(text: str) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith(("mlxd_spec_decode_", "mlxd_prefix_cache_")):
                key = s.name
                if "position" in s.labels:  # one sample per position: keyed by its labels
                    key += "{" + ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items())) + "}"
                out[key] = s.value
    return out


def test_metrics_export_speculation_and_prefix_cache_figures_of_a_real_run(tinycoder_path):
    lm = load_model(str(tinycoder_path), dtype="float32")
    spec = SpecConfig("ngram", num_draft_tokens=4, adaptive=False)
    engine = Engine(lm, EngineConfig(SchedulerConfig(), spec=spec, prefix_cache_bytes=64 << 20))
    client = AsyncEngine(engine)
    client.start()
    try:
        with ServerThread(create_app(client, ServerConfig())) as srv:
            model = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]
            # repetitive code: the n-gram lookup finds drafts; the same prompt twice: a prefix hit
            prompt = "def add(a, b):\n    return a + b\n\n" * 12
            for _ in range(2):
                r = httpx.post(srv.url + "/v1/completions", timeout=120, json=dict(
                    model=model, prompt=prompt, max_tokens=40, temperature=0.0))
                assert r.status_code == 200, r.text
            got = _samples(httpx.get(srv.url + "/metrics").text)
            health = httpx.get(srv.url + "/health").json()["engine"]
        stats = client.stats()
    finally:
        client.stop()
    sp, pc = stats.spec, stats.prefix_cache
    assert sp is not None and pc is not None
    assert sp.spec_steps > 0 and sp.drafted_tokens > 0 and sp.accepted_tokens > 0
    assert pc.hits >= 1 and pc.hit_tokens > 0 and pc.bytes > 0
    for key in ("spec_steps", "drafted_tokens", "accepted_tokens", "num_draft_tokens",
                "acceptance_rate", "mean_verify_width", "expected_tokens_per_round"):
        assert got[f"mlxd_spec_decode_{key}"] == float(getattr(sp, key)), key
    assert len(sp.acceptance_by_position) == 4 and sp.expected_tokens_per_round > 1.0
    for j, value in enumerate(sp.acceptance_by_position, start=1):
        key = f'mlxd_spec_decode_acceptance_by_position{{method="ngram",position="{j}"}}'
        assert got[key] == value, key
    assert got["mlxd_spec_decode_drafter_lookup_hit_rate"] == sp.drafter["lookup_hit_rate"] > 0
    assert got["mlxd_prefix_cache_hits_total"] == pc.hits
    assert got["mlxd_prefix_cache_queries_total"] == pc.queries >= 2
    assert got["mlxd_prefix_cache_hit_tokens_total"] == pc.hit_tokens
    assert got["mlxd_prefix_cache_bytes"] == pc.bytes
    # /health carries the same typed figures
    assert health["spec"]["method"] == "ngram" and health["spec"]["spec_steps"] == sp.spec_steps
    assert health["prefix_cache"]["hits"] == pc.hits and health["memory"]["weights_bytes"] > 0


def _histograms(text: str) -> dict[str, float]:
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name.startswith(("mlxd_request_", "mlxd_time_to_first_token"))
            and s.name.endswith(("_count", "_sum"))}


def test_ttft_splits_into_preprocess_queue_and_prefill(tinycoder_path):
    """Each request's time to first token is reported in parts: the HTTP side's preprocessing
    (body, template, tokens), the wait in the engine's queue (a second request waits for the
    only row) and its prefill; the parts add up to no more than the TTFT."""
    import threading

    lm = load_model(str(tinycoder_path), dtype="float32")
    engine = Engine(lm, EngineConfig(SchedulerConfig(max_num_seqs=1), prefix_cache_bytes=0))
    client = AsyncEngine(engine)
    client.start()
    try:
        with ServerThread(create_app(client, ServerConfig())) as srv:
            model = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]

            def ask(i: int) -> None:
                r = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json=dict(
                    model=model, max_tokens=24, temperature=0.0, ignore_eos=True,
                    messages=[{"role": "user", "content": f"Write function number {i}."}]))
                assert r.status_code == 200, r.text

            threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            got = _histograms(httpx.get(srv.url + "/metrics").text)
    finally:
        client.stop()
    for name in ("preprocess", "queue", "prefill"):
        assert got[f"mlxd_request_{name}_seconds_count"] == 2, name
        assert got[f"mlxd_request_{name}_seconds_sum"] > 0, name
    parts = sum(got[f"mlxd_request_{n}_seconds_sum"] for n in ("queue", "prefill"))
    assert parts <= got["mlxd_time_to_first_token_seconds_sum"] + 0.05
    # one row at a time: the second request waited for the first one's 24 tokens
    assert got["mlxd_request_queue_seconds_sum"] > got["mlxd_request_prefill_seconds_sum"] / 4
