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
            assert q["block_tune"] == {"steps": 8, "lr": 3e-3, "target": "own"}
            assert len(log) == 6 and all(s["err_after"] <= s["err_before"] for _, _, s in log)  # 3 groups with float layers left x 2 blocks
            tr.save_model(model, {**TINY, "quantization": q}, tmp_path / "q", tiny_dir)
            loaded, _ = tr.load_model(tmp_path / "q")
            np.testing.assert_array_equal(np.array(loaded(x)), np.array(model(x)))
    assert errs["bt"] < errs["seq"], errs  # on the calibration text itself
    with pytest.raises(ValueError):
        tr.quantize_model(tiny_model(), 2, 8, block_tune=BlockTune())


# ---- target="float": tune each block towards the float model's hidden state after it ----


def _float_block_outputs(model: nn.Module, win: mx.array, batch: int) -> list[list[mx.array]]:
    """outs[i][j]: the output of model.model.layers[i] on batch j of ``win`` (an unmodified forward)."""
    layers = model.model.layers
    outs: list[list[mx.array]] = [[] for _ in layers]
    originals = list(layers)

    class Hook(nn.Module):
        def __init__(self, inner: nn.Module, i: int) -> None:
            super().__init__()
            object.__setattr__(self, "inner", inner)
            object.__setattr__(self, "i", i)

        def __getattr__(self, name):  # the model reads e.g. layer.use_sliding
            return getattr(object.__getattribute__(self, "inner"), name)

        def __call__(self, *args, **kwargs):
            y = self.inner(*args, **kwargs)
            outs[self.i].append(y)
            return y

    model.model.layers = [Hook(layer, i) for i, layer in enumerate(originals)]
    try:
        for lo in range(0, win.shape[0], batch):
            mx.eval(model(win[lo : lo + batch]))
    finally:
        model.model.layers = originals
    return outs


def _record_tune_targets(monkeypatch) -> list:
    """Records (block, calls, targets) of every tune_block call of quantize_sequential."""
    from kernels.trellis import sequential

    seen: list = []
    real = sequential.tune_block

    def spy(block_module, block, float_paths, quantized_paths, calls, targets, cfg, seed=0):
        seen.append((block, [args[0] for args, _ in calls], list(targets)))  # copies: the float list moves on
        return real(block_module, block, float_paths, quantized_paths, calls, targets, cfg, seed=seed)

    monkeypatch.setattr(sequential, "tune_block", spy)
    return seen


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text"])
def test_float_target_is_the_float_models_hidden_state_after_the_block(monkeypatch, arch):
    from tests.tiny_models import VOCAB
    from tests.tiny_models import tiny_model as arch_model

    # tiny_models' llama alternates sliding and full attention: each block's own mask is used
    model, _ = arch_model(arch)
    ref, _ = arch_model(arch)
    win = mx.random.randint(0, VOCAB, (4, 32), key=mx.random.key(1))
    want = _float_block_outputs(ref, win, batch=2)
    seen = _record_tune_targets(monkeypatch)
    tr.quantize_model(model, 2, 8, calibration=win, calibration_batch=2, block_tune=BlockTune(steps=2, lr=1e-3, target="float"))
    n = len(ref.model.layers)
    first = {}
    for block, inputs, targets in seen:
        first.setdefault(block, (inputs, targets))  # the first stage of each block (later ones: the same list)
    assert sorted(first) == [f"model.layers.{i}" for i in range(n)]
    for i in range(n):
        inputs, targets = first[f"model.layers.{i}"]
        assert len(targets) == 2
        for j in range(2):
            np.testing.assert_allclose(np.array(targets[j]), np.array(want[i][j]), rtol=1e-4, atol=1e-4)
        if i > 0:  # the inputs stay the quantized prefix's: not the float hidden states
            err = float(mx.sum(mx.square(inputs[0] - want[i - 1][0])) / mx.sum(mx.square(want[i - 1][0])))
            assert err > 1e-3, (i, err)
    for block, _, targets in seen:  # every stage of a block sees the same (float) targets
        for t, u in zip(targets, first[block][1], strict=True):
            assert t is u


def test_quantize_model_with_float_target_lowers_the_block_errors():
    win = windows(8, 32)
    x = win[:2]
    want = tiny_model()(x)
    errs = {}
    log: list = []
    for name, bt in (("seq", None), ("float", BlockTune(steps=8, lr=3e-3, target="float"))):
        model = tiny_model()
        q = tr.quantize_model(model, 2, 8, calibration=win, calibration_batch=2, block_tune=bt, on_tune=lambda b, g, s: log.append((b, g, s)))
        errs[name] = float(mx.mean(mx.square(model(x) - want)))
        if bt is not None:
            assert q["block_tune"]["steps"] == 8
    assert len(log) == 6 and all(s["err_after"] < s["err_before"] for _, _, s in log), log
    assert errs["float"] < errs["seq"], errs  # on the calibration text itself


def test_float_target_refuses_what_is_not_a_simple_chain():
    with pytest.raises(ValueError, match="target"):
        BlockTune(target="teacher")
    win = windows(4, 16)
    # blocks 0 and 2 only: block 1 (left float) would be missing from the carried hidden states
    model = tiny_model()
    model.model.layers.append(tiny_model(seed=1).model.layers[0])
    with pytest.raises(ValueError, match="simple chain"):
        tr.quantize_model(model, 2, 8, only=lambda p: ".1." not in p, calibration=win, calibration_batch=2,
                          block_tune=BlockTune(steps=1, target="float"))

    class Scaled(nn.Module):  # something between the blocks: block 1's input is not block 0's output
        def __init__(self) -> None:
            super().__init__()
            self.inner = tiny_model().model

        def __call__(self, tokens: mx.array) -> mx.array:
            h = self.inner.embed_tokens(tokens)
            for layer in self.inner.layers:
                h = 0.5 * layer(h, "causal")
            return h

    with pytest.raises(RuntimeError, match="not a simple chain"):
        tr.quantize_model(Scaled(), 2, 8, calibration=win, calibration_batch=2, block_tune=BlockTune(steps=1, target="float"))
    tr.quantize_model(Scaled(), 2, 8, calibration=win, calibration_batch=2, block_tune=BlockTune(steps=1))  # "own" needs no chain
    # "auto" warns and falls back to "own" where "float" raises, and records what it used
    with pytest.warns(UserWarning, match="falls back to target='own'"):
        q = tr.quantize_model(Scaled(), 2, 8, calibration=win, calibration_batch=2,
                              block_tune=BlockTune(steps=1, target="auto"))
    assert q["block_tune"]["target"] == "float+own"  # block 0 tuned towards float, then own
    model = tiny_model()
    model.model.layers.append(tiny_model(seed=1).model.layers[0])
    with pytest.warns(UserWarning, match="simple chain"):
        q = tr.quantize_model(model, 2, 8, only=lambda p: ".1." not in p, calibration=win, calibration_batch=2,
                              block_tune=BlockTune(steps=1, target="auto"))
    assert q["block_tune"]["target"] == "own"
    q = tr.quantize_model(tiny_model(), 2, 8, calibration=win, calibration_batch=2,
                          block_tune=BlockTune(steps=1, target="auto"))
    assert q["block_tune"]["target"] == "float"


def test_cli_block_tune_target_reaches_block_tune(tmp_path, monkeypatch, tiny_dir):  # noqa: F811
    import json

    import kernels.trellis
    from mlxd.quantize import main

    seen: list = []
    real = kernels.trellis.quantize_model

    def spy(*args, **kwargs):
        seen.append(kwargs.get("block_tune"))
        return real(*args, **kwargs)

    monkeypatch.setattr(kernels.trellis, "quantize_model", spy)
    calib = tmp_path / "calib.jsonl"
    calib.write_text("\n".join(json.dumps({"text": f"def f{i}(x):\n    return x + {i}\n" * 8}) for i in range(6)) + "\n")
    argv = [str(tiny_dir), str(tmp_path / "q"), "--bits", "2", "--no-progress", "--calibration", str(calib)]

    def recipe(**block_tune) -> list[str]:
        path = tmp_path / "recipe.json"
        path.write_text(json.dumps({"L": 8, "calibration": {"windows": 2, "length": 64}, "finetune": {"steps": 0},
                                    "block_tune": {"steps": 2, **block_tune}}))
        return ["--recipe", str(path)]

    assert main([*argv, *recipe(target="float")]) == 0
    assert seen[-1] == BlockTune(steps=2, lr=1e-3, target="float")
    q = json.loads((tmp_path / "q" / "config.json").read_text())["quantization"]
    assert q["block_tune"] == {"steps": 2, "lr": 1e-3, "target": "float"}
    assert main([*argv, *recipe(target="own")]) == 0
    assert seen[-1].target == "own"
    q = json.loads((tmp_path / "q" / "config.json").read_text())["quantization"]
    assert q["block_tune"] == {"steps": 2, "lr": 1e-3, "target": "own"}
    assert main([*argv, *recipe()]) == 0  # default: "auto", which takes "float" on a simple chain of blocks
    assert seen[-1].target == "auto"
    q = json.loads((tmp_path / "q" / "config.json").read_text())["quantization"]
    assert q["block_tune"] == {"steps": 2, "lr": 1e-3, "target": "float"}
