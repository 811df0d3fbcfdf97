"""LoRA adapters (engine/lora.py): rows with different adapters and rows without share one batch,
and each row's greedy tokens equal those of its adapter merged into the weights, served alone."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from engine import lora
from engine.api import EngineError, Request
from engine.loader import load_model
from tests.tiny_models import greedy, loaded, make_engine, run_alone, submit, tiny_model


def write_adapter(root: Path, model: Any, *, rank: int, scale: float, num_layers: int,
                  keys: list[str] | None, seed: int, std: float = 0.3) -> Path:
    """An mlx-lm adapter directory with random lora_a / lora_b for `model`'s layers."""
    root.mkdir(parents=True, exist_ok=True)
    cfg = {"fine_tune_type": "lora", "num_layers": num_layers,
           "lora_parameters": {"rank": rank, "scale": scale, "dropout": 0.0,
                               **({"keys": keys} if keys else {})}}
    probe = lora.Adapter("probe", root, rank, scale, num_layers, tuple(keys) if keys else None)
    modules = dict(model.named_modules())
    mx.random.seed(seed)
    weights: dict[str, mx.array] = {}
    for path in sorted(lora.allowed_modules(model, probe)):
        dims = lora.linear_dims(modules[path])
        assert dims is not None
        weights[f"{path}.lora_a"] = mx.random.normal((dims[0], rank)) * std
        weights[f"{path}.lora_b"] = mx.random.normal((rank, dims[1])) * std
    mx.save_safetensors(str(root / "adapters.safetensors"), weights)
    (root / "adapter_config.json").write_text(json.dumps(cfg))
    return root


def merge_into(model: Any, adapter_dir: Path) -> None:
    """W + scale * B^T A^T in every adapted module: the merged reference."""
    ad = lora.read_adapter("merged", adapter_dir)
    modules = dict(model.named_modules())
    for path, (a, b) in ad.weights.items():
        m = modules[path]
        m.weight = m.weight + ad.scale * (b.T @ a.T)
    mx.eval(model.parameters())


def _mixed_run(lm: Any, reqs: list[tuple[Request, str | None]]) -> dict[str, list[int]]:
    """Half the rows start together, the rest join while those decode; rows leave at their own
    max_tokens."""
    for req, name in reqs:
        req.adapter = name
    eng = make_engine(lm, prefill_chunk=32, prefill_budget=256)
    try:
        first, rest = reqs[: len(reqs) // 2], reqs[len(reqs) // 2:]
        outs = {r.req_id: submit(eng, r) for r, _ in first}
        lead = outs[first[0][0].req_id]
        for r, _ in rest:
            for _ in range(200):
                if len(lead.tokens) >= 3 or lead.done.is_set():
                    break
                lead.done.wait(0.01)
            outs[r.req_id] = submit(eng, r)
        for r, _ in reqs:
            assert outs[r.req_id].done.wait(300), r.req_id
        assert eng.stats().num_running == 0
        return {rid: c.tokens for rid, c in outs.items()}
    finally:
        eng.stop()


def _alone(lm: Any, reqs: list[Request]) -> dict[str, list[int]]:
    eng = make_engine(lm, prefill_chunk=32, prefill_budget=256)
    try:
        return {r.req_id: run_alone(eng, Request(r.req_id, r.prompt_ids, r.params)).tokens
                for r in reqs}
    finally:
        eng.stop()


def _requests(vocab: int, names: list[str | None], seed: int) -> list[tuple[Request, str | None]]:
    rng = random.Random(seed)
    out = []
    for i, name in enumerate(names):
        plen = 50 if i % 3 == 1 else rng.randint(2, 20)  # 50 > the 24-token window, > a chunk
        prompt = [rng.randrange(3, vocab) for _ in range(plen)]
        out.append((greedy(f"r{i}-{name}", prompt, max_tokens=rng.randint(6, 24)), name))
    return out


def _check_mixed_equals_merged(make_base: Any, adapters: dict[str, Path], vocab: int,
                               seed: int) -> None:
    base = make_base()
    served = loaded_with(base, adapters)
    names: list[str | None] = [*adapters, None] * 2 + [None, next(iter(adapters))]
    reqs = _requests(vocab, names, seed)
    mixed = _mixed_run(served, reqs)
    # the rows' indices are gone once each forward is built: another engine on this model
    # (or any other forward of it) runs without them
    attached = lora.attached(served.model)
    assert attached is not None and attached.rows is None
    assert _alone(served, [r for r, n in reqs if n is None]) == _alone(make_base(), [
        r for r, n in reqs if n is None])
    plain = make_base()
    want_base = _alone(plain, [r for r, n in reqs if n is None])
    for name, path in adapters.items():
        merged = make_base()
        merge_into(merged.model, path)
        mine = [r for r, n in reqs if n == name]
        want = _alone(merged, mine)
        other = _alone(plain, mine)
        for r in mine:
            assert mixed[r.req_id] == want[r.req_id], (name, r.req_id)
        # the adapter matters: not every row of it is the base model's output
        assert any(want[r.req_id] != other[r.req_id] for r in mine), name
    for rid, toks in want_base.items():
        assert mixed[rid] == toks, rid


def loaded_with(lm: Any, adapters: dict[str, Path]) -> Any:
    s = lora.load(lm.model, list((n, str(p)) for n, p in adapters.items()))
    assert s is not None and s.names == tuple(adapters)
    return lm


def test_tiny_llama_mixed_adapters_equal_merged_alone(tmp_path):
    model, cfg = tiny_model("llama")
    adapters = {
        "a1": write_adapter(tmp_path / "a1", model, rank=4, scale=2.0, num_layers=-1,
                            keys=["self_attn.q_proj", "self_attn.v_proj"], seed=1),
        "a2": write_adapter(tmp_path / "a2", model, rank=8, scale=1.0, num_layers=2, keys=None,
                            seed=2),
        "a3": write_adapter(tmp_path / "a3", model, rank=2, scale=4.0, num_layers=3,
                            keys=["mlp.down_proj", "mlp.up_proj"], seed=3),
    }

    def make_base() -> Any:
        m, c = tiny_model("llama")
        return loaded(m, c)

    _check_mixed_equals_merged(make_base, adapters, cfg["vocab_size"], seed=5)


def test_bundled_model_mixed_adapters_equal_merged_alone(tmp_path, tinycoder_path):
    probe = load_model(str(tinycoder_path), dtype="float32").model
    adapters = {
        "coder-a": write_adapter(tmp_path / "a", probe, rank=8, scale=1.0, num_layers=-1,
                                 keys=["self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"],
                                 seed=11, std=0.2),
        "coder-b": write_adapter(tmp_path / "b", probe, rank=4, scale=2.0, num_layers=4, keys=None,
                                 seed=12, std=0.2),
    }

    def make_base() -> Any:
        lm = load_model(str(tinycoder_path), dtype="float32")
        lm.eos_token_ids = ()
        return lm

    _check_mixed_equals_merged(make_base, adapters, make_base().vocab_size, seed=6)


def test_loader_serves_adapters_and_the_engine_refuses_unknown_names(tmp_path, tinycoder_path):
    probe = load_model(str(tinycoder_path), dtype="float32").model
    path = write_adapter(tmp_path / "a", probe, rank=2, scale=1.0, num_layers=1, keys=None, seed=3)
    lm = load_model(str(tinycoder_path), dtype="float32", adapters=[("mine", str(path))])
    assert lm.extra["adapters"] == ["mine"]
    eng = make_engine(lm)
    try:
        with pytest.raises(EngineError) as err:
            eng.add(Request("x", [5, 6, 7], adapter="other"), lambda events: None)
        assert err.value.status == 404
        req = greedy("y", [5, 6, 7], 4)
        req.adapter = "mine"
        assert len(run_alone(eng, req).tokens) >= 1
    finally:
        eng.stop()


def _engine_blocks_of_16(lm):
    """An engine whose prefix cache stores 16-token blocks (these prompts are short)."""
    from engine.core import Engine, EngineConfig
    from engine.scheduler import SchedulerConfig

    eng = Engine(lm, EngineConfig(SchedulerConfig(prefill_chunk=32), prefix_block_size=16))
    eng.start()
    return eng


def test_prefix_cache_keys_on_the_adapter(tmp_path):
    model, cfg = tiny_model("llama")
    path = write_adapter(tmp_path / "a", model, rank=4, scale=2.0, num_layers=-1, keys=None, seed=4)
    lm = loaded(model, cfg)
    lora.load(model, [("a", str(path))])
    rng = random.Random(0)
    shared = [rng.randrange(3, cfg["vocab_size"]) for _ in range(40)]
    eng = _engine_blocks_of_16(lm)
    try:
        first = run_alone(eng, greedy("base", shared + [9], 4))
        with_adapter = greedy("ad", shared + [9], 4)
        with_adapter.adapter = "a"
        got = run_alone(eng, with_adapter)
        again = greedy("ad2", shared + [9], 4)
        again.adapter = "a"
        hit = run_alone(eng, again)
    finally:
        eng.stop()
    # the base row's blocks are not served to the adapter's row; the adapter's own are
    assert got.events[-1].num_cached_tokens == 0
    assert hit.events[-1].num_cached_tokens > 0 and hit.tokens == got.tokens
    assert first.tokens != got.tokens


def _fit_error(tmp_path: Path, model: Any, mutate: Any) -> str:
    path = write_adapter(tmp_path, model, rank=2, scale=1.0, num_layers=-1,
                         keys=["self_attn.q_proj"], seed=1)
    mutate(path)
    with pytest.raises(lora.AdapterError) as err:
        lora.load(model, [("bad", str(path))])
    return str(err.value)


def test_adapters_that_do_not_fit_are_refused_at_start(tmp_path):
    model, _ = tiny_model("llama")

    def wrong_shape(p: Path) -> None:
        loaded_w = mx.load(str(p / "adapters.safetensors"))
        assert isinstance(loaded_w, dict)
        w = dict(loaded_w)
        key = next(k for k in w if k.endswith("lora_a"))
        w[key] = mx.zeros((7, 2))
        mx.save_safetensors(str(p / "adapters.safetensors"), w)

    def outside_layers(p: Path) -> None:
        cfg = json.loads((p / "adapter_config.json").read_text())
        cfg["num_layers"] = 1
        (p / "adapter_config.json").write_text(json.dumps(cfg))

    def dora(p: Path) -> None:
        cfg = json.loads((p / "adapter_config.json").read_text())
        cfg["fine_tune_type"] = "dora"
        (p / "adapter_config.json").write_text(json.dumps(cfg))

    assert "in the base" in _fit_error(tmp_path / "s", model, wrong_shape)
    assert "outside the layers" in _fit_error(tmp_path / "l", model, outside_layers)
    assert "not supported" in _fit_error(tmp_path / "d", model, dora)
    assert lora.attached(model) is None  # nothing was installed


def _serve(client: Any) -> Any:
    from server.app import create_app
    from server.config import ServerConfig
    from tests.fake_engine import ServerThread

    return ServerThread(create_app(client, ServerConfig()))


def test_http_a_request_naming_an_adapter_gets_its_output(tmp_path, tinycoder_path):
    import httpx

    from engine.core import AsyncEngine, Engine
    from mlxd.runtime import build_client

    probe = load_model(str(tinycoder_path), dtype="float32").model
    path = write_adapter(tmp_path / "a", probe, rank=4, scale=2.0, num_layers=-1, keys=None,
                         seed=21, std=0.2)
    served = build_client(model=str(tinycoder_path), dtype="float32",
                          adapters=[("coder-lora", str(path))])
    merged_lm = load_model(str(tinycoder_path), dtype="float32")
    merge_into(merged_lm.model, path)
    merged = AsyncEngine(Engine(merged_lm))
    body = {"prompt": "def fibonacci(n):", "max_tokens": 16, "temperature": 0}
    base_name = served.model.model_id
    served.start()
    merged.start()
    try:
        with _serve(served) as srv, _serve(merged) as ref:
            ids = [m["id"] for m in httpx.get(f"{srv.url}/v1/models").json()["data"]]
            assert ids == [base_name, "coder-lora"]
            card = httpx.get(f"{srv.url}/v1/models/coder-lora").json()
            assert card["id"] == "coder-lora" and card["parent"] == base_name

            def text(url: str, model: str) -> str:
                r = httpx.post(f"{url}/v1/completions", json={**body, "model": model}, timeout=60)
                assert r.status_code == 200, r.text
                return str(r.json()["choices"][0]["text"])

            with_adapter = text(srv.url, "coder-lora")
            assert with_adapter == text(ref.url, merged.model.model_id)
            assert with_adapter != text(srv.url, base_name)
            r = httpx.post(f"{srv.url}/v1/completions", json={**body, "model": "coder-other"})
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
            chat = httpx.post(f"{srv.url}/v1/chat/completions", timeout=60, json={
                "model": "coder-lora", "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}]})
            assert chat.status_code == 200, chat.text
    finally:
        served.stop()
        merged.stop()


def test_cli_adapter_flag_and_a_misfit_is_a_startup_error(tmp_path):
    from mlxd.cli import _adapter
    from mlxd.runtime import StartupError, build_client

    assert _adapter("a=/x/y") == ("a", "/x/y")
    with pytest.raises(Exception, match="NAME=PATH"):
        _adapter("/x/y")
    (tmp_path / "empty").mkdir()
    with pytest.raises(StartupError, match="--adapter: adapter 'x'.*adapter_config.json"):
        build_client(model=None, adapters=[("x", str(tmp_path / "empty"))])


def test_ngram_speculation_with_adapters_equals_plain_greedy(tmp_path):
    """Verify forwards select the rows' adapters too: forced n-gram drafting (every step a
    verify step) gives each adapter row and base row the tokens of plain greedy decoding."""
    from engine.core import Engine, EngineConfig
    from engine.scheduler import SchedulerConfig
    from engine.spec import SpecConfig

    model, cfg = tiny_model("llama")
    paths = [("a1", write_adapter(tmp_path / "a1", model, rank=4, scale=2.0, num_layers=-1,
                                  keys=None, seed=7)),
             ("a2", write_adapter(tmp_path / "a2", model, rank=2, scale=2.0, num_layers=2,
                                  keys=["self_attn.o_proj"], seed=8))]
    lora.load(model, [(n, str(p)) for n, p in paths])
    lm = loaded(model, cfg)
    rng = random.Random(3)
    reqs = []
    for i, name in enumerate(["a1", None, "a2", "a1", None, "a2"]):
        motif = [rng.randrange(3, cfg["vocab_size"]) for _ in range(5)]
        req = greedy(f"s{i}", motif * 6, max_tokens=30)
        req.adapter = name
        reqs.append(req)

    def run(spec: Any) -> dict[str, list[int]]:
        eng = Engine(lm, EngineConfig(SchedulerConfig(prefill_chunk=32), spec=spec))
        eng.start()
        try:
            outs = {r.req_id: submit(eng, Request(r.req_id, r.prompt_ids, r.params,
                                                  adapter=r.adapter)) for r in reqs}
            for c in outs.values():
                assert c.done.wait(300)
            return {k: c.tokens for k, c in outs.items()}
        finally:
            stats = eng.stats().spec
            eng.stop()
            if spec is not None:
                assert stats is not None and stats.spec_steps > 0

    assert run(SpecConfig("ngram", num_draft_tokens=4, adaptive=False)) == run(None)


def test_quantized_base_takes_adapters_batched_equals_alone(tmp_path):
    """QuantizedLinear layers: the adapter's in-size is the unpacked one; a mixed batch equals
    each row alone with its own adapter, and the adapter changes the output."""
    import mlx.nn as nn

    model, cfg = tiny_model("llama")
    nn.quantize(model, group_size=32, bits=8)
    q = dict(model.named_modules())["model.layers.0.self_attn.q_proj"]
    assert isinstance(q, nn.QuantizedLinear) and lora.linear_dims(q) == (64, 64)
    path = write_adapter(tmp_path / "q", model, rank=4, scale=2.0, num_layers=-1, keys=None,
                         seed=9)
    lora.load(model, [("q", str(path))])
    lm = loaded(model, cfg)
    reqs = _requests(cfg["vocab_size"], ["q", None, "q", None, "q", None], seed=8)
    mixed = _mixed_run(lm, reqs)
    eng = make_engine(lm, prefill_chunk=32, prefill_budget=256)
    try:
        for r, name in reqs:
            alone = run_alone(eng, Request(r.req_id + "-alone", r.prompt_ids, r.params,
                                           adapter=name)).tokens
            assert mixed[r.req_id] == alone, r.req_id
            if name is not None:
                base = run_alone(eng, Request(r.req_id + "-base", r.prompt_ids, r.params)).tokens
                assert base != alone, r.req_id
    finally:
        eng.stop()


def test_a_finished_adapter_answer_is_cached_under_its_adapter(tmp_path):
    """A finished row inserts its answer too (the next turn hits through it): an adapter row's
    answer goes under the adapter's key, so the base model never reuses that KV, and the same
    adapter's next turn does."""
    model, cfg = tiny_model("llama")
    path = write_adapter(tmp_path / "a", model, rank=4, scale=2.0, num_layers=-1, keys=None, seed=4)
    lm = loaded(model, cfg)
    lora.load(model, [("a", str(path))])
    rng = random.Random(1)
    prompt = [rng.randrange(3, cfg["vocab_size"]) for _ in range(20)]
    eng = _engine_blocks_of_16(lm)
    try:
        turn1 = greedy("t1", prompt, 30)
        turn1.adapter = "a"
        answer = run_alone(eng, turn1).tokens
        history = prompt + answer + [7]
        base = run_alone(eng, greedy("base", history, 2))
        turn2 = greedy("t2", history, 2)
        turn2.adapter = "a"
        hit = run_alone(eng, turn2)
    finally:
        eng.stop()
    assert base.events[-1].num_cached_tokens == 0  # nothing of the adapter's KV
    assert hit.events[-1].num_cached_tokens >= (len(prompt) + len(answer) - 1) // 16 * 16 > 16
