"""Sequential BlockLDLQ, fine-tuning after quantization, and the calibration/eval split."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load_model as mlx_lm_load_model

from kernels import trellis as tr
from kernels.trellis.calibration import collect_hessians, disjoint_records
from kernels.trellis.finetune import finetune, model_kl, teacher_logprobs
from kernels.trellis.linear import quantizable_linears
from kernels.trellis.sequential import (
    block_path,
    capture_block_inputs,
    input_groups,
    quantize_sequential,
)
from tests.test_trellis_model import TINY, tiny_dir, tiny_model  # noqa: F401  (tiny_dir is a fixture)


def windows(n: int = 4, length: int = 32, seed: int = 0) -> mx.array:
    return mx.random.randint(0, TINY["vocab_size"], (n, length), key=mx.random.key(seed))


def test_block_path():
    assert block_path("model.layers.3.mlp.up_proj") == "model.layers.3"
    assert block_path("model.layers.10.self_attn.q_proj") == "model.layers.10"
    assert block_path("lm_head") is None
    assert block_path("model.layers.3") is None  # a block itself has no enclosing block


def test_input_groups_follow_shared_inputs_in_call_order():
    model = tiny_model()
    targets = [p for p, _ in quantizable_linears(model, tr.TrellisSpec(bits=2, L=8))]
    block = "model.layers.0"
    paths = [p for p in targets if p.startswith(block + ".")]
    calls = capture_block_inputs(model, block, windows(), batch=2)
    assert len(calls) == 2 and calls[0][0][0].shape == (2, 32, TINY["hidden_size"])
    groups = input_groups(model, block, paths, calls)
    pre = block + "."
    assert [sorted(g) for g in groups] == [
        sorted(pre + s for s in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        [pre + "self_attn.o_proj"],
        sorted(pre + s for s in ("mlp.gate_proj", "mlp.up_proj")),
        [pre + "mlp.down_proj"],
    ]


def test_sequential_hessians_come_from_the_quantized_earlier_layers():
    model, float_model = tiny_model(), tiny_model()
    spec = tr.TrellisSpec(bits=2, L=8)
    targets = quantizable_linears(model, spec)
    win = windows()
    seen: dict[str, mx.array] = {}

    def quantize_one(path, linear, hessian):
        return tr.TrellisLinear.from_linear(linear, spec, hessian=hessian)

    swapped = quantize_sequential(model, targets, win, quantize_one, batch=2, on_hessians=seen.__setitem__)
    assert [p for p, _ in swapped] == [p for p, _ in swapped if p in seen] and len(seen) == len(targets) == 14
    assert all(isinstance(m, tr.TrellisLinear) for _, m in swapped)
    paths = sorted(seen)
    # In the finished model every layer's input depends only on layers quantized before it, so its
    # Hessian there is the one it was quantized with ...
    final = collect_hessians(model, win, paths)
    float_h = collect_hessians(float_model, win, paths)
    for p in paths:
        np.testing.assert_allclose(np.array(seen[p]), np.array(final[p]), rtol=2e-3, atol=1e-5 * float(mx.max(mx.abs(final[p]))))
    # ... and not the float model's, except for the very first layers (they see the embeddings).
    first = {p for p in paths if p.startswith("model.layers.0.self_attn.") and not p.endswith("o_proj")}
    for p in paths:
        rel = float(mx.linalg.norm(seen[p] - float_h[p]) / mx.linalg.norm(float_h[p]))
        assert (rel < 1e-5) if p in first else (rel > 1e-3), (p, rel)


def test_quantize_model_with_calibration_is_sequential_and_close():
    model, float_model = tiny_model(), tiny_model()
    q = tr.quantize_model(model, 3, 8, calibration=windows(16))
    assert q["ldlq"] is True and q["sequential"] is True and q["num_layers"] == 14
    x = windows(4, 32, seed=3)
    a, b = model(x), float_model(x)
    assert float(mx.mean(mx.square(a - b)) / mx.mean(mx.square(b))) < 0.15  # plain: 0.09 (random model)
    with pytest.raises(ValueError):
        tr.quantize_model(tiny_model(), 3, 8, calibration=windows(), hessians={})


def test_finetune_lowers_kl_and_keeps_the_format(tmp_path, tiny_dir):  # noqa: F811
    model, config = mlx_lm_load_model(tiny_dir)
    teacher, _ = mlx_lm_load_model(tiny_dir)
    config["quantization"] = tr.quantize_model(model, 2, 8)
    win = windows(8, 32)
    lp = teacher_logprobs(teacher, win)
    codes = {p: m.packed for p, m in tr.trellis_layers(model)}
    norm_before = np.array(model.model.norm.weight)
    before = model_kl(model, lp, win)
    result = finetune(model, lp, win, steps=12, batch=4, lr=3e-3)
    after = model_kl(model, lp, win)
    assert after < 0.9 * before, (before, after)
    assert result.loss_last < result.loss_first and result.trainable > 0
    layers = dict(tr.trellis_layers(model))
    assert set(layers) == set(codes)
    for p, m in layers.items():
        assert m.packed is codes[p]  # the codes are not touched
        assert m.scales.dtype == mx.float16 and m.signs.dtype == mx.float16
    assert not np.array_equal(np.array(model.model.norm.weight), norm_before)  # norms are trained
    # embeddings and the unquantized lm_head are frozen
    np.testing.assert_array_equal(np.array(model.lm_head.weight), np.array(teacher.lm_head.weight))
    np.testing.assert_array_equal(np.array(model.model.embed_tokens.weight), np.array(teacher.model.embed_tokens.weight))
    # real-valued signs round-trip through the model directory
    tr.save_model(model, config, tmp_path / "q", tiny_dir)
    loaded, _ = tr.load_model(tmp_path / "q")
    x = windows(1, 12, seed=7)
    np.testing.assert_array_equal(np.array(loaded(x)), np.array(model(x)))


def test_finetune_without_signs_keeps_int8_signs():
    model, teacher = tiny_model(), tiny_model()
    tr.quantize_model(model, 3, 8)
    win = windows(4, 16)
    finetune(model, teacher, win, steps=2, batch=2, train_signs=False, train_norms=False)
    for _, m in tr.trellis_layers(model):
        assert m.signs.dtype == mx.int8 and m.scales.dtype == mx.float16


def test_disjoint_records_drops_shared_text():
    held = [{"text": "x" * 10 + "the shared licence header of this file, long enough to count " * 3}]
    recs = [
        {"text": "def f():\n    return 1\n" * 10},
        {"text": "other " + "the shared licence header of this file, long enough to count " * 3},
        dict(held[0]),
    ]
    assert disjoint_records(recs, held) == recs[:1]


def _quantize_cli(tmp_path, tiny_dir, line, steps: int, finetune_windows: int, block_tune: dict | None = None):  # noqa: F811
    """`mlxd quantize` at 2 bits, L = 8, on six records of `line(i)`; returns the output dir."""
    from mlxd.quantize import main

    calib = tmp_path / "calib.jsonl"
    calib.write_text("\n".join(json.dumps({"text": line(i) * 8}) for i in range(6)) + "\n")
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(
        f"L = 8\n[calibration]\nwindows = 2\nlength = 64\n"
        f"[finetune]\nsteps = {steps}\nwindows = {finetune_windows}\nlength = 32\nbatch = 2\n"
        + ("[block_tune]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in block_tune.items()) if block_tune else "")
    )
    dst = tmp_path / "cli"
    argv = [str(tiny_dir), str(dst), "--bits", "2", "--no-progress", "--calibration", str(calib), "--recipe", str(recipe)]
    assert main(argv) == 0
    return dst


def test_cli_sequential_and_finetune(tmp_path, tiny_dir):  # noqa: F811
    dst = _quantize_cli(tmp_path, tiny_dir, lambda i: f"def f{i}(x):\n    return x * {i} + {i * i}\n", 3, 4)
    q = json.loads((dst / "config.json").read_text())["quantization"]
    assert q["sequential"] is True and q["ldlq"] is True and q["finetune"]["steps"] == 3
    # in-block tuning is on by default, towards the float model's hidden states ("auto": the tiny
    # llama's blocks form a simple chain)
    assert q["block_tune"] == {"steps": 16, "lr": 1e-3, "target": "float"}
    model, _ = tr.load_model(dst)
    layer = model.model.layers[1].mlp.down_proj
    assert isinstance(layer, tr.TrellisLinear) and layer.signs.dtype == mx.float16
    assert model.model.norm.weight.dtype == mx.float32  # the stored dtype of the source (tiny: float32)


def test_finetune_teacher_model_per_batch_matches_precomputed_logprobs():
    win = windows(6, 16)
    teacher = tiny_model()
    runs = []
    for target in (teacher, teacher_logprobs(teacher, win), teacher_logprobs(teacher, win, dtype=mx.float16)):
        model = tiny_model()
        tr.quantize_model(model, 2, 8)
        losses: list[float] = []
        finetune(model, target, win, steps=3, batch=2, lr=3e-3, progress=lambda _i, loss, out=losses: out.append(loss))
        runs.append(losses)
    np.testing.assert_allclose(runs[0], runs[1], rtol=1e-4)
    np.testing.assert_allclose(runs[0], runs[2], rtol=1e-2)  # float16 log-probs: close, not equal


def test_teacher_for_precomputes_only_what_fits_and_is_reused():
    from kernels.trellis.finetune import teacher_for

    teacher, win = tiny_model(), windows(4, 16)
    lp = teacher_for(teacher, win, steps=3, batch=2)  # 6 visits of 4 windows: precomputed
    assert isinstance(lp, mx.array) and lp.dtype == mx.float16 and lp.shape == (4, 16, TINY["vocab_size"])
    assert teacher_for(teacher, win, steps=2, batch=2) is teacher  # each window seen once at most
    assert teacher_for(teacher, win, steps=3, batch=2, budget_bytes=1000) is teacher  # too big


def test_finetune_holdout_kl_is_logged():
    model, teacher = tiny_model(), tiny_model()
    tr.quantize_model(model, 2, 8)
    win, held = windows(4, 16), windows(2, 16, seed=5)
    before = model_kl(model, teacher, held)
    result = finetune(model, teacher, win, steps=5, batch=2, lr=3e-3, holdout=(held, teacher), holdout_every=2)
    assert [s for s, _ in result.holdout_kl] == [0, 2, 4, 5]
    assert result.holdout_kl[0][1] == pytest.approx(before, rel=1e-5)
    assert result.holdout_kl[-1][1] == pytest.approx(model_kl(model, teacher, held), rel=1e-3)  # folded: float16


def test_cli_finetune_with_a_teacher_copy(tmp_path, tiny_dir):  # noqa: F811
    # 2 steps x batch 2 = 4 visits of 8 windows: the float copy runs per batch
    dst = _quantize_cli(tmp_path, tiny_dir, lambda i: f"def g{i}(y):\n    return y - {i}\n", 2, 8, {"steps": 0})
    q = json.loads((dst / "config.json").read_text())["quantization"]
    assert q["finetune"]["windows"] == 8 and q["finetune"]["kl_last"] > 0 and "block_tune" not in q
    model, _ = tr.load_model(dst)
    assert model.model.layers[0].self_attn.q_proj.signs.dtype == mx.float16
