"""Decode attention over a batch whose rows hold different numbers of keys (CUDA).

A decode step of a batched server has one query per row, and each row's keys are its own
length: columns `[0, lens[b])` of row b's KV buffer. MLX's fused attention kernels take no
per-row length, so the engine's layouts pass a boolean mask, and on MLX-CUDA (0.32.4) a
one-query call with an array mask is not fused at all: it runs as a matmul, a masked softmax and
a second matmul, ~10x the fused cost at long contexts (H200, bf16, 16 layers of Llama-3.2-1B's
attention, 32 query and 8 KV heads of 64: 21.5 ms for 16 rows over ~6k-8k keys, 144 ms for 64
rows over ~12k-16k, against 2.3 ms and 14.3 ms here). Metal's fused vector kernel takes the mask,
so this kernel is CUDA's only.

`decode_attention(q, k, v, lens, scale)` is flash-decoding (split-K) in two launches:

* pass 1, a block per (split s, KV head, row): the block's warps walk the keys of
  `[s * SPLIT, min((s + 1) * SPLIT, lens[b]))`, `D / 8` lanes per key (one 16-byte load of 8
  dims of k and of v per lane), `32 / (D / 8)` keys per warp at a time; every query head of the
  KV head's group (G = query heads / KV heads, GQA) is scored against the same loaded key, the
  dot reduced over the key's lanes by xor shuffles, with an online softmax (base 2, the scale
  folded into q) per (key slot, head). The block's key slots are combined in shared memory
  into one (max, sum, unnormalised output) per head for the split, in float32.
* pass 2, a thread per (row, query head, dim): the splits' partials combined, divided by the
  sum (0 for a row with no keys), in q's dtype.

k and v are read through their strides (the layouts hand over a slice of a wider buffer, which a
contiguous copy would cost a whole extra read and write of). The split size is chosen so that
there are enough blocks for the GPU (`split_for`). Sums are float32 throughout; the result
differs from the masked reference by bf16/fp16 rounding only (tests/test_decode_attention.py,
on a GPU; on a CPU the same bodies run through g++ behind `CPU_PRELUDE`, `cpu_harness_source`).
"""

from __future__ import annotations

import hashlib
import math
from functools import lru_cache
from typing import Any

import mlx.core as mx

HEAD_DIMS = (64, 128)  # D / 8 lanes per key must divide a warp
MAX_GROUP = 8  # query heads per KV head (registers: 2 x 8 x G floats a lane)
DTYPES = (mx.float16, mx.bfloat16)
WARPS = 4  # warps per pass-1 block
MIN_BLOCKS = 528  # ~4 blocks per SM of an H200 (132 SMs): smaller splits below that
SPLITS = (1024, 256)  # keys per pass-1 block; each is its own build (seconds on first use)

PASS1 = r"""
constexpr int LPK = D / 8;
constexpr int KPW = 32 / LPK;
constexpr int NSUB = WPB * KPW;
const int s = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
const int S = gridDim.x, Hkv = gridDim.y;
const int Hq = Hkv * G;
const int tid = threadIdx.x, w = tid / 32, lane = tid % 32;
const int sub = lane / LPK, dl = lane % LPK;
const int slot = w * KPW + sub;
const int len = lens[b];
const int start = s * SPLIT;
const int end = min(start + SPLIT, len);
const float sc = scale[0] * 1.4426950408889634f;
float qf[G][8];
#pragma unroll
for (int g = 0; g < G; ++g) {
  const T* qp = q + ((size_t)(b * Hq + hk * G + g) * D) + dl * 8;
  #pragma unroll
  for (int i = 0; i < 8; ++i) qf[g][i] = static_cast<float>(qp[i]) * sc;
}
float m[G], l[G], o[G][8];
#pragma unroll
for (int g = 0; g < G; ++g) { m[g] = -INFINITY; l[g] = 0.f;
  #pragma unroll
  for (int i = 0; i < 8; ++i) o[g][i] = 0.f; }
const T* kb = k + (size_t)b * k_strides[0] + (size_t)hk * k_strides[1] + dl * 8;
const T* vb = v + (size_t)b * v_strides[0] + (size_t)hk * v_strides[1] + dl * 8;
const int64_t ks2 = k_strides[2], vs2 = v_strides[2];
const int n_iter = end > start ? (end - start + NSUB - 1) / NSUB : 0;
for (int it = 0; it < n_iter; ++it) {
  const int j = start + it * NSUB + slot;
  const bool ok = j < end;
  uint4 ku = make_uint4(0u, 0u, 0u, 0u), vu = make_uint4(0u, 0u, 0u, 0u);
  if (ok) {
    ku = *reinterpret_cast<const uint4*>(kb + j * ks2);
    vu = *reinterpret_cast<const uint4*>(vb + j * vs2);
  }
  const T* ke = reinterpret_cast<const T*>(&ku);
  const T* ve = reinterpret_cast<const T*>(&vu);
  float kf[8], vf[8];
  #pragma unroll
  for (int i = 0; i < 8; ++i) { kf[i] = static_cast<float>(ke[i]); vf[i] = static_cast<float>(ve[i]); }
  #pragma unroll
  for (int g = 0; g < G; ++g) {
    float p = 0.f;
    #pragma unroll
    for (int i = 0; i < 8; ++i) p += qf[g][i] * kf[i];
    #pragma unroll
    for (int off = LPK / 2; off > 0; off >>= 1) p += __shfl_xor_sync(0xffffffffu, p, off);
    if (ok) {
      const float mn = fmaxf(m[g], p);
      const float c = exp2f(m[g] - mn), e = exp2f(p - mn);
      l[g] = l[g] * c + e;
      #pragma unroll
      for (int i = 0; i < 8; ++i) o[g][i] = o[g][i] * c + e * vf[i];
      m[g] = mn;
    }
  }
}
__shared__ float sm_m[NSUB][G];
__shared__ float sm_l[NSUB][G];
__shared__ float sm_o[NSUB][G][D];
#pragma unroll
for (int g = 0; g < G; ++g) {
  if (dl == 0) { sm_m[slot][g] = m[g]; sm_l[slot][g] = l[g]; }
  #pragma unroll
  for (int i = 0; i < 8; ++i) sm_o[slot][g][dl * 8 + i] = o[g][i];
}
__syncthreads();
for (int e = tid; e < G * D; e += WPB * 32) {
  const int g = e / D, d = e % D;
  float M = -INFINITY;
  for (int t = 0; t < NSUB; ++t) M = fmaxf(M, sm_m[t][g]);
  float L = 0.f, O = 0.f;
  for (int t = 0; t < NSUB; ++t) {
    const float f = sm_m[t][g] == -INFINITY ? 0.f : exp2f(sm_m[t][g] - M);
    L += sm_l[t][g] * f; O += sm_o[t][g][d] * f;
  }
  const size_t base = ((size_t)(b * Hq + hk * G + g)) * S + s;
  po[base * D + d] = O;
  if (d == 0) { pm[base] = M; pl[base] = L; }
}
"""

PASS2 = r"""
const int S = pm_shape[2];
const size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
const size_t bh = idx / D;
const int d = idx % D;
float M = -INFINITY;
for (int s = 0; s < S; ++s) M = fmaxf(M, pm[bh * S + s]);
float L = 0.f, O = 0.f;
for (int s = 0; s < S; ++s) {
  const float ms = pm[bh * S + s];
  const float f = ms == -INFINITY ? 0.f : exp2f(ms - M);
  L += pl[bh * S + s] * f; O += po[(bh * S + s) * D + d] * f;
}
out[idx] = static_cast<T>(L > 0.f ? O / L : 0.f);
"""


def _name(kind: str, text: str) -> str:
    # MLX caches compiled kernels by name: the name carries a hash of the text
    return f"mlxd_decode_attn_{kind}_" + hashlib.sha1(text.encode()).hexdigest()[:12]


@lru_cache(maxsize=1)
def _kernels() -> tuple[Any, Any]:
    p1 = mx.fast.cuda_kernel(name=_name("p1", PASS1), input_names=["q", "k", "v", "lens", "scale"],
                             output_names=["po", "pm", "pl"], source=PASS1,
                             ensure_row_contiguous=False)
    p2 = mx.fast.cuda_kernel(name=_name("p2", PASS2), input_names=["po", "pm", "pl"],
                             output_names=["out"], source=PASS2)
    return p1, p2


def takes(q: mx.array, k: mx.array, v: mx.array) -> bool:
    """Whether the kernel computes this call: one query per row, q `[B, Hq, 1, D]` row
    contiguous, k and v `[B, Hkv, C, D]` with unit stride in D, D 64 or 128, a GQA group of at
    most `MAX_GROUP`, float16 or bfloat16 throughout."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or q.shape[2] != 1:
        return False
    B, Hq, _, D = q.shape
    Hkv = k.shape[1]
    return (D in HEAD_DIMS and k.shape[3] == D and v.shape[3] == D and k.shape[0] == B
            and v.shape[:3] == k.shape[:3] and Hkv > 0 and Hq % Hkv == 0
            and Hq // Hkv <= MAX_GROUP and q.dtype in DTYPES and k.dtype == q.dtype
            and v.dtype == q.dtype)


def split_for(rows: int, kv_heads: int, max_len: int) -> int:
    """Keys per pass-1 block: the largest of `SPLITS` that still gives `MIN_BLOCKS` blocks."""
    for split in SPLITS:
        if rows * kv_heads * math.ceil(max_len / split) >= MIN_BLOCKS:
            return split
    return SPLITS[-1]


_BUILT: set[tuple[Any, int, int, int]] = set()  # (dtype, D, Hq, Hkv) whose kernels are built


def _build_all(dtype: Any, D: int, Hq: int, Hkv: int) -> None:
    """Build every split's kernel for this head layout at once, on the first call that needs
    one (the engine's warm-up runs such a call): MLX-CUDA compiles a custom kernel per template
    on first use, seconds each, which would otherwise stall a serving step whenever the batch's
    lengths first pick another split."""
    _BUILT.add((dtype, D, Hq, Hkv))
    q = mx.zeros((1, Hq, 1, D), dtype=dtype)
    k = mx.zeros((1, Hkv, 1, D), dtype=dtype)
    lens = mx.array([1], dtype=mx.int32)
    mx.eval([_run(q, k, k, lens, 1.0, 1, split) for split in SPLITS])


def decode_attention(q: mx.array, k: mx.array, v: mx.array, lens: mx.array, scale: float,
                     max_len: int | None = None) -> mx.array:
    """softmax(q k^T * scale) v over columns `[0, lens[b])` of row b, `[B, Hq, 1, D]` in q's
    dtype. `lens` int32 `[B]`; `max_len` (default k's columns) bounds them all."""
    B, Hq, _, D = q.shape
    Hkv = k.shape[1]
    if (q.dtype, D, Hq, Hkv) not in _BUILT:
        _build_all(q.dtype, D, Hq, Hkv)
    limit = int(k.shape[2]) if max_len is None else max_len
    return _run(q, k, v, lens, scale, limit, split_for(B, Hkv, limit))


def _run(q: mx.array, k: mx.array, v: mx.array, lens: mx.array, scale: float, limit: int,
         split: int) -> mx.array:
    B, Hq, _, D = q.shape
    Hkv = k.shape[1]
    S = max(1, math.ceil(limit / split))
    p1, p2 = _kernels()
    po, pm, pl = p1(
        inputs=[q, k, v, lens, mx.array([scale], dtype=mx.float32)],
        template=[("T", q.dtype), ("D", D), ("G", Hq // Hkv), ("SPLIT", split), ("WPB", WARPS)],
        grid=(S * WARPS * 32, Hkv, B), threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[(B, Hq, S, D), (B, Hq, S), (B, Hq, S)],
        output_dtypes=[mx.float32] * 3,
    )
    (out,) = p2(inputs=[po, pm, pl], template=[("T", q.dtype), ("D", D)],
                grid=(B * Hq * D, 1, 1), threadgroup=(D, 1, 1),
                output_shapes=[(B, Hq, 1, D)], output_dtypes=[q.dtype])
    return out


def twin(q: mx.array, k: mx.array, v: mx.array, lens: Any, scale: float) -> mx.array:
    """The same attention through MLX's masked fused call (the reference; any device)."""
    C = int(k.shape[2])
    mask = mx.arange(C)[None, :] < mx.array(lens).astype(mx.int32)[:, None]
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask[:, None, None, :])


# ---- C++ (CPU check of the same bodies) -------------------------------------------------------
CPU_PRELUDE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>
struct uint4 { unsigned x, y, z, w; };
static inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
struct bf16 {  // bfloat16: the top half of a float32 (rounded to nearest even on the way in)
    uint16_t bits;
    bf16() = default;
    explicit bf16(float f) { uint32_t u; memcpy(&u, &f, 4); bits = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16); }
    operator float() const { uint32_t u = (uint32_t)bits << 16; float f; memcpy(&f, &u, 4); return f; }
};
struct dim3_ { unsigned x, y, z; };
static thread_local dim3_ threadIdx, blockIdx;
static dim3_ gridDim, blockDim;
struct Barrier {  // every thread of the block, in order: __syncthreads and each shuffle
    std::mutex m; std::condition_variable cv; int n = 0, count = 0, gen = 0;
    void wait() {
        std::unique_lock<std::mutex> l(m);
        const int g = gen;
        if (++count == n) { count = 0; ++gen; cv.notify_all(); }
        else cv.wait(l, [&] { return gen != g; });
    }
};
static Barrier g_bar;
static float g_lanes[1024];
static inline void __syncthreads() { g_bar.wait(); }
static inline float __shfl_xor_sync(unsigned, float v, int off) {
    const int t = (int)threadIdx.x;
    g_lanes[t] = v;
    g_bar.wait();
    const float r = g_lanes[(t & ~31) | ((t & 31) ^ off)];
    g_bar.wait();
    return r;
}
static inline int min(int a, int b) { return a < b ? a : b; }
#define __shared__ static
"""


def cpu_harness_source(D: int, G: int, split: int, warps: int = WARPS) -> str:
    """A C++ translation unit that runs PASS1 (a thread per lane, a block at a time, shuffles
    and barriers through shared slots) and PASS2 (one thread after another) on bfloat16 inputs:
    `decode_attention_cpu(q, k, v, lens, scale, k_strides, v_strides, B, Hkv, S, out)`."""
    consts = (f"    using T = bf16;\n    constexpr int D = {D}, G = {G}, SPLIT = {split}, "
              f"WPB = {warps};\n")
    return (
        CPU_PRELUDE
        + "static void pass1(const bf16* q, const bf16* k, const bf16* v, const int* lens,\n"
        + "                  const float* scale, float* po, float* pm, float* pl,\n"
        + "                  const int64_t* k_strides, const int64_t* v_strides) {\n"
        + consts + PASS1 + "}\n"
        + "static void pass2(const float* po, const float* pm, const float* pl, bf16* out,\n"
        + "                  const int* pm_shape) {\n"
        + consts + PASS2 + "}\n"
        + 'extern "C" void decode_attention_cpu(const bf16* q, const bf16* k, const bf16* v,\n'
        + "        const int* lens, const float* scale, const int64_t* k_strides,\n"
        + "        const int64_t* v_strides, int B, int Hkv, int S, bf16* out) {\n"
        + consts
        + "    const int Hq = Hkv * G, threads = WPB * 32;\n"
        + "    std::vector<float> po((size_t)B * Hq * S * D), pm((size_t)B * Hq * S), pl(pm.size());\n"
        + "    gridDim = {(unsigned)S, (unsigned)Hkv, (unsigned)B}; blockDim = {(unsigned)threads, 1, 1};\n"
        + "    g_bar.n = threads;\n"
        + "    for (int b = 0; b < B; ++b) for (int h = 0; h < Hkv; ++h) for (int s = 0; s < S; ++s) {\n"
        + "        std::vector<std::thread> ts;\n"
        + "        for (int t = 0; t < threads; ++t) ts.emplace_back([&, t] {\n"
        + "            threadIdx = {(unsigned)t, 0, 0}; blockIdx = {(unsigned)s, (unsigned)h, (unsigned)b};\n"
        + "            pass1(q, k, v, lens, scale, po.data(), pm.data(), pl.data(), k_strides, v_strides);\n"
        + "        });\n"
        + "        for (auto& th : ts) th.join();\n"
        + "    }\n"
        + "    const int shape[3] = {B, Hq, S};\n"
        + "    blockDim = {(unsigned)D, 1, 1};\n"
        + "    for (int i = 0; i < B * Hq; ++i) for (int d = 0; d < D; ++d) {\n"
        + "        blockIdx = {(unsigned)i, 0, 0}; threadIdx = {(unsigned)d, 0, 0};\n"
        + "        pass2(po.data(), pm.data(), pl.data(), out, shape);\n"
        + "    }\n"
        + "}\n"
    )
