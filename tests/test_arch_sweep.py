"""The architecture sweep (`python -m bench models`) on a fixed sample of mlx-lm architectures.

Every layout kind is covered: plain, sliding window, recurrent / SSM, MLA, MoE and KV-shared
layers, multimodal wrappers of a text model, and architectures refused at load. Each passes
every check (batched == alone == mlx-lm, prefix reuse, n-gram speculation, 8-bit KV or its
refusal) or, where documented as unsupported, loading raises the clear error.
"""

from __future__ import annotations

import dataclasses
import importlib

import mlx.core as mx
import pytest

from bench import models as sweep
from engine.models import UNSUPPORTED, UnsupportedArchitecture

SAMPLE = [
    "llama", "qwen2", "qwen3", "phi3", "starcoder2", "mistral3",  # plain (mistral3: a wrapper)
    "gemma3_text", "cohere2", "gpt_oss", "olmo3",  # sliding window (gpt_oss: sinks)
    "qwen3_next", "mamba2", "lfm2", "kimi_linear",  # recurrent / SSM hybrids
    "deepseek_v3", "minicpm3",  # MLA
    "qwen3_moe", "mixtral", "granitemoe",  # MoE
    "gemma4_text",  # KV-shared
]
REFUSED = ["gemma2", "falcon_h1", "llama4"]  # documented as not supported yet
KINDS = {"plain", "sliding", "recurrent", "MLA", "MoE", "KV-shared"}


@pytest.fixture(autouse=True)
def _restore_mlx_state():
    device = mx.default_device()
    yield
    mx.enable_compile()
    mx.set_default_device(device)


def test_every_derived_config_instantiates():
    """The derived tiny configs build a ModelArgs and a Model for every architecture file."""
    archs = sweep.architectures()
    assert len(archs) > 100
    for arch in archs:
        if arch in sweep.SKIPPED:
            continue
        cfg = sweep.derive_config(arch)
        assert not sweep.missing_fields(arch, cfg), arch
        module = importlib.import_module(f"mlx_lm.models.{arch}")
        args = module.ModelArgs.from_dict(cfg)
        module.Model(args)


def test_rules_shrink_dimensions_and_keep_constraints():
    cfg = sweep.derive_config("qwen3_moe")
    assert cfg["hidden_size"] == sweep.HIDDEN and cfg["vocab_size"] == sweep.VOCAB
    assert cfg["num_attention_heads"] % cfg["num_key_value_heads"] == 0
    assert cfg["num_experts_per_tok"] <= cfg["num_experts"]
    wrapped = sweep.derive_config("gemma3")
    assert wrapped["text_config"]["sliding_window"] == sweep.WINDOW
    # a per-layer list keeps every kind of entry when cut to the tiny layer count
    assert sweep._shrink_list(["a", "a", "a", "b"] * 8, 3) == ["a", "a", "b"]


@pytest.mark.slow
def test_sample_covers_every_layout_kind_and_passes():
    seen: set[str] = set()
    for arch in SAMPLE:
        res = sweep.run_one(arch)
        bad = {k: c.reason for k, c in res.checks.items() if c.ok is not True}
        assert res.status == "ok" and not bad, (arch, res.status, bad)
        assert set(res.checks) == set(sweep.CHECKS), arch
        seen.update(res.traits)
    assert KINDS <= seen, KINDS - seen


@pytest.mark.parametrize("arch", REFUSED)
def test_unsupported_architectures_are_a_clear_error_at_load(arch):
    from engine.core import Engine, EngineConfig
    from engine.scheduler import SchedulerConfig

    model, cfg = sweep.build_model(arch)
    harness = sweep._Harness(model, cfg)
    with pytest.raises(UnsupportedArchitecture, match=f"architecture {arch} is not supported: "):
        Engine(harness.lm, EngineConfig(SchedulerConfig()))
    res = sweep.run_one(arch, checks=("load",))
    assert res.status == "unsupported" and res.checks["load"].reason.startswith("architecture")


@pytest.mark.parametrize("arch", ["jamba", "rwkv7"])
def test_speculation_is_refused_at_start_where_rollback_cannot_work(arch):
    """Recurrent mixers the stepping wrapper cannot take (jamba's `(x, cache)`, rwkv7's
    `v_first`): an engine with speculation on refuses to start, with the reason; one without
    serves, as does one with the default's predictions-only drafting (without it); and the sweep's n-gram check reports the refusal as the expected outcome."""
    from engine.core import Engine, EngineConfig
    from engine.models import prepare_model, speculation_blocker
    from engine.scheduler import SchedulerConfig
    from engine.spec import SpecConfig

    model, cfg = sweep.build_model(arch)
    prepare_model(model)
    assert speculation_blocker(model)
    harness = sweep._Harness(model, cfg)
    with pytest.raises(ValueError, match=f"not supported for architecture {arch}.*without --spec"):
        Engine(harness.lm, EngineConfig(SchedulerConfig(), spec=SpecConfig("ngram")))
    Engine(harness.lm, EngineConfig(SchedulerConfig())).stop()
    eng = Engine(harness.lm, EngineConfig(SchedulerConfig(), spec=SpecConfig("prediction")))
    assert eng.stats().spec is None  # the default's predictions-only drafting goes without
    eng.stop()
    res = sweep.run_one(arch, checks=("load", "ngram"))
    assert res.checks["ngram"].ok is True
    assert res.checks["ngram"].reason.startswith("refused: speculative decoding is not supported")


def test_stepping_recurrent_mixers_can_speculate():
    from engine.models import prepare_model, speculation_blocker

    for arch in ("qwen3_next", "mamba2", "llama"):
        model, _ = sweep.build_model(arch)
        prepare_model(model)
        assert speculation_blocker(model) is None, arch


def test_a_registered_unsupported_architecture_names_its_reason():
    assert "gemma2" in UNSUPPORTED
    model, _ = sweep.build_model("gemma2")
    from engine.models import prepare_model

    with pytest.raises(UnsupportedArchitecture, match=UNSUPPORTED["gemma2"][:30]):
        prepare_model(model)


def test_a_crash_in_one_architecture_fails_only_that_one(monkeypatch):
    """The sweep isolates each architecture: a child that dies is reported, the rest run."""
    import os

    real = sweep.run_one

    def dying(arch, checks=sweep.CHECKS):
        if arch == "qwen2":
            os._exit(3)
        return real(arch, checks)

    monkeypatch.setattr(sweep, "run_one", dying)
    got = sweep.sweep(["qwen2", "llama"], checks=("load",), jobs=1, timeout=120)
    assert got[0].status == "fail" and "exit code 3" in got[0].checks["load"].reason
    assert got[1].status == "ok"
    assert dataclasses.asdict(got[1].checks["load"])["ok"] is True
