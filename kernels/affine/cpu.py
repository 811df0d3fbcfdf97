"""x @ W.T for MLX affine-quantized W and a few float32 rows of x on the CPU, in C++ threads.

MLX's CPU `quantized_matmul` (0.32.4) dequantizes every weight in scalar code on one thread: one
row of x against a 4-bit 8192×2048 weight takes 10.3 ms on the 2-core x86 CI machine, 0.8 GB/s of
packed weights, where the memory delivers ten times that. `qmm` computes the same product with
each group of a weight row dequantized once into float32 and then dotted with every row of x
(loops the compiler vectorises), the weight's rows split over one thread per core.

Arithmetic, per output element: for each group g, `scale[g] * sum_k(x_k * q_k) + bias[g] *
sum_k(x_k)`, summed over the groups in order, in float32. That rounds differently from MLX's
kernel (a bounded difference, tested against `mx.quantized_matmul`), and a row's result does not
depend on the other rows of x or on how the weight's rows are split over threads, so a row
alone and in a batch get the same bits (the engine's exact tier).

The source is compiled once per machine with the system C++ compiler (`g++`/`clang++`, or
`CXX`) into the temp directory; without a compiler `available()` is false and the caller keeps
MLX's kernel. x is evaluated for the call (a synchronisation, as `kernels.cpu` does for
attention): inside `mx.compile` or `mx.vmap`, where nothing can be evaluated, `qmm` answers None.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from typing import Any

import mlx.core as mx
import numpy as np

from kernels.common import compile_cpu_library, cpu_compiler
from kernels.cpu import InTransform, evaluate

log = logging.getLogger("mlxd.kernels")

MAX_ROWS = 127  # from 128 rows the dense path (linear.DEQUANTIZE_ROWS["cpu"]) is as fast
BITS = (2, 4, 8)
GROUPS = (32, 64, 128)

SOURCE = r"""
#include <cstdint>
#include <thread>
#include <vector>

namespace {

// One group of a weight row is WPG packed words of PER values. It is dequantized as
// q[j * WPG + i] = value j of word i (one shift for all words at once: vector code), and x is
// handed over in the same order (`permute`), so the dot is over contiguous arrays.
template <int BITS, int G>
void block(const float* xp, const float* xs, int R, const uint32_t* w, const float* s,
           const float* b, float* y, int N, int K, int n0, int n1) {
  constexpr int PER = 32 / BITS, WPG = G / PER;
  constexpr uint32_t MASK = (1u << BITS) - 1u;
  const int words = K / PER, groups = K / G;
  std::vector<float> acc((size_t)R * 8), bacc(R);
  alignas(64) float q[G];
  for (int n = n0; n < n1; ++n) {
    const uint32_t* wn = w + (size_t)n * words;
    const float* sn = s + (size_t)n * groups;
    const float* bn = b + (size_t)n * groups;
    for (int i = 0; i < R * 8; ++i) acc[i] = 0.0f;
    for (int r = 0; r < R; ++r) bacc[r] = 0.0f;
    for (int g = 0; g < groups; ++g) {
      const uint32_t* wg = wn + (size_t)g * WPG;
      for (int j = 0; j < PER; ++j)
        for (int i = 0; i < WPG; ++i) q[j * WPG + i] = (float)((wg[i] >> (j * BITS)) & MASK);
      const float sc = sn[g], bi = bn[g];
      for (int r = 0; r < R; ++r) {
        const float* xr = xp + (size_t)r * K + (size_t)g * G;
        float lane[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        for (int k = 0; k < G; k += 8)
          for (int l = 0; l < 8; ++l) lane[l] += xr[k + l] * q[k + l];
        float* ar = acc.data() + (size_t)r * 8;
        for (int l = 0; l < 8; ++l) ar[l] += sc * lane[l];
        bacc[r] += bi * xs[(size_t)r * groups + g];
      }
    }
    for (int r = 0; r < R; ++r) {
      const float* ar = acc.data() + (size_t)r * 8;
      y[(size_t)r * N + n] =
          (((ar[0] + ar[1]) + (ar[2] + ar[3])) + ((ar[4] + ar[5]) + (ar[6] + ar[7]))) + bacc[r];
    }
  }
}

template <int BITS, int G>
void run(const float* x, int R, const uint32_t* w, const float* s, const float* b, float* y,
         int N, int K, int threads) {
  constexpr int PER = 32 / BITS, WPG = G / PER;
  const int groups = K / G;
  std::vector<float> xp((size_t)R * K), xs((size_t)R * groups);
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < groups; ++g) {
      const float* xg = x + (size_t)r * K + (size_t)g * G;
      float* pg = xp.data() + (size_t)r * K + (size_t)g * G;
      float t = 0.0f;
      for (int k = 0; k < G; ++k) t += xg[k];
      xs[(size_t)r * groups + g] = t;
      for (int i = 0; i < WPG; ++i)
        for (int j = 0; j < PER; ++j) pg[j * WPG + i] = xg[i * PER + j];
    }
  if (threads < 1) threads = 1;
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) {
    const int n0 = (int)((long long)N * t / threads), n1 = (int)((long long)N * (t + 1) / threads);
    pool.emplace_back(block<BITS, G>, xp.data(), xs.data(), R, w, s, b, y, N, K, n0, n1);
  }
  block<BITS, G>(xp.data(), xs.data(), R, w, s, b, y, N, K, 0, (int)((long long)N / threads));
  for (auto& th : pool) th.join();
}

template <int BITS>
int by_group(const float* x, int R, const uint32_t* w, const float* s, const float* b, float* y,
             int N, int K, int G, int threads) {
  switch (G) {
    case 32: run<BITS, 32>(x, R, w, s, b, y, N, K, threads); return 0;
    case 64: run<BITS, 64>(x, R, w, s, b, y, N, K, threads); return 0;
    case 128: run<BITS, 128>(x, R, w, s, b, y, N, K, threads); return 0;
    default: return 1;
  }
}

}  // namespace

extern "C" int affine_qmm_f32(const float* x, int R, const uint32_t* w, const float* s,
                              const float* b, float* y, int N, int K, int G, int bits,
                              int threads) {
  switch (bits) {
    case 2: return by_group<2>(x, R, w, s, b, y, N, K, G, threads);
    case 4: return by_group<4>(x, R, w, s, b, y, N, K, G, threads);
    case 8: return by_group<8>(x, R, w, s, b, y, N, K, G, threads);
    default: return 1;
  }
}
"""

FLAGS = ("-O3", "-march=native", "-pthread")
_LIB: list[Any] = []
_LOCK = threading.Lock()


def _library() -> Any | None:
    """The compiled library (built on first use), or None without a compiler or when the build
    failed (logged once)."""
    with _LOCK:
        if not _LIB:
            lib = None
            if cpu_compiler() is not None:
                try:
                    lib = compile_cpu_library(SOURCE, "affine-qmm", FLAGS)
                    fn = lib.affine_qmm_f32
                    fn.restype = ctypes.c_int
                    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                   ctypes.c_int, ctypes.c_int, ctypes.c_int]
                except Exception as exc:  # noqa: BLE001 (no usable compiler: MLX's kernel stays)
                    log.warning("the CPU quantized-matmul kernel did not build (%s); MLX's is used", exc)
                    lib = None
            _LIB.append(lib)
        return _LIB[0]


def available() -> bool:
    """Whether `qmm` can run here (a C++ compiler built the kernel)."""
    return _library() is not None


def threads() -> int:
    """Threads a call uses: one per core, at most 8."""
    return max(1, min(os.cpu_count() or 1, 8))


def takes(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None, bits: int,
          group: int) -> bool:
    """Whether `qmm` computes this call: float32 x, scales and biases, 1..MAX_ROWS rows, a
    supported bits / group, K a multiple of the group."""
    if biases is None or x.dtype != mx.float32 or scales.dtype != mx.float32 or biases.dtype != mx.float32:
        return False
    if bits not in BITS or group not in GROUPS or x.ndim == 0 or w.ndim != 2:
        return False
    k = x.shape[-1]
    if not k or k % group or w.shape[1] * 32 // bits != k:
        return False
    return 1 <= x.size // k <= MAX_ROWS


def qmm(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, bits: int,
        group: int) -> mx.array | None:
    """x @ dequantize(w, scales, biases).T for a call `takes` accepts; None when the kernel is
    not available or x cannot be evaluated here (a transformation is tracing the call)."""
    lib = _library()
    if lib is None:
        return None
    try:
        evaluate(x, w, scales, biases)
    except InTransform:
        return None
    k, n = x.shape[-1], w.shape[0]
    rows = x.size // k
    xn = np.ascontiguousarray(np.asarray(x, dtype=np.float32).reshape(rows, k))
    wn, sn, bn = np.asarray(w), np.asarray(scales), np.asarray(biases)
    if not (wn.flags.c_contiguous and sn.flags.c_contiguous and bn.flags.c_contiguous):
        wn, sn, bn = (np.ascontiguousarray(a) for a in (wn, sn, bn))
    out = np.empty((rows, n), dtype=np.float32)
    err = lib.affine_qmm_f32(xn.ctypes.data, rows, wn.ctypes.data, sn.ctypes.data, bn.ctypes.data,
                             out.ctypes.data, n, k, group, bits, threads())
    if err:
        return None
    return mx.array(out).reshape(*x.shape[:-1], n)
