"""Quantized-matmul prebuild (kernels.affine.prebuild): the model's quantized kinds, one child
process per kind and row tile run in parallel (on the CPU with `force`, where MLX compiles
nothing but the children's code path is the same), and failed children tolerated."""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn
import pytest

from kernels.affine import prebuild


def _model() -> nn.Module:
    model = nn.Sequential(nn.Linear(512, 256), nn.Linear(256, 512), nn.Embedding(64, 256))
    nn.quantize(model, group_size=64, bits=4)
    model.layers[1] = nn.QuantizedLinear(256, 512, group_size=32, bits=8)
    model.set_dtype(mx.float16)
    return model


def test_kinds_are_the_quantized_layers_dtype_bits_group_and_mode():
    assert prebuild.quant_kinds(_model()) == [("float16", 4, 64, "affine"), ("float16", 8, 32, "affine")]
    assert prebuild.quant_kinds(nn.Linear(8, 8)) == []


def test_nothing_runs_off_cuda_unless_forced(monkeypatch):
    monkeypatch.setattr(prebuild, "gpu_backend", lambda: None)
    monkeypatch.setattr(prebuild.subprocess, "Popen", pytest.fail)  # no child may start
    assert prebuild.prebuild(_model()) == 0.0


def test_children_build_every_kind_and_tile_in_parallel(monkeypatch, caplog):
    started: list[list[str]] = []
    popen = prebuild.subprocess.Popen

    def spy(args, **kw):
        started.append(args)
        return popen(args, **kw)

    calls: list[tuple] = []
    real_call = prebuild._call
    monkeypatch.setattr(prebuild.subprocess, "Popen", spy)
    monkeypatch.setattr(prebuild, "_call", lambda kind, rows: (calls.append((kind, rows)), real_call(kind, rows)))
    with caplog.at_level(logging.WARNING, logger="mlxd.kernels"):
        assert prebuild.prebuild(_model(), force=True) > 0
    assert len(started) == 2 * len(prebuild.TILE_ROWS)  # every (kind, tile), all started at once
    assert not [r for r in caplog.records if "failed" in r.getMessage()]  # every child succeeded
    assert sorted(calls) == sorted((k, r) for k in prebuild.quant_kinds(_model()) for r in prebuild.TILE_ROWS)


def test_a_failed_child_falls_back_to_the_in_process_build(monkeypatch, caplog):
    monkeypatch.setattr(prebuild, "quant_kinds", lambda model: [("float32", 3, 64, "no-such-mode")])
    built: list[tuple] = []
    monkeypatch.setattr(prebuild, "_call", lambda kind, rows: built.append((kind, rows)))
    with caplog.at_level(logging.WARNING, logger="mlxd.kernels"):
        prebuild.prebuild(nn.Linear(8, 8), rows=(16,), force=True)
    assert any("1 of 1" in r.getMessage() for r in caplog.records)
    assert built == [(("float32", 3, 64, "no-such-mode"), 16)]
