"""kernels/cpu.py: attention and SwiGLU with NumPy's exp agree with MLX's own ops, and the
engine routes a model's calls there on a CPU."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import activations, base

from engine import cuda_guard
from kernels import cpu


def _qkv(B: int, H: int, Hkv: int, L: int, K: int, seed: int = 0):
    mx.random.seed(seed)
    return (mx.random.normal((B, H, L, 16)), mx.random.normal((B, Hkv, K, 16)),
            mx.random.normal((B, Hkv, K, 16)))


def _reference(q, k, v, scale, mask):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def _rows_mask(B: int, L: int, K: int, lengths: list[int]) -> mx.array:
    """Row b's queries are its last L positions of lengths[b] keys (right padding past it)."""
    m = np.zeros((B, 1, L, K), dtype=bool)
    for b, n in enumerate(lengths):
        for i in range(L):
            m[b, 0, i, : n - L + i + 1] = True
    return mx.array(m)


@pytest.mark.parametrize("H,Hkv", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("kind", ["none", "causal", "rows", "additive", "per_head", "2d"])
def test_attention_matches_mlx(H, Hkv, kind):
    B, L, K = (3, 5, 40) if kind in ("rows", "per_head") else (1, 24, 60)
    q, k, v = _qkv(B, H, Hkv, L, K)
    mask: mx.array | str | None
    if kind == "none":
        mask = None
    elif kind == "causal":
        mask = "causal"
    elif kind == "rows":
        mask = _rows_mask(B, L, K, [40, 23, 9])
    elif kind == "additive":
        pos = np.arange(K)
        mask = mx.array(np.where(pos[None] <= pos[K - L:, None], 0.0, -1e9).astype(np.float32))
    elif kind == "2d":
        pos = np.arange(K)
        mask = mx.array(pos[None] <= pos[K - L:, None])
    else:  # one mask per query head
        rng = np.random.default_rng(1)
        m = rng.random((B, H, L, K)) < 0.6
        m[..., 0] = True
        mask = mx.array(m)
    scale = 16 ** -0.5
    want = _reference(q, k, v, scale, mask)
    q0, k0, v0 = np.array(q), np.array(k), np.array(v)
    got = cpu.attention(q, k, v, scale, mask)
    assert got.shape == want.shape == (B, H, L, 16)
    assert float(mx.abs(got - want).max()) < 1e-5
    # the inputs were not written through the NumPy view
    assert (np.array(q) == q0).all() and (np.array(k) == k0).all() and (np.array(v) == v0).all()


def test_attention_of_a_query_that_sees_nothing_is_zero():
    q, k, v = _qkv(2, 4, 2, 3, 10)
    m = np.ones((2, 1, 3, 10), dtype=bool)
    m[1, 0, 2] = False  # row 1's last query sees no key
    got = np.array(cpu.attention(q, k, v, 0.25, mx.array(m)))
    assert np.isfinite(got).all() and (got[1, :, 2] == 0).all()
    want = np.array(_reference(q, k, v, 0.25, mx.array(m)))
    assert np.abs(got[0] - want[0]).max() < 1e-5


def test_takes_only_what_it_computes():
    q, k, v = _qkv(1, 6, 2, 64, 256)
    assert cpu.takes(q, k, v, None) and cpu.takes(q, k, v, "causal")
    assert cpu.takes(q, k, v, mx.ones((1, 1, 64, 256), dtype=mx.bool_))
    assert not cpu.takes(q, k, v, None, sinks=mx.zeros((6,)))
    assert not cpu.takes(q.astype(mx.bfloat16), k.astype(mx.bfloat16), v.astype(mx.bfloat16), None)
    assert not cpu.takes(q, (k, k), v, None)  # a quantized cache's tuple
    assert not cpu.takes(q[:, :, :1, :], k[:, :, :8], v[:, :, :8], None)  # too small to pay
    assert not cpu.takes(q, k, v, "sliding")


def test_swiglu_matches_mlx_lm():
    mx.random.seed(3)
    gate = mx.random.normal((2, 96, 256)) * 8  # large |gate|: exp over- and underflows
    x = mx.random.normal((2, 96, 256))
    assert cpu.swiglu_takes(gate, x)
    got, want = cpu.swiglu(gate, x), activations.swiglu(gate, x)
    assert np.isfinite(np.array(got)).all()
    assert float(mx.abs(got - want).max()) < 1e-5
    assert not cpu.swiglu_takes(gate[:, :1, :8], x[:, :1, :8])
    assert not cpu.swiglu_takes(gate.astype(mx.bfloat16), x.astype(mx.bfloat16))


@pytest.fixture
def _restore_modules():
    """install_attention patches mlx-lm's model modules for the process: give them back."""
    import sys

    yield
    for name, mod in list(sys.modules.items()):
        if not name.startswith("mlx_lm.models."):
            continue
        for attr in ("scaled_dot_product_attention", "swiglu"):
            fn = getattr(mod, attr, None)
            if getattr(fn, "_mlxd_route", None):
                setattr(mod, attr, fn._mlxd_original)


def test_a_cpu_model_routes_here_and_keeps_its_logits(monkeypatch, _restore_modules):
    """On a CPU the engine's install points a llama model's attention and SwiGLU here: the
    forward of a 200-token prompt calls both and gives mlx-lm's logits."""
    import mlx_lm.models.llama as llama_module

    from tests.tiny_models import tiny_model

    monkeypatch.setattr(llama_module, "scaled_dot_product_attention",
                        base.scaled_dot_product_attention)
    monkeypatch.setattr(llama_module, "swiglu", activations.swiglu)
    model, cfg = tiny_model("llama", intermediate_size=256)
    prompt = mx.array([[i * 7 % cfg["vocab_size"] for i in range(200)]])
    want = model(prompt)
    mx.eval(want)
    calls = {"attention": 0, "swiglu": 0}
    real_attention, real_swiglu = cpu.attention, cpu.swiglu
    monkeypatch.setattr(cpu, "attention", lambda *a: calls.__setitem__(
        "attention", calls["attention"] + 1) or real_attention(*a))
    monkeypatch.setattr(cpu, "swiglu", lambda *a: calls.__setitem__(
        "swiglu", calls["swiglu"] + 1) or real_swiglu(*a))
    assert cuda_guard.install_attention(model, route="cpu") == 1
    assert cuda_guard.install_attention(model, route="cpu") == 0  # idempotent
    got = model(prompt)
    assert calls == {"attention": cfg["num_hidden_layers"], "swiglu": cfg["num_hidden_layers"]}
    assert float(mx.abs(got - want).max()) < 1e-4
    assert cuda_guard.attention_route() == "cpu"


def test_a_traced_call_takes_mlx_ops(_restore_modules):
    """Inside mx.compile nothing can be evaluated: the kernels raise InTransform and the
    route answers with mlx-lm's own functions, so a compiled forward still works."""
    q, k, v = _qkv(1, 6, 2, 64, 256)
    with pytest.raises(cpu.InTransform):
        mx.compile(lambda a, b, c: cpu.attention(a, b, c, 0.25, None))(q, k, v)
    sdpa = cuda_guard.cpu_sdpa(base.scaled_dot_product_attention)
    got = mx.compile(lambda a, b, c: sdpa(a, b, c, None, 0.25, "causal"))(q, k, v)
    assert float(mx.abs(got - _reference(q, k, v, 0.25, "causal")).max()) < 1e-5
    swiglu = cuda_guard.cpu_swiglu(activations.swiglu)
    gate, x = mx.random.normal((64, 128)), mx.random.normal((64, 128))
    got = mx.compile(swiglu)(gate, x)
    assert float(mx.abs(got - activations.swiglu(gate, x)).max()) < 1e-5
