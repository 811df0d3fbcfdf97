"""Our own NVRTC cubin for a kernel MLX would build, for mx.fast.precompiled_cuda_kernel (bench only).

bench/dispatch.py times this path against mx.fast.cuda_kernel. It was an opt-in product path
(MLXD_KERNEL_PRECOMPILED) until the H200 measured that it does not pay: the cubin bytes travel
with every call, so eval costs about what the build work saves, and mx.compile around the plain
call is faster (docs/kernels.md, "Custom-kernel dispatch cost"). It lives here so that the
measurement stays reproducible.

The translation unit is the one MLX would build (our header, then the signature, the template
constants and our body), but as an extern "C" kernel compiled once per (kernel, template) with
NVRTC through ctypes (the libnvrtc MLX itself loads), cached in memory and under the temp dir.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

# MLX dtypes -> the C type of a kernel parameter (builtin names: no <cstdint> needed under NVRTC)
CUDA_C_TYPES = {
    "bool": "bool",
    "uint8": "unsigned char",
    "uint16": "unsigned short",
    "uint32": "unsigned int",
    "uint64": "unsigned long long",
    "int8": "signed char",
    "int16": "short",
    "int32": "int",
    "int64": "long long",
    "float16": "__half",
    "bfloat16": "__nv_bfloat16",
    "float32": "float",
    "float64": "double",
}

PRECOMPILED_PRELUDE = "#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n"


def c_type(dtype: mx.Dtype) -> str:
    return CUDA_C_TYPES[str(dtype).rsplit(".", 1)[-1]]


@dataclass(frozen=True)
class KernelSpec:
    """What mx.fast.cuda_kernel was given: enough to build the same kernel for the precompiled path."""

    name: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    source: str
    header: str = ""


def precompiled_source(spec: KernelSpec, func: str, template, input_dtypes, output_dtypes) -> str:
    """The translation unit for one (kernel, template): prelude, header, an extern "C" kernel
    `func` with MLX's parameter order (inputs, then outputs; no shape/stride parameters: the
    caller checks the source uses none), the template constants as MLX writes them, the body."""
    params = [
        f"    const {c_type(t)}* {n}" for n, t in zip(spec.input_names, input_dtypes, strict=True)
    ]
    params += [
        f"    {c_type(t)}* {n}" for n, t in zip(spec.output_names, output_dtypes, strict=True)
    ]
    consts = []
    for name, value in template:
        if isinstance(value, bool):
            consts.append(f"  constexpr bool {name} = {'true' if value else 'false'};\n")
        elif isinstance(value, int):
            consts.append(f"  constexpr int {name} = {value};\n")
        else:
            consts.append(f"  using {name} = {c_type(value)};\n")
    return (
        PRECOMPILED_PRELUDE
        + spec.header
        + f'\nextern "C" __global__ void {func}(\n'
        + ",\n".join(params)
        + ") {\n"
        + "".join(consts)
        + "\n"
        + spec.source
        + "\n}\n"
    )


def uses_shape_params(spec: KernelSpec) -> bool:
    """Whether the body reads `<input>_shape/_strides/_ndim` (which MLX passes only to cuda_kernel)."""
    return any(
        f"{n}_{s}" in spec.source for n in spec.input_names for s in ("shape", "strides", "ndim")
    )


def cuda_include_dirs() -> list[str]:
    """Where cuda_fp16.h & co. may be: MLX's CCCL, the nvidia pip packages, CUDA_HOME/CUDA_PATH,
    /usr/local/cuda (the places MLX's own NVRTC call looks in)."""
    import sys

    pkg = Path(mx.__file__).resolve().parent  # .../mlx (core.*.so lives there)
    dirs = [pkg / "include" / "cccl"]
    libmlx = _find_loaded("libmlx")
    if libmlx:
        dirs.append(Path(libmlx).resolve().parent.parent / "include" / "cccl")
    libnvrtc = _find_loaded("libnvrtc")
    if libnvrtc:  # nvidia/cu13/lib/libnvrtc.so.13 -> nvidia/cu13/include
        dirs.append(Path(libnvrtc).resolve().parent.parent / "include")
    for root in [str(pkg.parent), *sys.path]:
        nv = Path(root or ".") / "nvidia"
        if nv.is_dir():
            dirs += sorted(p for p in nv.glob("*/include") if p.is_dir())
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            dirs.append(Path(os.environ[env]) / "include")
    dirs.append(Path("/usr/local/cuda/include"))
    seen, out = set(), []
    for d in dirs:
        if d.is_dir() and str(d) not in seen:
            seen.add(str(d))
            out.append(str(d))
    return out


def _find_loaded(prefix: str) -> str | None:
    """Path of an already mapped shared library whose file name starts with prefix."""
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            path = line.split()[-1] if len(line.split()) >= 6 else ""
            if os.path.basename(path).startswith(prefix):
                return path
    except OSError:
        pass
    return None


def _load_lib(names: tuple[str, ...], prefix: str) -> ctypes.CDLL:
    errors = []
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError as exc:
            errors.append(str(exc))
    path = _find_loaded(prefix)
    if path:
        return ctypes.CDLL(path)
    raise OSError(f"cannot load {prefix}: " + " | ".join(errors))


def gpu_arch() -> str:
    """'sm_XY' of device 0: from mx.device_info() when it says, else the CUDA driver."""
    try:
        info = mx.device_info()
        if "compute_capability_major" in info:
            return (
                f"sm_{int(info['compute_capability_major'])}{int(info['compute_capability_minor'])}"
            )
    except Exception:  # noqa: BLE001 (older MLX: no device_info)
        pass
    cuda = _load_lib(("libcuda.so.1", "libcuda.so"), "libcuda.so")
    major, minor = ctypes.c_int(), ctypes.c_int()
    cuda.cuInit(0)
    if cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, 0) or cuda.cuDeviceGetAttribute(
        ctypes.byref(minor), 76, 0
    ):
        raise RuntimeError("cuDeviceGetAttribute failed")
    return f"sm_{major.value}{minor.value}"


def nvrtc_compile(
    source: str,
    arch: str,
    name: str = "kernel.cu",
    cubin: bool = True,
    options: tuple[str, ...] = (),
) -> bytes:
    """NVRTC `source` for `arch` ('sm_90'): the cubin (or PTX for compute_XY when cubin=False)."""
    nvrtc = _load_lib(("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"), "libnvrtc.so")
    prog = ctypes.c_void_p()
    nvrtc.nvrtcGetErrorString.restype = ctypes.c_char_p

    def check(rc, what):
        if rc != 0:
            raise RuntimeError(f"{what}: {nvrtc.nvrtcGetErrorString(rc).decode()}")

    check(
        nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None),
        "nvrtcCreateProgram",
    )
    try:
        target = arch if cubin else arch.replace("sm_", "compute_")
        opts = [f"--gpu-architecture={target}", "--std=c++17", *options]
        opts += [f"--include-path={d}" for d in cuda_include_dirs()]
        arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        rc = nvrtc.nvrtcCompileProgram(prog, len(opts), arr)
        if rc != 0:
            size = ctypes.c_size_t()
            nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value + 1)
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(
                f"NVRTC failed ({nvrtc.nvrtcGetErrorString(rc).decode()}): "
                + log.value.decode(errors="replace")[-3000:]
            )
        size = ctypes.c_size_t()
        get_size, get = (
            (nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN)
            if cubin
            else (nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX)
        )
        check(get_size(prog, ctypes.byref(size)), "get size")
        buf = ctypes.create_string_buffer(size.value)
        check(get(prog, buf), "get code")
        return buf.raw
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))


_COMPILED: dict[str, bytes] = {}


def compile_precompiled(
    source: str, compiler=None, arch: str | None = None, disk: bool = True
) -> bytes:
    """The cubin of `source` (once per source and arch: memory, then the temp-dir cache, then
    `compiler(source, arch)`, default nvrtc_compile)."""
    arch = arch or gpu_arch()
    digest = hashlib.sha1(f"{arch}\n{source}".encode()).hexdigest()[:20]
    blob = _COMPILED.get(digest)
    if blob is not None:
        return blob
    path = Path(tempfile.gettempdir()) / "mlxd-precompiled" / f"{digest}.cubin"
    if disk and path.exists():
        blob = path.read_bytes()
    else:
        blob = (compiler or nvrtc_compile)(source, arch)
        if disk:
            path.parent.mkdir(exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(blob)
            tmp.replace(path)
    _COMPILED[digest] = blob
    return blob


def precompiled_call(
    spec: KernelSpec, args: dict, input_dtypes, compiler=None, arch: str | None = None
):
    """(function, keyword arguments) for one cuda_kernel call `args` (template, grid, threadgroup,
    output_shapes, output_dtypes) through mx.fast.precompiled_cuda_kernel: call it as
    fn(inputs=[...], **kwargs)[0], the same shape as the cuda_kernel object's call."""
    if uses_shape_params(spec):
        raise ValueError(
            f"{spec.name}: the body reads shape/stride parameters, which the precompiled path lacks"
        )
    template = args.get("template") or []
    tag = hashlib.sha1(
        repr(
            (
                spec,
                [(n, str(v)) for n, v in template],
                [str(d) for d in input_dtypes],
                [str(d) for d in args["output_dtypes"]],
            )
        ).encode()
    ).hexdigest()[:16]
    func = f"{spec.name}_pc_{tag}"
    source = precompiled_source(spec, func, template, input_dtypes, args["output_dtypes"])
    blob = compile_precompiled(source, compiler, arch)
    return mx.fast.precompiled_cuda_kernel, {
        "name": func,
        "compiled_source": blob,
        "output_shapes": args["output_shapes"],
        "output_dtypes": args["output_dtypes"],
        "scalars": [],
        "grid": args["grid"],
        "threadgroup": args["threadgroup"],
        "ensure_row_contiguous": True,  # what cuda_kernel does by default (ours are made with it)
    }


def trellis_spec(variant: str, body: str = "xreg") -> KernelSpec:
    """The CUDA trellis mat-vec (kernels/trellis/matvec.py) as a KernelSpec."""
    from kernels.trellis import matvec

    source, header = matvec.kernel_sources("cuda", variant, body)
    name = "trellis_matvec_" + hashlib.sha1((source + header).encode()).hexdigest()[:12]
    return KernelSpec(name, ("packed", "scales", "x"), ("y",), source, header)


def skinny_spec() -> KernelSpec:
    """The skinny GEMM (kernels/skinny/kernel.py) as a KernelSpec."""
    from kernels.skinny import kernel as sk

    source, header = sk.kernel_source()
    name = "skinny_gemm_" + hashlib.sha1((source + header).encode()).hexdigest()[:12]
    return KernelSpec(name, ("w", "x", "dims"), ("y",), source, header)
