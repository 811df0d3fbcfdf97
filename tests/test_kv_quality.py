"""Bounded tier: 8-bit KV stays within 0.01 nats/token of full-precision KV (bundled model)."""

from __future__ import annotations

import pytest

from bench.kv_quality import load_model, load_windows, measure


@pytest.fixture(scope="module")
def tinycoder(tinycoder_path):
    return load_model(tinycoder_path, "float32")


def test_kv_quantization_kl_on_a_short_window(tinycoder, dev_data_path):
    model, tokenizer = tinycoder
    # 320 tokens in chunks of 128: the 256-token sliding layers wrap and fold chunks in
    windows = load_windows(dev_data_path, tokenizer, window=320, count=1)
    results = measure(model, windows, [(8, 64), (4, 64)], chunk=128)
    assert results["16"]["mean_kl_nats"] == 0.0
    kl8, kl4 = results["8/g64"]["mean_kl_nats"], results["4/g64"]["mean_kl_nats"]
    assert kl8 < 0.01
    assert kl8 < kl4 < 0.5
    assert results["8/g64"]["top1_agreement"] > 0.97
