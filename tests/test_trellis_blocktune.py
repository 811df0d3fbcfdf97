"""In-block tuning during sequential quantization (kernels/trellis/blocktune.py)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from kernels import trellis as tr
from kernels.trellis.blocktune import BlockTune, DeltaLinear, block_targets, tune_block
from kernels.trellis.linear import quantizable_linears
from kernels.trellis.sequential import capture_block_inputs
from tests.test_trellis_model import TINY, tiny_dir, tiny_model  # noqa: F401  (tiny_dir is a fixture)


def windows(n: int = 4, length: int = 32, seed: int = 0) -> mx.array:
    return mx.random.randint(0, TINY["vocab_size"], (n, length), key=mx.random.key(seed))


def test_delta_linear_starts_as_the_linear_and_folds_into_the_same_object():
    lin = nn.Linear(16, 8, bias=True)
    d = DeltaLinear(lin)
    x = mx.random.normal((3, 16))
    np.testing.assert_allclose(np.array(d(x)), np.array(lin(x)), rtol=1e-6, atol=1e-6)
    assert set(k for k, _ in nn.utils.tree_flatten(d.trainable_parameters())) == {"delta"}
    d.delta = mx.ones_like(d.delta)
    y = d(x)
    back = d.folded()
    assert back is lin
    np.testing.assert_allclose(np.array(lin(x)), np.array(y), rtol=1e-5, atol=1e-5)


def test_tune_block_lowers_the_block_error_and_keeps_codes():
    model = tiny_model()
    ref = tiny_model()
    block = "model.layers.0"
    win = windows(4, 32)
    calls = capture_block_inputs(model, block, win, batch=2)
    module = dict(model.named_modules())[block]
    targets = block_targets(module, calls)
    spec = tr.TrellisSpec(bits=2, L=8)
    pre = block + "."
    paths = [p for p, _ in quantizable_linears(model, spec) if p.startswith(pre)]
    qkv = [pre + "self_attn." + s for s in ("q_proj", "k_proj", "v_proj")]
    mods = dict(model.named_modules())
    swaps = [(p[len(pre) :], tr.TrellisLinear.from_linear(mods[p], spec)) for p in qkv]
    module.update_modules(nn.utils.tree_unflatten(swaps))
    packed = {p: m.packed for p, m in swaps}
    rest = [p for p in paths if p not in qkv]
    o_before = np.array(mods[pre + "self_attn.o_proj"].weight)
    stats = tune_block(module, block, rest, qkv, calls, targets, BlockTune(steps=10, lr=3e-3))
    assert stats["err_after"] < 0.7 * stats["err_before"], stats
    assert stats["trainable"] > 0
    mods = dict(model.named_modules())
    for p, m in swaps:
        assert mods[pre + p] is m and m.packed is packed[p]  # codes untouched, same modules back
        assert m.scales.dtype == mx.float16 and m.signs.dtype == mx.float16
    o = mods[pre + "self_attn.o_proj"]
    assert type(o) is nn.Linear and not np.array_equal(np.array(o.weight), o_before)  # float layers tuned
    # other blocks, embeddings and lm_head untouched; nothing left trainable-frozen
    np.testing.assert_array_equal(np.array(model.model.layers[1].mlp.up_proj.weight), np.array(ref.model.layers[1].mlp.up_proj.weight))
    np.testing.assert_array_equal(np.array(model.lm_head.weight), np.array(ref.lm_head.weight))
    assert len(nn.utils.tree_flatten(model.trainable_parameters())) == len(nn.utils.tree_flatten(model.parameters()))


def test_quantize_model_with_block_tune_beats_plain_sequential(tmp_path, tiny_dir):  # noqa: F811
    win = windows(8, 32)
    float_model = tiny_model()
    x = win[:2]
    want = float_model(x)
    errs = {}
    log: list = []
    for name, bt in (("seq", None), ("bt", BlockTune(steps=8, lr=3e-3))):
        model = tiny_model()
        q = tr.quantize_model(model, 2, 8, calibration=win, calibration_batch=2, block_tune=bt, on_tune=lambda b, g, s: log.append((b, g, s)))
        errs[name] = float(mx.mean(mx.square(model(x) - want)))
        if bt is not None:
            assert q["block_tune"] == {"steps": 8, "lr": 3e-3}
            assert len(log) == 6 and all(s["err_after"] <= s["err_before"] for _, _, s in log)  # 3 groups with float layers left x 2 blocks
            tr.save_model(model, {**TINY, "quantization": q}, tmp_path / "q", tiny_dir)
            loaded, _ = tr.load_model(tmp_path / "q")
            np.testing.assert_array_equal(np.array(loaded(x)), np.array(model(x)))
    assert errs["bt"] < errs["seq"], errs  # on the calibration text itself
    with pytest.raises(ValueError):
        tr.quantize_model(tiny_model(), 2, 8, block_tune=BlockTune())
