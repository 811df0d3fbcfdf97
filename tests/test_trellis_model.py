"""TrellisLinear in mlx-lm models: quantize, save, load through the hook, generate; the CLI logic."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import llama
from mlx_lm.utils import load_model as mlx_lm_load_model
from mlx_lm.utils import load_tokenizer
from mlx_lm.utils import save_model as mlx_lm_save_model

from kernels import trellis as tr
from kernels.trellis import matvec
from kernels.trellis.calibration import even_windows, read_records, token_stream
from tests.trellis_dirs import quick_quantized_dir

TINY = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "rms_norm_eps": 1e-5,
    "vocab_size": 8192,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


def tiny_model(seed: int = 0) -> nn.Module:
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(TINY))
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tinycoder_path) -> Path:
    """A float tiny-Llama model dir with tinycoder's tokenizer."""
    d = tmp_path_factory.mktemp("tiny-float")
    mlx_lm_save_model(d, tiny_model())
    (d / "config.json").write_text(json.dumps(TINY))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(tinycoder_path / f, d / f)
    return d


def test_trellis_linear_matches_its_dense_weight():
    lin = nn.Linear(96, 40, bias=True)
    layer = tr.TrellisLinear.from_linear(lin, tr.TrellisSpec(bits=3, L=10))
    x = mx.random.normal((2, 5, 96))
    y = layer(x)
    expect = x @ layer.dense_weight().T + lin.bias
    assert y.shape == (2, 5, 40) and y.dtype == mx.float32
    np.testing.assert_allclose(np.array(y), np.array(expect), rtol=1e-4, atol=1e-4)
    # and it approximates the original layer (3 bits: relative error ~ sqrt(0.02))
    err = mx.mean(mx.square(y - lin(x))) / mx.mean(mx.square(lin(x) - lin.bias))
    assert float(err) < 0.05
    assert layer(x.astype(mx.bfloat16)).dtype == mx.bfloat16


def test_quantize_model_swaps_linears_and_skips_lm_head():
    model = tiny_model()
    x = mx.array([[1, 2, 3, 4, 5, 6]])
    before = model(x)
    q = tr.quantize_model(model, 4, 8)
    layers = dict(tr.trellis_layers(model))
    assert len(layers) == 2 * 7 and "lm_head" not in layers
    assert type(model.lm_head) is nn.Linear
    assert q["method"] == "trellis" and q["bits"] == 4 and q["L"] == 8 and q["num_layers"] == 14
    assert 4.0 < tr.bits_per_weight(model) < 4.5  # codes + fp16 row scales + int8 signs
    after = model(x)
    rel = float(mx.mean(mx.square(after - before)) / mx.mean(mx.square(before)))
    assert rel < 0.05


def test_save_then_load_hook_gives_identical_logits(tmp_path, tiny_dir):
    model, config = mlx_lm_load_model(tiny_dir)
    config["quantization"] = tr.quantize_model(model, 3, 8)
    tr.save_model(model, config, tmp_path / "q", tiny_dir)
    saved = json.loads((tmp_path / "q" / "config.json").read_text())
    assert saved["quantization"]["method"] == "trellis" and "quantization_config" not in saved
    assert (tmp_path / "q" / "tokenizer.json").exists()

    # a loader that builds the model itself, then calls the hook
    fresh = llama.Model(llama.ModelArgs.from_dict(saved))
    loaded = tr.load_hook(fresh, saved, tmp_path / "q")
    x = mx.array([[5, 6, 7, 8]])
    np.testing.assert_array_equal(np.array(loaded(x)), np.array(model(x)))
    # and the convenience loader through mlx-lm's model classes
    loaded2, cfg2 = tr.load_model(tmp_path / "q")
    assert tr.is_trellis_config(cfg2)
    np.testing.assert_array_equal(np.array(loaded2(x)), np.array(model(x)))


def test_load_hook_rejects_plain_config(tmp_path, tiny_dir):
    with pytest.raises(ValueError):
        tr.load_hook(tiny_model(), dict(TINY), tiny_dir)


def test_cli_logic_writes_a_loadable_dir_with_calibration(tmp_path, tiny_dir):
    from mlxd.quantize import main

    calib = tmp_path / "calib.jsonl"
    calib.write_text(
        "\n".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i} + {i * i}\n" * 8}) for i in range(6))
        + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "add"}, {"role": "assistant", "content": "a + b"}]})
        + "\n"
    )
    dst = tmp_path / "cli"
    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps({"L": 8, "calibration": {"windows": 2, "length": 64},
                                  "finetune": {"steps": 2, "windows": 2, "length": 32}}))
    argv = [str(tiny_dir), str(dst), "--bits", "3", "--no-progress", "--recipe", str(recipe)]
    assert main(argv + ["--calibration", str(calib)]) == 0
    q = json.loads((dst / "config.json").read_text())["quantization"]
    assert q["method"] == "trellis" and q["bits"] == 3 and q["L"] == 8 and q["ldlq"] is True
    model, _ = tr.load_model(dst)
    float_model, _ = mlx_lm_load_model(tiny_dir)
    x = mx.array([[10, 20, 30, 40, 50]])
    a, b = model(x), float_model(x)
    assert float(mx.mean(mx.square(a - b)) / mx.mean(mx.square(b))) < 0.1
    packed = model.model.layers[0].mlp.down_proj.packed
    assert packed.dtype == mx.uint32 and packed.shape == (64, 128 * 3 // 32)


# ---- end to end on the bundled model ----------------------------------------------------------


@pytest.fixture(scope="module")
def quick_tinycoder_dir(tmp_path_factory, tinycoder_path) -> Path:
    d = tmp_path_factory.mktemp("tinycoder-trellis")
    quick_quantized_dir(tinycoder_path, d, bits=4, L=8, num_blocks=1)
    return d


@pytest.mark.slow
def test_quantized_tinycoder_generates_sensible_tokens(quick_tinycoder_dir, tinycoder_path, dev_data_path):
    from mlx_lm import generate

    config = json.loads((quick_tinycoder_dir / "config.json").read_text())
    assert config["quantization"]["method"] == "trellis"
    # the path a server loader takes: mlx-lm builds the model, our hook makes it trellis
    model, _ = mlx_lm_load_model(
        quick_tinycoder_dir, lazy=True, strict=False, model_config={"quantization": None, "quantization_config": None}
    )
    model = tr.load_hook(model, config, quick_tinycoder_dir)
    assert len(tr.trellis_layers(model)) == 7
    tokenizer = load_tokenizer(quick_tinycoder_dir)

    text = generate(model, tokenizer, "def fibonacci(n):", max_tokens=16, verbose=False)
    assert text.startswith("\n    ")  # a function body follows the signature

    # next-token agreement with the float model on a dev window
    float_model, _ = mlx_lm_load_model(tinycoder_path)
    tokens = even_windows(token_stream(tokenizer, read_records(dev_data_path)[:4]), 1, 257)
    inp, tgt = tokens[:, :-1], tokens[:, 1:]
    lq, lf = model(inp).astype(mx.float32), float_model(inp).astype(mx.float32)
    agree = float(mx.mean(mx.argmax(lq, -1) == mx.argmax(lf, -1)))
    nll_q = float(nn.losses.cross_entropy(lq, tgt).mean())
    nll_f = float(nn.losses.cross_entropy(lf, tgt).mean())
    assert agree > 0.85
    assert nll_q < nll_f + 0.1


@pytest.mark.gpu
def test_cuda_fused_path_matches_reference_in_the_model(quick_tinycoder_dir, monkeypatch):
    if matvec.fused_backend() != "cuda":
        pytest.skip("needs the cuda backend")
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = tr.load_model(quick_tinycoder_dir)
    model.set_dtype(mx.float32)

    def decode(steps: int) -> np.ndarray:
        cache = make_prompt_cache(model)
        out = [model(mx.array([[1, 100, 200, 300]]), cache=cache)[:, -1]]  # prefill: fallback path
        tok = mx.argmax(out[-1], axis=-1)
        for _ in range(steps):  # decode: one row -> fused kernel
            out.append(model(tok[:, None], cache=cache)[:, -1])
            tok = mx.argmax(out[-1], axis=-1)
        return np.array(mx.stack(out).astype(mx.float32))

    fused = decode(6)
    monkeypatch.setattr(tr.linear, "fused_backend", lambda: None)
    ref = decode(6)
    np.testing.assert_allclose(fused, ref, rtol=1e-3, atol=1e-3 * np.abs(ref).max())
