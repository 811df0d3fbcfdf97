"""Source of the fused skinny GEMM: ONE shared body, a thin prelude per backend.

y[m, n] = sum_k x[m, k] * w[n, k] for a few rows m < M of x (M = 1..16) and all rows n < N of the
weight w (row-major, N x K, the layout of nn.Linear / a tied embedding): x @ w.T.

Work split: one warp (SIMD group of 32 lanes) owns R consecutive rows of w. Its lanes stride over
K in 16-byte vectors (8 bfloat16/float16 or 4 float32 elements): lane l takes vectors l, l + 32,
... of each of its R rows, U vectors of every row in flight per step (all loads of a step are
issued before the first multiply). Each loaded vector of w is multiplied with the same 16 bytes of
all M rows of x (read through L1: x is small and every warp reads it), so w is read from memory
exactly once for all M rows. Accumulation is float32: acc[r * M + m]. At the end the R * M sums
(rounded up to NP, a power of two <= 32) are reduced across the warp by a halving transpose: at
each of log2(NP) steps a lane keeps half of its values and sends the other half to its partner,
so after NP - 1 shuffles lane groups hold one finished sum each (5 - log2(NP) butterflies finish
them) and NP lanes store NP different outputs at once.

The body sees: inputs ``w`` and ``x`` (type DT: float, or the backend's bfloat16/float16 type),
``dims`` (int32 [N, K], runtime so that one compiled kernel serves every weight shape of a
model), output ``y``; template constants M, R, U, NP (and DT); from the backend prologue ``lane``
and ``warp`` (the global warp index). Helpers from the backend prelude: SK_FN, SK_UNROLL,
SK_SHFL_XOR(v, o), u32, u64, sk_aligned16(p), sk_load16(p, aligned, q[4]) (16 bytes as four
32-bit words, little-endian), sk_unpack(q, f, (DT*)0) (those words as VEC floats), sk_out(v, y)
(float -> y's element type). Every lane runs the reduction (no early return: the shuffles need
the whole warp); rows past N are read clamped to row N - 1 and never stored.

Besides CUDA there is a C++ prelude (``cpu_harness_source``) that runs the same body with each
lane of a warp on its own thread and the shuffles through a barrier, so CPU-only CI compiles and
checks this exact text - the arithmetic, the tails and the cross-lane reduction - with g++.
No Metal prelude: MLX on Metal has its own small-M matmul kernels, and no Metal machine is here.
"""

from __future__ import annotations

from kernels.common import cpu_half_to_float_source, warp_reduce_source

BODY = r"""
    constexpr int VEC = 16 / (int)sizeof(DT);  // elements of DT in one 16-byte vector
    const u32 n_rows = (u32)dims[0];
    const u32 k_len = (u32)dims[1];
    const u32 kv = k_len / (u32)VEC;  // vectors in a row (the host checks k_len % VEC == 0)
    const bool aligned = sk_aligned16(w) && sk_aligned16(x);
    const DT* wrow[R];
    SK_UNROLL
    for (int r = 0; r < R; ++r) {
        const u32 row = warp * (u32)R + (u32)r;
        wrow[r] = w + (u64)(row < n_rows ? row : n_rows - 1u) * (u64)k_len;
    }
    float acc[NP];
    SK_UNROLL
    for (int t = 0; t < NP; ++t) {
        acc[t] = 0.0f;
    }
    for (u32 v0 = 0; v0 < kv; v0 += 32u * (u32)U) {
        // every load of w for this step first (R * U vectors in flight), then the arithmetic
        u32 wq[U * R * 4];
        SK_UNROLL
        for (int u = 0; u < U; ++u) {
            const u32 v = v0 + (u32)u * 32u + lane;
            SK_UNROLL
            for (int r = 0; r < R; ++r) {
                if (v < kv) {
                    sk_load16(wrow[r] + (u64)v * (u64)VEC, aligned, wq + (u * R + r) * 4);
                } else {
                    SK_UNROLL
                    for (int e = 0; e < 4; ++e) {
                        wq[(u * R + r) * 4 + e] = 0u;
                    }
                }
            }
        }
        SK_UNROLL
        for (int u = 0; u < U; ++u) {
            const u32 v = v0 + (u32)u * 32u + lane;
            if (v < kv) {
                float wf[R * VEC];
                SK_UNROLL
                for (int r = 0; r < R; ++r) {
                    sk_unpack(wq + (u * R + r) * 4, wf + r * VEC, (DT*)0);
                }
                SK_UNROLL
                for (int m = 0; m < M; ++m) {
                    u32 xq[4];
                    float xf[VEC];
                    sk_load16(x + (u64)m * (u64)k_len + (u64)v * (u64)VEC, aligned, xq);
                    sk_unpack(xq, xf, (DT*)0);
                    SK_UNROLL
                    for (int r = 0; r < R; ++r) {
                        SK_UNROLL
                        for (int e = 0; e < VEC; ++e) {
                            acc[r * M + m] += wf[r * VEC + e] * xf[e];  // one FMA (contracted)
                        }
                    }
                }
            }
        }
    }
    u32 idx;
    const float total = sk_warp_reduce<NP>(acc, lane, idx);
    if ((lane & (32u / (u32)NP - 1u)) == 0u && idx < (u32)(R * M)) {
        const u32 row = warp * (u32)R + idx / (u32)M;
        if (row < n_rows) {
            y[(u64)(idx % (u32)M) * (u64)n_rows + row] = sk_out(total, y);
        }
    }
"""

# Sum NP (a power of two <= 32) values over a warp: log2(NP) halving steps (NP - 1 shuffles in
# all: each lane keeps the half of the pairs that its lane bit selects and adds the partner's copy
# of it), then plain butterflies over the remaining lane bits. idx: which of the NP sums this
# lane ends with (bit b of idx = lane bit 16 >> b).
SHARED_HELPERS = warp_reduce_source("sk_warp_reduce", "SK_FN", "SK_UNROLL", "SK_SHFL_XOR({v}, o)", nv="NV")

# ---- CUDA -------------------------------------------------------------------------------------
CUDA_HEADER = (
    r"""
typedef unsigned int u32;
typedef unsigned long long u64;
#define SK_FN __device__ __forceinline__
#define SK_UNROLL _Pragma("unroll")
#define SK_SHFL_XOR(v, o) __shfl_xor_sync(0xffffffffu, (v), (o))
template <class T>
SK_FN bool sk_aligned16(const T* p) {
    return (reinterpret_cast<u64>(p) & 15ull) == 0ull;
}
// 16 bytes at p as four words: one vector load when aligned (w and x may be views at any offset)
template <class T>
SK_FN void sk_load16(const T* p, bool aligned, u32* q) {
    if (aligned) {
        const uint4 t = *reinterpret_cast<const uint4*>(p);
        q[0] = t.x;
        q[1] = t.y;
        q[2] = t.z;
        q[3] = t.w;
    } else if (sizeof(T) == 4) {
        const u32* s = reinterpret_cast<const u32*>(p);
        SK_UNROLL
        for (int e = 0; e < 4; ++e) {
            q[e] = s[e];
        }
    } else {
        const unsigned short* s = reinterpret_cast<const unsigned short*>(p);
        SK_UNROLL
        for (int e = 0; e < 4; ++e) {
            q[e] = (u32)s[2 * e] | ((u32)s[2 * e + 1] << 16);
        }
    }
}
SK_FN void sk_unpack(const u32* q, float* f, float*) {
    SK_UNROLL
    for (int e = 0; e < 4; ++e) {
        f[e] = __uint_as_float(q[e]);
    }
}
SK_FN void sk_unpack(const u32* q, float* f, __nv_bfloat16*) {
    SK_UNROLL
    for (int e = 0; e < 4; ++e) {
        f[2 * e] = __uint_as_float(q[e] << 16);
        f[2 * e + 1] = __uint_as_float(q[e] & 0xFFFF0000u);
    }
}
SK_FN void sk_unpack(const u32* q, float* f, __half*) {
    SK_UNROLL
    for (int e = 0; e < 4; ++e) {
        f[2 * e] = __half2float(__ushort_as_half((unsigned short)(q[e] & 0xFFFFu)));
        f[2 * e + 1] = __half2float(__ushort_as_half((unsigned short)(q[e] >> 16)));
    }
}
template <class T>
SK_FN T sk_out(float v, T*) {
    return (T)v;
}
"""
    + SHARED_HELPERS
)

CUDA_PROLOGUE = r"""
    const u32 lane = threadIdx.x & 31u;
    const u32 warp = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
"""

# ---- C++ (CPU check of the shared body) -------------------------------------------------------
# Each lane of a warp is a thread; a shuffle is: every lane writes its value, barrier, reads its
# partner's, barrier. So the body runs unchanged, reduction included.
CPU_HEADER = (
    r"""
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>
typedef uint32_t u32;
typedef uint64_t u64;
#define SK_FN static inline
#define SK_UNROLL
struct sk_bf16 { uint16_t bits; };
struct sk_f16 { uint16_t bits; };

struct SkWarp {
    float slot[32];
    std::mutex mu;
    std::condition_variable cv;
    int arrived = 0;
    long generation = 0;
    void sync() {
        std::unique_lock<std::mutex> lock(mu);
        const long gen = generation;
        if (++arrived == 32) {
            arrived = 0;
            ++generation;
            cv.notify_all();
        } else {
            cv.wait(lock, [&] { return generation != gen; });
        }
    }
};
static thread_local SkWarp* sk_this_warp = nullptr;
static thread_local u32 sk_this_lane = 0;
static inline float sk_shfl_xor(float v, int o) {
    sk_this_warp->slot[sk_this_lane] = v;
    sk_this_warp->sync();
    const float r = sk_this_warp->slot[sk_this_lane ^ (u32)o];
    sk_this_warp->sync();
    return r;
}
#define SK_SHFL_XOR(v, o) sk_shfl_xor((v), (o))

template <class T>
static inline bool sk_aligned16(const T* p) {
    return (reinterpret_cast<uintptr_t>(p) & 15u) == 0u;
}
template <class T>
static inline void sk_load16(const T* p, bool aligned, u32* q) {
    (void)aligned;
    std::memcpy(q, p, 16);
}
static inline float sk_bits_float(u32 b) { float f; std::memcpy(&f, &b, 4); return f; }
"""
    + cpu_half_to_float_source("sk_half_float", "sk_bits_float")
    + r"""static inline void sk_unpack(const u32* q, float* f, float*) {
    for (int e = 0; e < 4; ++e) f[e] = sk_bits_float(q[e]);
}
static inline void sk_unpack(const u32* q, float* f, sk_bf16*) {
    for (int e = 0; e < 4; ++e) {
        f[2 * e] = sk_bits_float(q[e] << 16);
        f[2 * e + 1] = sk_bits_float(q[e] & 0xFFFF0000u);
    }
}
static inline void sk_unpack(const u32* q, float* f, sk_f16*) {
    for (int e = 0; e < 4; ++e) {
        f[2 * e] = sk_half_float(q[e] & 0xFFFFu);
        f[2 * e + 1] = sk_half_float(q[e] >> 16);
    }
}
// the harness stores float32 sums; numpy rounds them to the output dtype
static inline float sk_out(float v, float*) { return v; }
"""
    + SHARED_HELPERS
)

CPU_TYPES = {"float32": "float", "bfloat16": "sk_bf16", "float16": "sk_f16"}


def _constants_cpp(consts: dict[str, int]) -> str:
    return "".join(f"    constexpr int {k} = {v};\n" for k, v in consts.items())


def cpu_harness_source(consts: dict[str, int], dtype: str) -> str:
    """A C++ translation unit that runs BODY for every warp, 32 threads a warp.

    ``skinny_run(w, x, dims, y, num_warps)``: w (N, K) and x (M, K) as raw DT elements, dims
    int32 [N, K], y float32 (M, N)."""
    dt = CPU_TYPES[dtype]
    return (
        CPU_HEADER
        + f"typedef {dt} DT;\n"
        + "static void sk_lane(const DT* w, const DT* x, const int32_t* dims, float* y, u32 warp, u32 lane) {\n"
        + _constants_cpp(consts)
        + BODY
        + "}\n"
        + 'extern "C" void skinny_run(const void* w_, const void* x_, const int32_t* dims, float* y, u32 num_warps) {\n'
        + "    const DT* w = static_cast<const DT*>(w_);\n"
        + "    const DT* x = static_cast<const DT*>(x_);\n"
        + "    for (u32 warp = 0; warp < num_warps; ++warp) {\n"
        + "        SkWarp group;\n"
        + "        std::vector<std::thread> lanes;\n"
        + "        for (u32 lane = 0; lane < 32u; ++lane) {\n"
        + "            lanes.emplace_back([&, lane] {\n"
        + "                sk_this_warp = &group;\n"
        + "                sk_this_lane = lane;\n"
        + "                sk_lane(w, x, dims, y, warp, lane);\n"
        + "            });\n"
        + "        }\n"
        + "        for (auto& t : lanes) t.join();\n"
        + "    }\n"
        + "}\n"
    )
