"""y = x~ W~^T for a trellis-quantized matrix: fused GPU kernels and the plain-MLX fallback.

``fused_backend()`` says which fused kernel can run here ("cuda", "metal" or None);
``trellis_matvec`` runs it for up to ``MAX_FUSED_BATCH`` rows of x~ (already rotated),
``matmul_rotated`` picks the fused kernel or the dequantize-then-matmul fallback, and
``fused_decode`` is TrellisLinear's whole small-batch path (sign flip, Hadamard, kernel), through
``mx.compile`` on CUDA (``COMPILED_BACKENDS``).
"""

from __future__ import annotations

import ctypes
import hashlib
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

import mlx.core as mx
import numpy as np

from kernels.common import compile_cpu_library, cpu_compiler, gpu_backend  # noqa: F401 (cpu_compiler: tests)

from . import kernel_source as ks
from .codes import CODES
from .quantizer import TrellisWeight, _device_hadamard_ok, dequantize_rotated, rotate

MAX_FUSED_BATCH = 8
ROWS_PER_GROUP = 16  # smem body: SIMD groups (output rows) per threadgroup, 512 threads share a staged x
METAL_MAX_BATCH = 7  # smem body: 8 staged rows of x (33.8 KB) exceed Metal's 32 KB of threadgroup memory
XREG_MAX_BATCH = 4  # xreg body: x lives in registers (32 * GPL * batch floats a lane)


fused_backend = gpu_backend  # which fused trellis kernel can run here


VARIANTS = {"cuda": ("dp4a", "portable"), "metal": ("portable",)}
_chosen: dict[str, str] = {}


@dataclass(frozen=True)
class LaunchConfig:
    """How a fused call is laid out. body "xreg" (x in registers, batch <= 4) or "smem" (x staged in
    shared memory, any batch). For xreg: GPL groups of 32 columns a lane, RWU rows a chunk, NCH
    chunks a warp, RS warps of rows a threadgroup, DEN the denormal decode (CUDA, 1MAD)."""

    body: str = "xreg"
    gpl: int = 2
    rwu: int = 4
    nch: int = 1
    rs: int = 2
    den: int = 1

    def key(self) -> str:
        if self.body == "smem":
            return "smem"
        return f"xreg-g{self.gpl}-r{self.rwu}x{self.nch}-s{self.rs}-d{self.den}"


SMEM = LaunchConfig(body="smem")
_override: dict[str, LaunchConfig] = {}


def load_tuned(path: Path | str | None = None) -> dict[tuple[int, int, int], LaunchConfig]:
    """Measured winners per (n_out, n_in, batch) on CUDA, as {"NxMxB": {body, gpl, rwu, nch, rs,
    den}} in `path` (default: tuned_cuda.json beside this file, the winners of an H200 sweep)."""
    path = Path(path or Path(__file__).with_name("tuned_cuda.json"))
    if not path.exists():
        return {}
    import json

    table = {}
    for key, cfg in json.loads(path.read_text()).items():
        n_out, n_in, batch = (int(v) for v in key.split("x"))
        table[(n_out, n_in, batch)] = LaunchConfig(**cfg)
    return table


# Other shapes use the heuristic in default_config.
TUNED: dict[tuple[int, int, int], LaunchConfig] = load_tuned()


def warp_columns(n_in: int, gpl: int) -> int:
    return -(-(n_in // 32) // (32 * gpl))


def xreg_fits(config: LaunchConfig, n_in: int, batch: int, bits: int = 4) -> bool:
    """Whether an xreg threadgroup can launch: all WC * RS warps of it must fit the 64K registers
    of one multiprocessor (MLX's kernels carry no launch bounds, so the compiler may take up to 255
    a thread). The estimate follows ptxas on sm_90: x, two sets of words, the sums, ~40 more."""
    threads = 32 * warp_columns(n_in, config.gpl) * config.rs
    regs = 32 * config.gpl * batch + 2 * config.rwu * config.gpl * (bits + 1) + _pow2(config.rwu * batch) + 40
    return threads <= 1024 and threads * min(255, regs) <= 65536 and _pow2(config.rwu * batch) <= 32


def _tuned_fits(cfg: LaunchConfig | None, n_in: int, batch: int, bits: int) -> bool:
    """A tuned layout (swept at 3 bits; the table is keyed by shape and batch only) that still
    launches at these bits: more bits a weight hold more words in registers."""
    return cfg is not None and (cfg.body != "xreg" or xreg_fits(cfg, n_in, batch, bits))


def default_config(n_out: int, n_in: int, batch: int, backend: str, bits: int = 4) -> LaunchConfig:
    """The launch layout for one call: the tuned table first, then a heuristic fitted to the H200
    sweeps (the ones behind tuned_cuda.json). One group of 32 columns a lane, 8 rows
    a chunk at batch 1-2 (4 at batch 3-4), and as many chunks a warp (up to 8: 32-64 rows a warp
    streamed best) as still leave ~512 warps. Rows wider than 8192 (14 warps of a row in one
    threadgroup) take the smem body: measured faster at 4096x14336, and safe on registers."""
    if "all" in _override:
        cfg = _override["all"]
    elif backend == "cuda" and _tuned_fits(TUNED.get((n_out, n_in, batch)), n_in, batch, bits):
        cfg = TUNED[(n_out, n_in, batch)]
    elif batch > XREG_MAX_BATCH or warp_columns(n_in, 1) > 8:
        cfg = SMEM
    else:
        rwu = 8 if batch <= 2 else 4
        wc = warp_columns(n_in, 1)
        nch = max(1, min(8, (n_out * wc) // (512 * rwu)))
        cfg = SMEM
        for rs in (2, 1):
            candidate = LaunchConfig("xreg", 1, rwu, nch, rs, 1)
            if xreg_fits(candidate, n_in, batch, bits):
                cfg = candidate
                break
    if cfg.body == "xreg" and (batch > XREG_MAX_BATCH or backend != "cuda"):
        cfg = replace(cfg, den=0) if batch <= XREG_MAX_BATCH else SMEM
    return cfg


def _pow2(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


def kernel_sources(backend: str, variant: str, body: str = "xreg") -> tuple[str, str]:
    """(source, header) of the fused kernel for a backend; each body is the same text for all."""
    if backend == "cuda":
        header = ks.cuda_header(portable=variant == "portable")
        if body == "xreg":
            return ks.CUDA_XREG_PROLOGUE + ks.BODY_XREG + ks.CUDA_XREG_EPILOGUE, header
        return ks.CUDA_PROLOGUE + ks.BODY + ks.CUDA_EPILOGUE, header
    if backend == "metal":
        if body == "xreg":
            return ks.METAL_XREG_PROLOGUE + ks.BODY_XREG + ks.METAL_XREG_EPILOGUE, ks.METAL_HEADER + ks.METAL_XREG_HEADER
        return ks.METAL_PROLOGUE + ks.BODY + ks.METAL_EPILOGUE, ks.METAL_HEADER
    raise ValueError(f"no fused trellis kernel for backend {backend!r}")


@lru_cache(maxsize=16)
def _kernel(backend: str, variant: str, body: str = "xreg"):
    source, header = kernel_sources(backend, variant, body)
    # The name carries a hash of the text: MLX caches compiled kernels by name (in memory).
    name = "trellis_matvec_" + hashlib.sha1((source + header).encode()).hexdigest()[:12]
    make = mx.fast.cuda_kernel if backend == "cuda" else mx.fast.metal_kernel
    return make(name=name, input_names=["packed", "scales", "x"], output_names=["y"], source=source, header=header)


def kernel_variant(backend: str) -> str:
    """The first variant that compiles and runs here (probed once on a tiny problem)."""
    if backend in _chosen:
        return _chosen[backend]
    errors = []
    for variant in VARIANTS[backend]:
        try:
            x = mx.ones((1, 32), dtype=mx.float32)
            packed = mx.zeros((8, 4), dtype=mx.uint32)
            for cfg in (SMEM, default_config(8, 32, 1, backend)):
                y = _launch(backend, variant, x, packed, mx.ones((8,), dtype=mx.float16), 4, 12, 32, "1mad", cfg)
                mx.eval(y)
            _chosen[backend] = variant
            return variant
        except Exception as exc:  # compile errors surface at eval time
            errors.append(f"{variant}: {exc}")
    raise RuntimeError("no fused trellis kernel variant works here: " + " | ".join(errors))


def kernel_constants(
    n_out: int, n_in: int, batch: int, bits: int, L: int, block: int, code: str, config: LaunchConfig = SMEM
) -> dict[str, int]:
    consts = {
        "K": bits,
        "L": L,
        "TB": block,
        "N_IN": n_in,
        "N_OUT": n_out,
        "BATCH": batch,
        "CODE": CODES.index(code),
    }
    if config.body == "smem":
        consts["ROWS"] = ROWS_PER_GROUP
        return consts
    consts.update(
        GPL=config.gpl,
        RWU=config.rwu,
        NCH=config.nch,
        RS=config.rs,
        WC=warp_columns(n_in, config.gpl),
        NP=_pow2(config.rwu * batch),
        DEN=int(config.den and code == "1mad"),
    )
    if n_out * (n_in * bits // 32) >= 2**31:  # the body indexes the words with 32-bit ints
        raise ValueError(f"{n_out}x{n_in} at {bits} bits is over 2^31 packed words")
    if consts["NP"] > 32:
        raise ValueError(f"rows a chunk x batch must be <= 32, got {config.rwu} x {batch}")
    return consts


def trellis_matvec(
    x_rot: mx.array,
    packed: mx.array,
    scales: mx.array,
    *,
    bits: int,
    L: int,
    block: int,
    code: str = "1mad",
    backend: str | None = None,
    config: LaunchConfig | None = None,
    out_dtype: mx.Dtype | None = None,
) -> mx.array:
    """Fused y (..., n_out) = x_rot (..., n_in) @ W~^T for at most 8 rows of x_rot in all.

    One kernel launch, no reshape or cast around it: any leading shape, output in ``out_dtype``
    (default x_rot's dtype)."""
    backend = backend or fused_backend()
    # dispatch is latency-bound: one dict lookup per call once a shape has been seen
    key = (x_rot.shape, x_rot.dtype, packed.shape, scales.dtype, bits, L, block, code, backend, config, out_dtype)
    hit = _CALLS.get(key)
    if hit is not None:
        return hit[0](inputs=[packed, scales, x_rot], **hit[1])[0]
    if backend is None:
        raise RuntimeError("no GPU backend for the fused trellis kernel")
    n_in = x_rot.shape[-1]
    m = x_rot.size // n_in
    if not 1 <= m <= MAX_FUSED_BATCH:
        raise ValueError(f"fused kernel takes 1..{MAX_FUSED_BATCH} rows, got {m}")
    n_out = int(packed.shape[0])
    cfg = config or default_config(n_out, n_in, m, backend, bits)
    out_dtype = out_dtype or x_rot.dtype
    variant = _chosen.get(backend) or kernel_variant(backend)
    if backend == "metal" and cfg.body == "smem" and m > METAL_MAX_BATCH:
        x2 = x_rot.reshape(m, n_in)
        parts = [x2[: m // 2], x2[m // 2 :]]
        ys = [_launch(backend, variant, p, packed, scales, bits, L, block, code, cfg, out_dtype) for p in parts]
        return mx.concatenate(ys, axis=0).reshape(*x_rot.shape[:-1], n_out)
    y = _launch(backend, variant, x_rot, packed, scales, bits, L, block, code, cfg, out_dtype)
    if len(_CALLS) < 4096:
        args = _launch_args(
            n_out, n_in, m, bits, L, block, code, out_dtype, cfg, tuple(x_rot.shape[:-1]), x_rot.dtype, scales.dtype
        )
        _CALLS[key] = (_kernel(backend, variant, cfg.body), args)
    return y


_CALLS: dict[tuple, tuple] = {}


@lru_cache(maxsize=1024)
def _launch_args(
    n_out: int,
    n_in: int,
    m: int,
    bits: int,
    L: int,
    block: int,
    code: str,
    dtype: mx.Dtype,
    config: LaunchConfig = SMEM,
    lead: tuple[int, ...] | None = None,
    x_dtype: mx.Dtype | None = None,
    scales_dtype: mx.Dtype = mx.float16,
) -> dict:
    """Keyword arguments of one kernel call, built once per shape (dispatch is latency-bound)."""
    consts = kernel_constants(n_out, n_in, m, bits, L, block, code, config)
    if config.body == "smem":
        threads = 32 * ROWS_PER_GROUP
        groups = -(-n_out // ROWS_PER_GROUP)
    else:
        threads = 32 * consts["WC"] * config.rs
        groups = -(-n_out // (config.rs * config.rwu * config.nch))
    return {
        # XT and ST are not used by the source, but MLX names (and caches) a compiled kernel by its
        # template arguments only: the dtypes of x and of the scales must be among them
        "template": [*consts.items(), ("ST", scales_dtype), ("XT", x_dtype or dtype), ("DT", dtype)],
        "grid": (groups * threads, 1, 1),
        "threadgroup": (threads, 1, 1),
        "output_shapes": [(*(lead if lead is not None else (m,)), n_out)],
        "output_dtypes": [dtype],
    }


def _launch(
    backend, variant, x_rot, packed, scales, bits, L, block, code, config: LaunchConfig = SMEM, out_dtype=None
) -> mx.array:
    n_in = x_rot.shape[-1]
    if backend == "cuda" and config.body == "xreg" and not xreg_fits(config, n_in, x_rot.size // n_in, bits):
        # MLX's kernels carry no launch bounds: a threadgroup over the register file does not
        # launch, and y would be left as it was allocated
        raise ValueError(f"layout {config.key()} does not fit one multiprocessor at n_in={n_in}")
    args = _launch_args(
        int(packed.shape[0]), n_in, x_rot.size // n_in, bits, L, block, code,
        out_dtype or x_rot.dtype, config, tuple(x_rot.shape[:-1]), x_rot.dtype, scales.dtype,
    )
    (y,) = _kernel(backend, variant, config.body)(inputs=[packed, scales, x_rot], **args)
    return y


# Backends whose TrellisLinear decode runs through mx.compile: CUDA, where the H200 measured
# 27.4 -> 16.5 us per call at 4096x4096 3-bit batch 1 (MLX replays the traced kernel call, no
# Python or binding work per call; docs/kernels.md). Metal has not been measured.
COMPILED_BACKENDS = frozenset({"cuda"})


def compile_decode(backend: str | None) -> bool:
    """Whether TrellisLinear's fused decode runs through mx.compile on this backend."""
    return backend in COMPILED_BACKENDS


@lru_cache(maxsize=256)
def fused_decode(
    bits: int, L: int, block: int, code: str, backend: str, bias: bool = False, compiled: bool = True, kernel=None
):
    """TrellisLinear's small-batch path as one function of arrays: (x, signs, packed, scales[,
    bias]) -> y in x's dtype, any leading shape with at most MAX_FUSED_BATCH rows. signs float32
    (±1); without bias the kernel writes x's dtype, with bias it writes float32, the bias is
    added in float32 and the sum cast (TrellisLinear's arithmetic before this function existed).

    compiled: through mx.compile (one trace per input shape and dtype; the weights are inputs,
    not captured, so a reload is seen). kernel: what runs the rotated mat-vec, trellis_matvec's
    signature (default trellis_matvec; tests pass a plain-MLX stand-in on the CPU)."""
    # probes that evaluate arrays: run them before the first trace, not inside it
    _device_hadamard_ok()
    if kernel is None and backend not in _chosen:
        kernel_variant(backend)
    kw = {"bits": bits, "L": L, "block": block, "code": code, "backend": backend}

    def matvec(x_rot, packed, scales, out_dtype):
        # trellis_matvec looked up when traced (a bench's --dry-run may swap it for a stand-in)
        return (kernel or trellis_matvec)(x_rot, packed, scales, out_dtype=out_dtype, **kw)

    def decode_bias(x, signs, packed, scales, b):
        y = matvec(rotate(x, signs), packed, scales, mx.float32)
        return (y + b.astype(mx.float32)).astype(x.dtype)

    def decode(x, signs, packed, scales):
        return matvec(rotate(x, signs), packed, scales, x.dtype)

    fn = decode_bias if bias else decode
    return mx.compile(fn) if compiled else fn


def matmul_rotated(x_rot: mx.array, w: TrellisWeight, use_fused: bool | None = None) -> mx.array:
    """x_rot (..., n_in) float -> (..., n_out) float32, fused for small batches on a GPU."""
    lead = x_rot.shape[:-1]
    x2 = x_rot.reshape(-1, x_rot.shape[-1])
    backend = fused_backend()
    if use_fused is None:
        use_fused = backend is not None and x2.shape[0] <= MAX_FUSED_BATCH
    if use_fused:
        y = trellis_matvec(x2, w.packed, w.scales, bits=w.bits, L=w.L, block=w.block, code=w.code, out_dtype=mx.float32)
    else:
        y = x2.astype(mx.float32) @ dequantize_rotated(w).T
    return y.reshape(*lead, -1)


# ---- the shared body on the CPU, compiled with a C++ compiler (for CI without a GPU) ------------


@lru_cache(maxsize=64)
def _cpu_library(source: str) -> ctypes.CDLL:
    return compile_cpu_library(source, "trellis")


def trellis_matvec_cpu_harness(
    x_rot: np.ndarray,
    packed: np.ndarray,
    scales: np.ndarray,
    *,
    bits: int,
    L: int,
    block: int,
    code: str = "1mad",
    config: LaunchConfig = SMEM,
) -> np.ndarray:
    """The fused kernel's shared body run on the CPU, one lane at a time; returns y (M, n_out)."""
    m, n_in = x_rot.shape
    n_out = packed.shape[0]
    consts = kernel_constants(n_out, n_in, m, bits, L, block, code, config)
    if config.body == "xreg":
        lib = _cpu_library(ks.cpu_xreg_harness_source(consts))
        packed_c = np.ascontiguousarray(packed, dtype=np.uint32)
        x_c = np.ascontiguousarray(x_rot, dtype=np.float32)
        partial = np.zeros((n_out, consts["WC"] * 32, m), dtype=np.float32)
        ptr = ctypes.c_void_p
        lib.trellis_xreg_partials(ptr(packed_c.ctypes.data), ptr(x_c.ctypes.data), ptr(partial.ctypes.data))
        norm = np.float32(1.0 / 147.800537109375) if code == "1mad" else np.float32(1.0)
        return (partial.sum(axis=1, dtype=np.float32) * (np.asarray(scales, np.float32) * norm)[:, None]).T
    lib = _cpu_library(ks.cpu_harness_source(consts))
    packed_c = np.ascontiguousarray(packed, dtype=np.uint32)
    scales_c = np.ascontiguousarray(scales, dtype=np.float32)
    x_c = np.ascontiguousarray(x_rot, dtype=np.float32)
    partial = np.zeros((n_out, 32, m), dtype=np.float32)
    ptr = ctypes.c_void_p
    lib.trellis_lane_partials(
        ptr(packed_c.ctypes.data), ptr(scales_c.ctypes.data), ptr(x_c.ctypes.data), ptr(partial.ctypes.data)
    )
    return partial.sum(axis=1).T
