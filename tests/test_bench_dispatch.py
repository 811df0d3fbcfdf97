"""bench/dispatch.py and its precompiled-kernel helper (bench/precompiled.py), on the CPU.

The translation unit it builds (signature, constants, body), the compile cache (a fake
compiler), the kwargs it hands mx.fast.precompiled_cuda_kernel, nvcc / NVRTC building the unit
for sm_90 where they exist, and bench/dispatch.py end to end on a faked CUDA backend. On the GPU
the bench compares every path's output with the current path's itself (`check`).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import mlx.core as mx
import pytest

from bench import precompiled as pc
from kernels import common
from kernels.skinny import kernel as sk
from kernels.trellis import linear, matvec

# ---- helpers -----------------------------------------------------------------------------------


def _fake_compiler(calls):
    def compile_(source, arch):
        calls.append((source, arch))
        name = re.search(r'extern "C" __global__ void (\w+)\(', source).group(1)
        return b"FAKECUBIN:" + name.encode()

    return compile_


def _zeros_outputs(output_shapes, output_dtypes):
    return [mx.zeros(tuple(s), dtype=d) for s, d in zip(output_shapes, output_dtypes, strict=True)]


class FakePrecompiled:
    """Stands in for mx.fast.precompiled_cuda_kernel: the real keyword-only signature, records calls."""

    def __init__(self, result=None):
        self.calls = []
        self.result = result

    def __call__(
        self,
        *,
        name,
        compiled_source,
        inputs,
        output_shapes,
        output_dtypes,
        scalars,
        grid,
        threadgroup,
        shared_memory=0,
        init_value=None,
        ensure_row_contiguous=False,
        stream=None,
    ):
        assert isinstance(compiled_source, bytes) and scalars == []
        self.calls.append(
            {
                "name": name,
                "blob": compiled_source,
                "inputs": inputs,
                "grid": grid,
                "threadgroup": threadgroup,
                "ensure_row_contiguous": ensure_row_contiguous,
            }
        )
        if self.result is not None:
            return [self.result(inputs, output_shapes, output_dtypes)]
        return _zeros_outputs(output_shapes, output_dtypes)


def fake_cuda_kernel(
    name, input_names, output_names, source, header="", ensure_row_contiguous=True, shared_memory=0
):
    def call(
        *,
        inputs,
        output_shapes,
        output_dtypes,
        grid,
        threadgroup,
        template=None,
        init_value=None,
        verbose=False,
        stream=None,
    ):
        assert len(inputs) == len(input_names)
        return _zeros_outputs(output_shapes, output_dtypes)

    return call


@pytest.fixture
def tmp_cache(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    pc._COMPILED.clear()
    yield tmp_path
    pc._COMPILED.clear()


@pytest.fixture
def fake_cuda(monkeypatch, tmp_cache):
    """A CUDA backend as far as our code can tell: fake kernels, fake compiler, sm_90."""
    calls = []
    pre = FakePrecompiled()
    monkeypatch.setattr(mx.fast, "cuda_kernel", fake_cuda_kernel)
    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", pre)
    monkeypatch.setattr(common, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(matvec, "fused_backend", lambda: "cuda")
    monkeypatch.setattr(linear, "fused_backend", lambda: "cuda")
    monkeypatch.setattr(pc, "gpu_arch", lambda: "sm_90")
    monkeypatch.setattr(
        pc,
        "nvrtc_compile",
        lambda source, arch, cubin=True, **kw: _fake_compiler(calls)(source, arch),
    )
    monkeypatch.setitem(matvec._chosen, "cuda", "dp4a")
    matvec._kernel.cache_clear()
    sk._kernel.cache_clear()
    matvec._CALLS.clear()
    sk._CALLS.clear()
    matvec.fused_decode.cache_clear()
    yield {"compiles": calls, "precompiled": pre}
    matvec._kernel.cache_clear()
    sk._kernel.cache_clear()
    matvec._CALLS.clear()
    sk._CALLS.clear()
    matvec.fused_decode.cache_clear()


def _trellis_args(n_out=256, n_in=512, m=1, dtype=mx.float16, cfg=None):
    cfg = cfg or matvec.default_config(n_out, n_in, m, "cuda", 3)
    return cfg, matvec._launch_args(
        n_out, n_in, m, 3, 16, 256, "1mad", dtype, cfg, (m,), dtype, mx.float16
    )


# ---- the translation unit ----------------------------------------------------------------------


def test_precompiled_source_matches_mlx_layout():
    spec = pc.KernelSpec("k", ("packed", "scales", "x"), ("y",), "BODY_TEXT;", "HEADER_TEXT\n")
    src = pc.precompiled_source(
        spec,
        "k_pc_1",
        [("K", 3), ("FLAG", True), ("DT", mx.bfloat16)],
        [mx.uint32, mx.float16, mx.float32],
        [mx.bfloat16],
    )
    assert src.startswith(pc.PRECOMPILED_PRELUDE)
    assert (
        src.index("HEADER_TEXT")
        < src.index('extern "C" __global__ void k_pc_1(')
        < src.index("BODY_TEXT")
    )
    sig = src[src.index("k_pc_1(") : src.index(") {")]
    assert [p.strip() for p in sig[len("k_pc_1(") :].split(",")] == [
        "const unsigned int* packed",
        "const __half* scales",
        "const float* x",
        "__nv_bfloat16* y",
    ]
    assert (
        "constexpr int K = 3;" in src
        and "constexpr bool FLAG = true;" in src
        and "using DT = __nv_bfloat16;" in src
    )


def test_every_mlx_dtype_has_a_c_type():
    for d in (
        mx.bool_,
        mx.uint8,
        mx.uint16,
        mx.uint32,
        mx.uint64,
        mx.int8,
        mx.int16,
        mx.int32,
        mx.int64,
        mx.float16,
        mx.bfloat16,
        mx.float32,
    ):
        assert pc.c_type(d)


def test_shape_parameters_are_refused():
    spec = pc.KernelSpec("k", ("x",), ("y",), "y[0] = x_shape[0];")
    assert pc.uses_shape_params(spec)
    with pytest.raises(ValueError, match="shape/stride"):
        pc.precompiled_call(
            spec,
            {
                "template": [],
                "grid": (1, 1, 1),
                "threadgroup": (1, 1, 1),
                "output_shapes": [(1,)],
                "output_dtypes": [mx.float32],
            },
            [mx.float32],
            compiler=_fake_compiler([]),
            arch="sm_90",
        )
    assert not pc.uses_shape_params(pc.skinny_spec())
    assert not pc.uses_shape_params(pc.trellis_spec("dp4a", "xreg"))
    assert not pc.uses_shape_params(pc.trellis_spec("portable", "smem"))


# ---- compile cache and the kwargs --------------------------------------------------------------


def test_compile_once_per_source_then_disk(tmp_cache):
    calls = []
    comp = _fake_compiler(calls)
    src = 'extern "C" __global__ void f() {}'
    a = pc.compile_precompiled(src, comp, "sm_90")
    b = pc.compile_precompiled(src, comp, "sm_90")
    assert a == b and len(calls) == 1
    pc._COMPILED.clear()  # a new process: the temp-dir file, no compile
    assert pc.compile_precompiled(src, comp, "sm_90") == a and len(calls) == 1
    pc.compile_precompiled(src, comp, "sm_80")  # another arch: another cubin
    assert len(calls) == 2
    assert len(list((tmp_cache / "mlxd-precompiled").glob("*.cubin"))) == 2


def test_precompiled_call_kwargs(tmp_cache):
    calls = []
    cfg, args = _trellis_args()
    spec = pc.trellis_spec("dp4a", cfg.body)
    fn, kw = pc.precompiled_call(
        spec, args, [mx.uint32, mx.float16, mx.float16], _fake_compiler(calls), "sm_90"
    )
    assert fn is mx.fast.precompiled_cuda_kernel
    assert set(kw) == {
        "name",
        "compiled_source",
        "output_shapes",
        "output_dtypes",
        "scalars",
        "grid",
        "threadgroup",
        "ensure_row_contiguous",
    }
    assert kw["compiled_source"] == b"FAKECUBIN:" + kw["name"].encode()
    assert kw["name"].startswith(spec.name + "_pc_") and kw["grid"] == args["grid"]
    assert kw["output_shapes"] == args["output_shapes"] and kw["ensure_row_contiguous"] is True
    # the kwargs are accepted by the real op's signature (names only: no GPU here)
    sig = mx.fast.precompiled_cuda_kernel.__doc__.split("\n")[0]
    for name in (*kw, "inputs"):
        assert f"{name}:" in sig, name
    # another template (batch 2) or another input dtype: another kernel
    _, args2 = _trellis_args(m=2)
    _, kw2 = pc.precompiled_call(
        spec, args2, [mx.uint32, mx.float16, mx.float16], _fake_compiler(calls), "sm_90"
    )
    _, kw3 = pc.precompiled_call(
        spec, args, [mx.uint32, mx.float16, mx.float32], _fake_compiler(calls), "sm_90"
    )
    assert len({kw["name"], kw2["name"], kw3["name"]}) == 3 and len(calls) == 3


# ---- nvcc builds the unit (stands in for NVRTC, where installed) -------------------------------


def _nvcc(tmp_path):
    def compile_(source, arch):
        cu = tmp_path / "k.cu"
        cu.write_text(source)
        out = tmp_path / "k.cubin"
        proc = subprocess.run(
            ["nvcc", f"-arch={arch}", "-cubin", "-o", str(out), "-Xptxas", "-v", str(cu)],
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        spills = [int(v) for v in re.findall(r"(\d+) bytes spill stores", proc.stderr)]
        assert spills and max(spills) == 0, proc.stderr[-2000:]
        return out.read_bytes()

    return compile_


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
@pytest.mark.parametrize("variant,body", [("dp4a", "xreg"), ("portable", "xreg"), ("dp4a", "smem")])
def test_trellis_unit_builds_for_sm90(tmp_cache, tmp_path, variant, body):
    cfg = matvec.SMEM if body == "smem" else matvec.default_config(4096, 4096, 1, "cuda", 3)
    _, args = _trellis_args(4096, 4096, 1, mx.float16, cfg)
    _, kw = pc.precompiled_call(
        pc.trellis_spec(variant, body),
        args,
        [mx.uint32, mx.float16, mx.float16],
        _nvcc(tmp_path),
        "sm_90",
    )
    blob = kw["compiled_source"]
    assert (
        blob[:4] == b"\x7fELF" and kw["name"].encode() in blob
    )  # extern "C": the name is the symbol


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
def test_skinny_unit_builds_for_sm90(tmp_cache, tmp_path, dtype):
    args = sk.launch_args(8, 4096, 4096, dtype, (8,))
    _, kw = pc.precompiled_call(
        pc.skinny_spec(), args, [dtype, dtype, mx.int32], _nvcc(tmp_path), "sm_90"
    )
    assert kw["compiled_source"][:4] == b"\x7fELF" and kw["name"].encode() in kw["compiled_source"]


def _nvrtc_ready() -> bool:
    try:
        pc._load_lib(("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"), "libnvrtc.so")
    except OSError:
        return False
    return any((Path(d) / "cuda_fp16.h").exists() for d in pc.cuda_include_dirs())


@pytest.mark.skipif(not _nvrtc_ready(), reason="no libnvrtc (or no cuda_fp16.h) here")
def test_nvrtc_builds_the_units(tmp_cache):
    """The real compiler path (ctypes NVRTC, no GPU needed): cubins and PTX with our symbol."""
    cfg, args = _trellis_args(4096, 4096, 1, mx.float16)
    _, kw = pc.precompiled_call(
        pc.trellis_spec("dp4a", cfg.body),
        args,
        [mx.uint32, mx.float16, mx.float16],
        arch="sm_90",
    )
    assert kw["compiled_source"][:4] == b"\x7fELF" and kw["name"].encode() in kw["compiled_source"]
    args = sk.launch_args(2, 384, 384, mx.bfloat16, (2,))
    _, kw = pc.precompiled_call(
        pc.skinny_spec(), args, [mx.bfloat16, mx.bfloat16, mx.int32], arch="sm_90"
    )
    assert kw["compiled_source"][:4] == b"\x7fELF"
    src = pc.precompiled_source(
        pc.skinny_spec(), "sk_ptx", args["template"], [mx.bfloat16] * 2 + [mx.int32], [mx.bfloat16]
    )
    ptx = pc.nvrtc_compile(src, "sm_90", cubin=False)
    assert b".entry sk_ptx(" in ptx and ptx.endswith(
        b"\0"
    )  # NUL-terminated, as cuModuleLoadData wants


# ---- bench/dispatch.py on a faked CUDA backend (Python paths only) ------------------------------


def test_dispatch_bench_runs_on_fake_cuda(fake_cuda, monkeypatch, tmp_path):
    import bench.dispatch as bd

    out = tmp_path / "d.json"
    assert bd.main(["--chain", "2", "--repeats", "1", "--out", str(out)]) == 0
    import json

    res = json.loads(out.read_text())
    errors = [r for r in res["rows"] if "error" in r or "check_error" in r]
    assert not errors, errors
    paths = {(r["group"], r["path"]) for r in res["rows"]}
    for want in [
        ("trivial", "precompiled blob"),
        ("trivial", "precompiled ptx blob"),
        ("trellis", "wrapper (current)"),
        ("trellis", "wrapper, mx.compile per call"),
        ("trellis", "precompiled blob"),
        ("trellis", "TrellisLinear, MLXD_TRELLIS_COMPILE=0"),
        ("trellis", "TrellisLinear, compiled decode"),
        ("skinny", "precompiled blob"),
    ]:
        assert want in paths, want
    assert not any("lean" in p for _, p in paths)
    assert all(r.get("check", {}).get("equal", True) for r in res["rows"])
    child = res["children"]["no_cuda_graphs"]  # a real child process: this CPU, so builtin only
    assert child["rc"] == 0 and [r["path"] for r in child["rows"]] == ["builtin"], child


def test_dispatch_bench_cpu_smoke(tmp_path):
    import json

    import bench.dispatch as bd

    out = tmp_path / "d.json"
    assert bd.main(["--chain", "4", "--repeats", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    if res["env"]["backend"] != "cuda":
        assert [r["path"] for r in res["rows"]] == ["builtin"]
        assert {s["group"] for s in res["skipped"]} == {"trivial", "trellis", "skinny"}
