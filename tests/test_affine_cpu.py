"""The CPU's few-row affine quantized matmul (kernels/affine/cpu.py): against MLX's
`quantized_matmul` for every bits, group and row count it takes (bounded: it sums in another
order), a row alone equal to the same row in a batch and any thread split equal to one thread
(exact), the calls it refuses, MLX's op inside a transformation, and the layer's routing on the
CPU with it; the engine's exact tier (batched = alone, speculative = plain greedy) through it."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from kernels.affine import cpu, linear

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C++ compiler for the CPU kernel")


def _weights(n: int, k: int, bits: int, group: int, seed: int = 0):
    w = mx.random.normal((n, k), key=mx.random.key(seed)) * 0.05
    q, s, b = mx.quantize(w, group_size=group, bits=bits)
    mx.eval(q, s, b)
    return q, s, b


@pytest.mark.parametrize("bits", cpu.BITS)
@pytest.mark.parametrize("group", cpu.GROUPS)
def test_matches_mlx_for_every_row_count(bits, group):
    n, k = 72, 3 * 128  # rows not a multiple of the threads' split, several groups
    q, s, b = _weights(n, k, bits, group)
    for rows in [*range(1, 17), 31, 64, cpu.MAX_ROWS]:
        x = mx.random.normal((rows, k), key=mx.random.key(rows))
        want = mx.quantized_matmul(x, q, s, b, transpose=True, group_size=group, bits=bits)
        got = cpu.qmm(x, q, s, b, bits, group)
        assert got is not None and got.shape == want.shape and got.dtype == mx.float32
        err = float(mx.abs(got - want).max())
        assert err <= 1e-5 * max(1.0, float(mx.abs(want).max())) * k ** 0.5, (rows, err)


def test_leading_dims_and_a_strided_x():
    q, s, b = _weights(40, 256, 4, 64)
    x = mx.random.normal((3, 1, 256))
    want = mx.quantized_matmul(x, q, s, b, transpose=True, group_size=64, bits=4)
    got = cpu.qmm(x, q, s, b, 4, 64)
    assert got is not None and got.shape == (3, 1, 40) and mx.allclose(got, want, atol=1e-4)
    wide = mx.random.normal((4, 512))
    view = wide[:, ::2]  # not contiguous
    got = cpu.qmm(view, q, s, b, 4, 64)
    want = mx.quantized_matmul(mx.contiguous(view), q, s, b, transpose=True, group_size=64, bits=4)
    assert got is not None and mx.allclose(got, want, atol=1e-4)


def test_a_row_alone_equals_the_row_in_a_batch_and_threads_do_not_matter(monkeypatch):
    q, s, b = _weights(130, 512, 4, 64)
    x = mx.random.normal((9, 512))
    batch = cpu.qmm(x, q, s, b, 4, 64)
    assert batch is not None
    for i in (0, 4, 8):
        alone = cpu.qmm(x[i : i + 1], q, s, b, 4, 64)
        assert alone is not None and mx.array_equal(alone[0], batch[i])
    for t in (1, 3, 5):
        monkeypatch.setattr(cpu, "threads", lambda t=t: t)
        assert mx.array_equal(cpu.qmm(x, q, s, b, 4, 64), batch)


def test_what_it_refuses():
    q, s, b = _weights(16, 128, 4, 64)
    x = mx.random.normal((2, 128))
    assert cpu.takes(x, q, s, b, 4, 64)
    assert not cpu.takes(x, q, s, None, 4, 64)  # no biases
    assert not cpu.takes(x.astype(mx.bfloat16), q, s, b, 4, 64)  # not float32
    assert not cpu.takes(x, q, s.astype(mx.float16), b, 4, 64)
    assert cpu.takes(mx.random.normal((cpu.MAX_ROWS, 128)), q, s, b, 4, 64)
    assert not cpu.takes(mx.random.normal((cpu.MAX_ROWS + 1, 128)), q, s, b, 4, 64)
    assert not cpu.takes(x, q, s, b, 3, 64) and not cpu.takes(x, q, s, b, 4, 16)
    assert not cpu.takes(mx.random.normal((2, 64)), q, s, b, 4, 64)  # K does not match W


def test_inside_a_transformation_it_answers_none_and_the_layer_takes_mlx(monkeypatch):
    monkeypatch.setattr(linear, "gpu_backend", lambda: None)
    ql = nn.QuantizedLinear(128, 24, bias=True, group_size=64, bits=4)
    ql.bias = mx.random.normal((24,))
    x = mx.random.normal((2, 128))
    want = ql(x)
    ql.__class__ = linear.FewRowQuantizedLinear
    q, s, b = ql["weight"], ql["scales"], ql["biases"]
    seen: list[object] = []

    def traced(v):
        seen.append(cpu.qmm(v, q, s, b, 4, 64))
        return ql(v)

    got = mx.compile(traced)(x)
    assert seen == [None] and mx.allclose(got, want, atol=1e-5)


def test_the_layer_routes_few_rows_here_on_the_cpu(monkeypatch):
    """On the CPU a call below DEQUANTIZE_ROWS["cpu"] rows takes this kernel (MLX's
    quantized_matmul is not called), from there the dense path."""
    monkeypatch.setattr(linear, "gpu_backend", lambda: None)
    ql = nn.QuantizedLinear(256, 48, bias=False, group_size=64, bits=4)
    n = linear.DEQUANTIZE_ROWS["cpu"]
    xs = [mx.random.normal(shape, key=mx.random.key(i)) for i, shape in enumerate([(1, 1, 256), (n - 1, 256), (n, 256)])]
    want = [ql(x) for x in xs]
    calls: list[int] = []
    real = cpu.qmm
    monkeypatch.setattr(cpu, "qmm", lambda x, *a: calls.append(x.size // x.shape[-1]) or real(x, *a))
    ql.__class__ = linear.FewRowQuantizedLinear
    for x, w in zip(xs, want, strict=True):
        got = ql(x)
        assert got.shape == w.shape and mx.allclose(got, w, atol=1e-4)
    assert calls == [1, n - 1]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_exact_tier_through_the_cpu_kernel(arch):
    """float32 on the CPU with every quantized layer swapped (as the loader does here): batched
    rows equal rows run alone, and greedy n-gram speculation equals plain greedy."""
    from tests.test_affine_qmm import _tiny_quantized
    from tests.test_spec_engine import _repetitive_prompts, exact_tier
    from tests.tiny_models import greedy, loaded

    model, cfg = _tiny_quantized(arch, vocab_size=16)
    assert linear.install(model) > 0
    try:
        lm = loaded(model, cfg)
        prompts = _repetitive_prompts(cfg["vocab_size"], 4, seed=3)
        st = exact_tier(lm, [greedy(f"c{i}", p, max_tokens=20 + 4 * i) for i, p in enumerate(prompts)])
    finally:
        linear.uninstall(model)
    assert st.spec_steps > 0


def test_loader_joins_the_siblings_of_a_lazily_built_model(tmp_path, monkeypatch):
    """engine.loader builds the model with its weights not yet read and joins q/k/v and gate/up
    there: the joined buffers are read with the parameters, and the engine's greedy tokens are
    those of the same model with its siblings apart."""
    from bench.modelprep import SHAPES, random_model
    from engine.core import Engine, EngineConfig
    from engine.loader import load_model
    from engine.scheduler import SchedulerConfig
    from tests.tiny_models import drive, greedy

    path = random_model("tiny", tmp_path / "q4", bits=4)
    prompts = [[5 + i, 17, 42 + 3 * i, 8, 99] for i in range(3)]

    def tokens() -> tuple[int, list[list[int]]]:
        lm = load_model(str(path), dtype="float32")
        groups = {id(m.__dict__["_siblings"]) for _, m in lm.model.named_modules() if "_siblings" in m.__dict__}
        eng = Engine(lm, EngineConfig(SchedulerConfig()))  # stepped on this thread
        outs = drive(eng, [greedy(f"r{i}", p, max_tokens=12) for i, p in enumerate(prompts)])
        alone = drive(eng, [greedy("alone", prompts[1], max_tokens=12)])
        assert alone[0].tokens == outs[1].tokens
        return len(groups), [o.tokens for o in outs]

    joined, want = tokens()
    assert joined == 2 * SHAPES["tiny"]["num_hidden_layers"]
    monkeypatch.setattr(linear, "JOIN_ROWS", {})
    apart, got = tokens()
    assert apart == 0 and got == want and all(len(t) == 12 for t in got)
