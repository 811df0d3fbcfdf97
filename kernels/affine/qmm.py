"""x @ W.T for MLX affine-quantized W and 1..MAX_ROWS rows of x: a fused CUDA kernel and its twin.

``affine_qmm`` launches the kernel of source.py (CUDA only) with a layout from ``pick_config``:
the measured winner in tuned_cuda.json for the nearest swept shape class (written by
``python -m bench qmm --sweep``), else a default. ``takes`` says whether the kernel applies to
a call; ``twin`` is MLX's ``mx.quantized_matmul``, the reference. Which calls take the kernel
in a model is decided in linear.py (``ROUTE``).

Float32 activations always take one layout (``FLOAT32``), whatever the row count: a row's sums
are then added in the same order whether it is alone or in a batch (the exact tier).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from kernels.common import gpu_backend

from . import source as src

MAX_ROWS = 16
BITS = (4, 8)
GROUPS = (32, 64, 128)
_DTYPES = {mx.bfloat16: "bfloat16", mx.float16: "float16", mx.float32: "float32"}
TUNED_PATH = Path(__file__).with_name("tuned_cuda.json")


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    """How a call is laid out. body "mma" (16-bit activations; tensor cores) or "mma4" (the same,
    4 bits, weights dequantized in 16-bit pairs): ``tile`` tiles of 8 output rows a warp; body
    "simt" (any dtype): ``tile`` output rows a warp. ``wpb`` warps a
    block split K; ``unroll`` iterations of 16-byte weight loads are issued before any is used."""

    body: str = "mma"
    tile: int = 2
    wpb: int = 4
    unroll: int = 2

    def key(self) -> str:
        return f"{self.body}-t{self.tile}-w{self.wpb}-u{self.unroll}"

    @staticmethod
    def parse(key: str) -> LaunchConfig:
        body, t, w, u = key.split("-")
        return LaunchConfig(body, int(t[1:]), int(w[1:]), int(u[1:]))


FLOAT32 = LaunchConfig("simt", 2, 4, 2)


def candidates(dtype: mx.Dtype, rows: int, bits: int = 4) -> list[LaunchConfig]:
    """The layouts a sweep tries for this activation dtype, row count and bits."""
    if dtype == mx.float32:
        return [FLOAT32]
    bodies = ("mma", "mma4") if bits == 4 else ("mma",)
    out = [LaunchConfig(b, t, w, u) for b in bodies for t in (1, 2, 4) for w in (2, 4, 8) for u in (1, 2)]
    if rows <= 2:  # the float32 body: at one or two rows the tensor cores are mostly idle padding
        out += [LaunchConfig("simt", r, w, 2) for r, w in ((1, 4), (2, 4), (4, 2), (2, 8))]
    return out


def shape_key(bits: int, group: int, dtype: mx.Dtype, n: int, k: int, rows: int) -> str:
    return f"b{bits}-g{group}-{_DTYPES[dtype]}-{n}x{k}-m{rows}"


def load_tuned(path: Path | str | None = None) -> dict[str, LaunchConfig]:
    """{shape_key: layout} from a sweep's JSON ({"key": "mma-t2-w4-u2", ...}); {} when absent."""
    p = Path(path) if path is not None else TUNED_PATH
    if not p.exists():
        return {}
    return {key: LaunchConfig.parse(value) for key, value in json.loads(p.read_text()).items()}


TUNED: dict[str, LaunchConfig] = load_tuned()


def pick_config(bits: int, group: int, dtype: mx.Dtype, n: int, k: int, rows: int) -> LaunchConfig:
    """The tuned layout of the smallest swept row count >= rows for this exact shape, bits,
    group and dtype; the default layout for shapes never swept."""
    if dtype == mx.float32:
        return FLOAT32
    for m in range(rows, MAX_ROWS + 1):
        hit = TUNED.get(shape_key(bits, group, dtype, n, k, m))
        if hit is not None:
            return hit
    return default_config(n, k, bits)


TARGET_WARPS = 4096  # ~half the H200's resident warps (132 SMs x 64): enough loads in flight


def default_config(n: int, k: int, bits: int) -> LaunchConfig:
    """The mma layout for a shape never swept: one tile of 8 rows a warp, loads two iterations
    deep, and as many warps splitting K as bring the grid to ~TARGET_WARPS warps (at most 8, and
    no more than leave each warp two iterations)."""
    blocks = -(-n // 8)
    iters = -(-k // (16 * (32 // bits)))  # an iteration: 4 lanes x one uint4 of a row
    wpb = 1
    while wpb < 8 and blocks * wpb < TARGET_WARPS and iters >= 4 * (2 * wpb):
        wpb *= 2
    return LaunchConfig("mma", 1, wpb, 2)


def _pow2(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


def constants(config: LaunchConfig, rows: int, bits: int) -> dict[str, int]:
    """The body's template constants (besides T) for one call. Shapes and the group are read at
    run time; the mma body compiles once for 1..8 rows and once for 9..16."""
    consts = {"BITS": bits, "WPB": config.wpb, "U": config.unroll}
    if config.body in ("mma", "mma4"):
        consts.update(M16=int(rows > 8), NT=config.tile)
    else:
        nv = rows * config.tile
        consts.update(M=rows, RPW=config.tile, NV=nv, NP=min(32, _pow2(nv)))
    return consts


def launch_dims(config: LaunchConfig, n: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(grid in threads, threadgroup) for n output rows."""
    per_block = config.tile if config.body == "simt" else 8 * config.tile
    threads = 32 * config.wpb
    return (-(-n // per_block) * threads, 1, 1), (threads, 1, 1)


@lru_cache(maxsize=8)
def _kernel(body: str) -> Any:
    text, header = src.compact(src.BODIES[body]), src.compact(src.HEADERS[body])
    # the name carries a hash of the text: MLX caches compiled kernels by name (in memory)
    name = f"affine_qmm_{body}_" + hashlib.sha1((text + header).encode()).hexdigest()[:12]
    return mx.fast.cuda_kernel(
        name=name,
        input_names=list(src.INPUT_NAMES),
        output_names=list(src.OUTPUT_NAMES),
        source=text,
        header=header,
    )


def check_shapes(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, bits: int, group: int) -> None:
    """Raise ValueError unless the kernel can run this call."""
    if bits not in BITS or group not in GROUPS:
        raise ValueError(f"the kernel takes bits {BITS} and groups {GROUPS}, got {bits}, {group}")
    if x.dtype not in _DTYPES or scales.dtype != x.dtype or biases.dtype != x.dtype:
        raise ValueError(f"x, scales and biases must share a float dtype, got {x.dtype}, {scales.dtype}, {biases.dtype}")
    k = x.shape[-1]
    n = w.shape[0]
    if w.dtype != mx.uint32 or w.ndim != 2 or w.shape[1] * 32 // bits != k or k % group:
        raise ValueError(f"w {w.shape} {w.dtype} does not hold {k} columns at {bits} bits")
    if scales.shape != (n, k // group) or biases.shape != scales.shape:
        raise ValueError(f"scales/biases must be {(n, k // group)}, got {scales.shape}, {biases.shape}")
    rows = x.size // k
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"the kernel takes 1..{MAX_ROWS} rows, got {rows}")


_CALLS: dict[tuple, tuple[Any, dict[str, Any]]] = {}


def affine_qmm(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    *,
    bits: int,
    group: int,
    config: LaunchConfig | None = None,
) -> mx.array:
    """y (..., N) = x (..., K) @ dequantize(w, scales, biases).T in one CUDA launch, y in x's dtype.
    At most MAX_ROWS rows of x in all (leading dims flattened)."""
    key = (x.shape, x.dtype, w.shape, scales.dtype, biases.dtype, bits, group, config)
    hit = _CALLS.get(key)
    if hit is None:
        check_shapes(x, w, scales, biases, bits, group)
        k = x.shape[-1]
        n = int(w.shape[0])
        rows = x.size // k
        cfg = config or pick_config(bits, group, x.dtype, n, k, rows)
        if cfg.body != "simt" and x.dtype == mx.float32:
            raise ValueError(f"the {cfg.body} body takes 16-bit activations only")
        if cfg.body == "mma4" and bits != 4:
            raise ValueError("the mma4 body takes 4-bit weights only")
        grid, threadgroup = launch_dims(cfg, n)
        args = {
            "template": [("T", x.dtype), *constants(cfg, rows, bits).items()],
            "grid": grid,
            "threadgroup": threadgroup,
            "output_shapes": [(*x.shape[:-1], n)],
            "output_dtypes": [x.dtype],
        }
        hit = (_kernel(cfg.body), args)
        if len(_CALLS) < 4096:
            _CALLS[key] = hit
    return hit[0](inputs=[w, scales, biases, x], **hit[1])[0]


def twin(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, *, bits: int, group: int) -> mx.array:
    """MLX's own quantized matmul: the reference, and the path off CUDA."""
    return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group, bits=bits)


ANY_DEVICE = False  # tests: let `takes` answer yes without a CUDA device (the twin then runs)


def takes(x: mx.array, w: mx.array, scales: mx.array, bits: int, group: int) -> bool:
    """Whether x @ W.T goes through the fused kernel: CUDA, 1..MAX_ROWS rows in all, a
    supported bits / group, and x and the scales in the same float dtype."""
    if x.ndim == 0 or bits not in BITS or group not in GROUPS or x.dtype not in _DTYPES:
        return False
    k = x.shape[-1]
    if k == 0 or k % group or w.ndim != 2 or w.shape[1] * 32 // bits != k or scales.dtype != x.dtype:
        return False
    return 1 <= x.size // k <= MAX_ROWS and (ANY_DEVICE or gpu_backend() == "cuda")


# ---- references on the host (numpy), with the kernel's indexing -----------------------------


def dequantize_np(w: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int, group: int) -> np.ndarray:
    """W_hat [N, K] float32 from packed words the way the kernel reads them: column k of row n
    is bits (k % (32/bits)) * bits.. of word k // (32/bits); its group is k // group."""
    epw = 32 // bits
    n, kw = w.shape
    k = kw * epw
    cols = np.arange(k)
    words = w[:, cols // epw].astype(np.uint64)
    q = ((words >> ((cols % epw) * bits).astype(np.uint64)) & ((1 << bits) - 1)).astype(np.float32)
    g = cols // group
    return np.asarray(scales, np.float32)[:, g] * q + np.asarray(biases, np.float32)[:, g]


def _step_columns(body: str, kb: int, s: int) -> np.ndarray:
    """Columns of lane's k-slots (2t, 2t+1, 2t+8, 2t+9) at step s: the mma body takes kb + 4s ..
    kb + 4s + 3 in order; mma4 takes pairs (i, i + 4) of word s // 2's eight columns."""
    if body == "mma":
        return kb + 4 * s + np.arange(4)
    c0 = kb + 8 * (s // 2)
    i = 2 * (s % 2)
    return np.array([c0 + i, c0 + i + 4, c0 + i + 1, c0 + i + 5])


def mma_emulate_np(x: np.ndarray, w_hat: np.ndarray, bits: int, body: str = "mma") -> np.ndarray:
    """The mma body's data movement, lane by lane, with the PTX fragment layouts of
    mma.m16n8k16 (A row-major 16x16: a0 (g, 2t..), a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8,
    2t+8..); B col-major 16x8: b0 (k 2t.., n g), b1 (k 2t+8.., n g); C: c0,c1 (g, 2t..), c2,c3
    (g+8, 2t..)). Checks the body's claim that its column order is the same for A and B."""
    m_rows, k = x.shape
    n = w_hat.shape[0]
    epl = 4 * (32 // bits)
    kstep = 4 * epl
    y = np.zeros((m_rows, n), np.float64)
    for n0 in range(0, n, 8):
        c = np.zeros((32, 4))
        for it in range(-(-k // kstep)):
            for s in range(epl // 4):
                a = np.zeros((32, 4, 2))  # lane, register, element
                b = np.zeros((32, 2, 2))
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    kb = it * kstep + t * epl
                    if kb >= k:
                        continue
                    cols = _step_columns(body, kb, s)
                    if g < m_rows:
                        a[lane, 0], a[lane, 2] = x[g, cols[:2]], x[g, cols[2:]]
                    if g + 8 < m_rows:
                        a[lane, 1], a[lane, 3] = x[g + 8, cols[:2]], x[g + 8, cols[2:]]
                    if n0 + g < n:
                        b[lane, 0], b[lane, 1] = w_hat[n0 + g, cols[:2]], w_hat[n0 + g, cols[2:]]
                # the mma, from the fragment definitions
                A = np.zeros((16, 16))
                B = np.zeros((16, 8))
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    for e in range(2):
                        A[g, 2 * t + e], A[g + 8, 2 * t + e] = a[lane, 0, e], a[lane, 1, e]
                        A[g, 2 * t + 8 + e], A[g + 8, 2 * t + 8 + e] = a[lane, 2, e], a[lane, 3, e]
                        B[2 * t + e, g], B[2 * t + 8 + e, g] = b[lane, 0, e], b[lane, 1, e]
                D = A @ B
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    c[lane] += [D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1]]
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            for i in range(4):
                m = g + (8 if i >= 2 else 0)
                col = n0 + 2 * t + (i & 1)
                if m < m_rows and col < n:
                    y[m, col] = c[lane, i]
    return y

