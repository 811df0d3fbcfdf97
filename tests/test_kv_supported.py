"""Quantized KV on a device without quantized attention (MLX-CUDA 0.32.4) fails once, at
start-up, with a clear message — not on every request's first prefill."""

from __future__ import annotations

import pytest

from engine.kv import batch as kvb
from engine.kv.attention import QuantizedLayout, QuantizedRotatingLayout
from engine.runner import Runner
from tests.tiny_models import tiny_model


class _Counting:
    """The tiny model counting its forwards; with `no_quantized_attention`, attending over
    quantized KV with more than one query raises as MLX-CUDA does."""

    def __init__(self, model, no_quantized_attention: bool = False):
        self.model, self.calls, self.fail = model, 0, no_quantized_attention

    def __call__(self, tokens, cache=None):
        self.calls += 1
        quantized = any(isinstance(c, (QuantizedLayout, QuantizedRotatingLayout)) for c in cache or [])
        if self.fail and tokens.shape[1] > 1 and quantized:
            raise RuntimeError("[quantized_matmul] No implementation for problem shape: 32x32x16x2")
        return self.model(tokens, cache=cache)

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_quantized_kv_that_cannot_run_is_one_clear_start_up_error():
    model, _ = tiny_model("llama", head_dim=32, hidden_size=128)
    broken = _Counting(model, no_quantized_attention=True)
    with pytest.raises(kvb.UnsupportedKV, match=r"--kv-bits 8 .*No implementation.*--kv-bits 16"):
        Runner(broken, kvb.KVConfig(kv_bits=8, kv_group_size=32))
    calls = broken.calls
    Runner(broken, kvb.KVConfig(kv_bits=16))  # 16 bits: no probe at all
    assert broken.calls == calls


def test_quantized_kv_that_runs_passes_the_check():
    model, _ = tiny_model("llama", head_dim=32, hidden_size=128)
    counting = _Counting(model)
    Runner(counting, kvb.KVConfig(kv_bits=4, kv_group_size=32))
    assert counting.calls == 3  # a 32-token prefill, a 5-column verify, a decode step


def test_cli_prints_the_error_and_exits_2(monkeypatch, capsys):
    import mlxd.runtime
    from mlxd import cli

    def fail(args):
        raise kvb.UnsupportedKV("--kv-bits 8 (group size 64) cannot run on Device(gpu, 0)")

    monkeypatch.setattr(mlxd.runtime, "build_client", fail)
    args = cli.parse_serve_args(["--port", "0", "--log-level", "WARNING"])
    assert cli.serve(args) == 2
    assert "mlxd: error: --kv-bits 8" in capsys.readouterr().err
