"""End to end: a trellis-quantized tinycoder-16m answers through the HTTP API."""

from __future__ import annotations

import json

import openai
import pytest

from mlxd import DEFAULT_MODEL_DIR


@pytest.fixture(scope="module")
def trellis_server(tmp_path_factory):
    from mlxd.runtime import build_client
    from server.app import create_app
    from server.config import ServerConfig
    from tests.fake_engine import ServerThread
    from tests.trellis_dirs import quick_quantized_dir

    dst = tmp_path_factory.mktemp("trellis") / "tc-trellis"
    quick_quantized_dir(DEFAULT_MODEL_DIR, dst)
    client = build_client(model=str(dst), prefix_cache_bytes="0")
    client.start()
    try:
        with ServerThread(create_app(client, ServerConfig())) as srv:
            yield srv, dst, client
    finally:
        client.stop()


def test_trellis_model_serves_over_http(trellis_server):
    srv, dst, client = trellis_server
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization"]["method"] == "trellis"
    # the engine really runs TrellisLinear layers
    from kernels.trellis.linear import TrellisLinear

    layers = [m for _, m in client.engine.loaded.model.named_modules() if isinstance(m, TrellisLinear)]
    assert layers
    oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    out = oai.completions.create(model=client.model.model_id, prompt="def add(a, b):",
                                 max_tokens=16, temperature=0)
    assert out.usage.completion_tokens > 0 and out.choices[0].text.strip()
    chat = oai.chat.completions.create(model=client.model.model_id, max_tokens=8,
                                       messages=[{"role": "user", "content": "hi"}])
    assert chat.choices[0].finish_reason in ("stop", "length")
