"""The opt-in precompiled launch path (kernels/common.py, MLXD_KERNEL_PRECOMPILED).

- CPU (CI): the translation unit it builds (signature, constants, body), the compile cache (a
  fake compiler), the kwargs it hands mx.fast.precompiled_cuda_kernel, the trellis and skinny
  wiring (a fake precompiled op), nvcc building the unit for sm_90 where nvcc exists, and
  bench/dispatch.py end to end on a faked CUDA backend.
- ``-m gpu`` (the H200): trellis and skinny through the precompiled path == the default path.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from kernels import common
from kernels.skinny import kernel as sk
from kernels.trellis import matvec

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
    common._COMPILED.clear()
    yield tmp_path
    common._COMPILED.clear()


@pytest.fixture
def fake_cuda(monkeypatch, tmp_cache):
    """A CUDA backend as far as our code can tell: fake kernels, fake compiler, sm_90."""
    calls = []
    pre = FakePrecompiled()
    monkeypatch.setattr(mx.fast, "cuda_kernel", fake_cuda_kernel)
    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", pre)
    monkeypatch.setattr(common, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(matvec, "fused_backend", lambda: "cuda")
    monkeypatch.setattr(sk, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(common, "gpu_arch", lambda: "sm_90")
    monkeypatch.setattr(
        common,
        "nvrtc_compile",
        lambda source, arch, cubin=True, **kw: _fake_compiler(calls)(source, arch),
    )
    monkeypatch.setitem(matvec._chosen, "cuda", "dp4a")
    matvec._kernel.cache_clear()
    sk._kernel.cache_clear()
    matvec._CALLS.clear()
    sk._CALLS.clear()
    yield {"compiles": calls, "precompiled": pre}
    matvec._kernel.cache_clear()
    sk._kernel.cache_clear()
    matvec._CALLS.clear()
    sk._CALLS.clear()


def _trellis_args(n_out=256, n_in=512, m=1, dtype=mx.float16, cfg=None):
    cfg = cfg or matvec.default_config(n_out, n_in, m, "cuda", 3)
    return cfg, matvec._launch_args(
        n_out, n_in, m, 3, 16, 256, "1mad", dtype, cfg, (m,), dtype, mx.float16
    )


# ---- the mode switch ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value,mode",
    [
        (None, ""),
        ("", ""),
        ("0", ""),
        ("off", ""),
        ("1", "blob"),
        ("yes", "blob"),
        ("lean", "lean"),
        ("LEAN", "lean"),
    ],
)
def test_precompiled_mode(monkeypatch, value, mode):
    if value is None:
        monkeypatch.delenv(common.PRECOMPILED_ENV, raising=False)
    else:
        monkeypatch.setenv(common.PRECOMPILED_ENV, value)
    assert common.precompiled_mode() == mode


# ---- the translation unit ----------------------------------------------------------------------


def test_precompiled_source_matches_mlx_layout():
    spec = common.KernelSpec("k", ("packed", "scales", "x"), ("y",), "BODY_TEXT;", "HEADER_TEXT\n")
    src = common.precompiled_source(
        spec,
        "k_pc_1",
        [("K", 3), ("FLAG", True), ("DT", mx.bfloat16)],
        [mx.uint32, mx.float16, mx.float32],
        [mx.bfloat16],
    )
    assert src.startswith(common.PRECOMPILED_PRELUDE)
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
        assert common.c_type(d)


def test_shape_parameters_are_refused():
    spec = common.KernelSpec("k", ("x",), ("y",), "y[0] = x_shape[0];")
    assert common.uses_shape_params(spec)
    with pytest.raises(ValueError, match="shape/stride"):
        common.precompiled_call(
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
    assert not common.uses_shape_params(sk._spec())
    assert not common.uses_shape_params(matvec._spec("cuda", "dp4a", "xreg"))
    assert not common.uses_shape_params(matvec._spec("cuda", "portable", "smem"))


# ---- compile cache and the kwargs --------------------------------------------------------------


def test_compile_once_per_source_then_disk(tmp_cache):
    calls = []
    comp = _fake_compiler(calls)
    src = 'extern "C" __global__ void f() {}'
    a = common.compile_precompiled(src, comp, "sm_90")
    b = common.compile_precompiled(src, comp, "sm_90")
    assert a == b and len(calls) == 1
    common._COMPILED.clear()  # a new process: the temp-dir file, no compile
    assert common.compile_precompiled(src, comp, "sm_90") == a and len(calls) == 1
    common.compile_precompiled(src, comp, "sm_80")  # another arch: another cubin
    assert len(calls) == 2
    assert len(list((tmp_cache / "mlxd-precompiled").glob("*.cubin"))) == 2


def test_precompiled_call_kwargs(tmp_cache):
    calls = []
    cfg, args = _trellis_args()
    spec = matvec._spec("cuda", "dp4a", cfg.body)
    fn, kw = common.precompiled_call(
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
    _, kw2 = common.precompiled_call(
        spec, args2, [mx.uint32, mx.float16, mx.float16], _fake_compiler(calls), "sm_90"
    )
    _, kw3 = common.precompiled_call(
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
    _, kw = common.precompiled_call(
        matvec._spec("cuda", variant, body),
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
    _, kw = common.precompiled_call(
        sk._spec(), args, [dtype, dtype, mx.int32], _nvcc(tmp_path), "sm_90"
    )
    assert kw["compiled_source"][:4] == b"\x7fELF" and kw["name"].encode() in kw["compiled_source"]


def _nvrtc_ready() -> bool:
    try:
        common._load_lib(("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"), "libnvrtc.so")
    except OSError:
        return False
    return any((Path(d) / "cuda_fp16.h").exists() for d in common.cuda_include_dirs())


@pytest.mark.skipif(not _nvrtc_ready(), reason="no libnvrtc (or no cuda_fp16.h) here")
def test_nvrtc_builds_the_units(tmp_cache):
    """The real compiler path (ctypes NVRTC, no GPU needed): cubins and PTX with our symbol."""
    cfg, args = _trellis_args(4096, 4096, 1, mx.float16)
    _, kw = common.precompiled_call(
        matvec._spec("cuda", "dp4a", cfg.body),
        args,
        [mx.uint32, mx.float16, mx.float16],
        arch="sm_90",
    )
    assert kw["compiled_source"][:4] == b"\x7fELF" and kw["name"].encode() in kw["compiled_source"]
    args = sk.launch_args(2, 384, 384, mx.bfloat16, (2,))
    _, kw = common.precompiled_call(
        sk._spec(), args, [mx.bfloat16, mx.bfloat16, mx.int32], arch="sm_90"
    )
    assert kw["compiled_source"][:4] == b"\x7fELF"
    src = common.precompiled_source(
        sk._spec(), "sk_ptx", args["template"], [mx.bfloat16] * 2 + [mx.int32], [mx.bfloat16]
    )
    ptx = common.nvrtc_compile(src, "sm_90", cubin=False)
    assert b".entry sk_ptx(" in ptx and ptx.endswith(
        b"\0"
    )  # NUL-terminated, as cuModuleLoadData wants


# ---- the wiring (fake CUDA) --------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["1", "lean"])
def test_trellis_wiring(fake_cuda, monkeypatch, mode):
    monkeypatch.setenv(common.PRECOMPILED_ENV, mode)
    pre = fake_cuda["precompiled"]
    packed = mx.zeros((256, 512 * 3 // 32), dtype=mx.uint32)
    scales = mx.ones((256,), dtype=mx.float16)
    x = mx.ones((1, 512), dtype=mx.float16)
    for _ in range(3):
        y = matvec.trellis_matvec(x, packed, scales, bits=3, L=16, block=256)
        assert y.shape == (1, 256) and y.dtype == mx.float16
    assert len(pre.calls) == 3 and len(fake_cuda["compiles"]) == 1
    assert all(c["inputs"][0] is packed and c["inputs"][1] is scales for c in pre.calls)
    assert pre.calls[0]["blob"].startswith(b"FAKECUBIN")
    later = [c["blob"] for c in pre.calls[1:]]
    assert later == ([b"", b""] if mode == "lean" else [pre.calls[0]["blob"]] * 2)
    assert len({c["name"] for c in pre.calls}) == 1


def test_no_compiler_falls_back_to_cuda_kernel(fake_cuda, monkeypatch):
    def broken(source, arch, cubin=True, **kw):
        raise RuntimeError("cannot load libnvrtc.so")

    monkeypatch.setattr(common, "nvrtc_compile", broken)
    monkeypatch.setenv(common.PRECOMPILED_ENV, "1")
    common._WARNED.clear()
    packed = mx.zeros((256, 48), dtype=mx.uint32)
    with pytest.warns(UserWarning, match="falls back"):
        y = matvec.trellis_matvec(
            mx.ones((1, 512), dtype=mx.float16),
            packed,
            mx.ones((256,), dtype=mx.float16),
            bits=3,
            L=16,
            block=256,
        )
    assert y.shape == (1, 256) and fake_cuda["precompiled"].calls == []
    w = mx.zeros((64, 96), dtype=mx.bfloat16)
    with pytest.warns(UserWarning, match="falls back"):
        p = sk.prepare(mx.zeros((3, 96), dtype=mx.bfloat16), w)
    assert len(p) == 2  # the default form


def test_trellis_default_path_untouched(fake_cuda, monkeypatch):
    monkeypatch.delenv(common.PRECOMPILED_ENV, raising=False)
    packed = mx.zeros((256, 48), dtype=mx.uint32)
    y = matvec.trellis_matvec(
        mx.ones((1, 512), dtype=mx.float16),
        packed,
        mx.ones((256,), dtype=mx.float16),
        bits=3,
        L=16,
        block=256,
    )
    assert y.shape == (1, 256)
    assert fake_cuda["precompiled"].calls == [] and fake_cuda["compiles"] == []


@pytest.mark.parametrize("mode", ["1", "lean"])
def test_skinny_wiring(fake_cuda, monkeypatch, mode):
    monkeypatch.setenv(common.PRECOMPILED_ENV, mode)
    pre = FakePrecompiled(lambda inputs, shapes, dtypes: inputs[1] @ inputs[0].T + 1000.0)
    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", pre)
    w = mx.random.normal((64, 96)).astype(mx.bfloat16)
    x = mx.random.normal((3, 96)).astype(mx.bfloat16)
    for _ in range(2):
        y = sk.skinny_matmul(x, w)
    np.testing.assert_allclose(
        np.array(y.astype(mx.float32)), np.array((x @ w.T + 1000.0).astype(mx.float32))
    )
    # lean: prepare runs (and evaluates) one warm-up call with the cubin, then every call is blob-free
    assert len(pre.calls) == (3 if mode == "lean" else 2)
    first = pre.calls[0]
    assert (
        first["inputs"][0] is w
        and first["inputs"][2].dtype == mx.int32
        and first["blob"].startswith(b"FAKE")
    )
    assert [c["blob"] for c in pre.calls[1:]] == [b"" if mode == "lean" else first["blob"]] * (
        len(pre.calls) - 1
    )
    p = sk.prepare(x, w)  # what engine/skinny.py caches: the 3-tuple form, launch() takes it
    assert len(p) == 3 and "output_shapes" in p[0]
    sk.launch(x, w, p)


def test_skinny_default_prepare_is_unchanged(monkeypatch):
    monkeypatch.delenv(common.PRECOMPILED_ENV, raising=False)
    w = mx.zeros((64, 96), dtype=mx.bfloat16)
    p = sk.prepare(mx.zeros((3, 96), dtype=mx.bfloat16), w)
    assert len(p) == 2 and p[0] == sk.launch_args(3, 64, 96, mx.bfloat16, (3,))


# ---- bench/dispatch.py on a faked CUDA backend (Python paths only) ------------------------------


def test_dispatch_bench_runs_on_fake_cuda(fake_cuda, monkeypatch, tmp_path):
    import bench.dispatch as bd

    monkeypatch.delenv(common.PRECOMPILED_ENV, raising=False)
    out = tmp_path / "d.json"
    assert bd.main(["--chain", "2", "--repeats", "1", "--out", str(out)]) == 0
    import json

    res = json.loads(out.read_text())
    errors = [r for r in res["rows"] if "error" in r or "check_error" in r]
    assert not errors, errors
    paths = {(r["group"], r["path"]) for r in res["rows"]}
    for want in [
        ("trivial", "precompiled lean"),
        ("trellis", "wrapper (current)"),
        ("trellis", "precompiled blob"),
        ("trellis", "wrapper MLXD_KERNEL_PRECOMPILED=lean"),
        ("skinny", "precompiled lean"),
        ("skinny", "skinny_matmul MLXD_KERNEL_PRECOMPILED=lean"),
    ]:
        assert want in paths, want
    assert all(r.get("check", {}).get("equal", True) for r in res["rows"])
    assert common.PRECOMPILED_ENV not in __import__("os").environ
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


# ---- the GPU: precompiled == default ------------------------------------------------------------

TOL = {mx.float32: 1e-4, mx.float16: 4e-3, mx.bfloat16: 2e-2}


def _needs_cuda():
    if common.gpu_backend() != "cuda":
        pytest.skip("needs the cuda backend")


def _both(monkeypatch, run, clear, mode):
    monkeypatch.delenv(common.PRECOMPILED_ENV, raising=False)
    clear()
    ref = run()
    mx.eval(ref)
    monkeypatch.setenv(common.PRECOMPILED_ENV, mode)
    clear()
    try:
        got = [run() for _ in range(2)]  # the first call, then the cached (lean: blob-free) one
        mx.eval(got)
    finally:
        monkeypatch.delenv(common.PRECOMPILED_ENV, raising=False)
        clear()
    return np.array(ref.astype(mx.float32)), [np.array(g.astype(mx.float32)) for g in got]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["1", "lean"])
@pytest.mark.parametrize(
    "n_out,n_in,batch,dtype,body",
    [
        (4096, 4096, 1, mx.float16, None),
        (4096, 4096, 4, mx.bfloat16, None),
        (131, 384, 3, mx.float32, None),
        (300, 1024, 8, mx.float16, "smem"),
        (64, 14336, 1, mx.bfloat16, None),
    ],
)
def test_gpu_trellis_precompiled_equals_default(monkeypatch, mode, n_out, n_in, batch, dtype, body):
    _needs_cuda()
    rng = np.random.default_rng(n_out + batch)
    packed = mx.array(rng.integers(0, 2**32, size=(n_out, n_in * 3 // 32), dtype=np.uint32))
    scales = mx.array(rng.uniform(0.5, 1.5, size=(n_out,)).astype(np.float16))
    x = mx.random.normal((batch, n_in), key=mx.random.key(batch)).astype(dtype)
    cfg = matvec.SMEM if body == "smem" else None

    def run():
        return matvec.trellis_matvec(x, packed, scales, bits=3, L=16, block=256, config=cfg)

    ref, got = _both(monkeypatch, run, matvec._CALLS.clear, mode)
    for g in got:
        np.testing.assert_allclose(g, ref, rtol=TOL[dtype], atol=TOL[dtype] * np.abs(ref).max())


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["1", "lean"])
@pytest.mark.parametrize(
    "m,n,k,dtype",
    [
        (2, 384, 384, mx.bfloat16),
        (8, 4096, 4096, mx.bfloat16),
        (5, 300, 136, mx.float16),
        (16, 1024, 512, mx.float32),
    ],
)
def test_gpu_skinny_precompiled_equals_default(monkeypatch, mode, m, n, k, dtype):
    _needs_cuda()
    w = (mx.random.normal((n, k), key=mx.random.key(n)) / np.sqrt(k)).astype(dtype)
    x = mx.random.normal((m, k), key=mx.random.key(m)).astype(dtype)
    xt = mx.random.normal((k, m), key=mx.random.key(m + 1)).astype(dtype).T  # not row-contiguous

    for xi in (x, xt):
        ref, got = _both(monkeypatch, lambda xi=xi: sk.skinny_matmul(xi, w), sk._CALLS.clear, mode)
        for g in got:
            np.testing.assert_allclose(g, ref, rtol=TOL[dtype], atol=TOL[dtype] * np.abs(ref).max())
