"""Source of the fused trellis mat-vec: ONE shared body, a thin prelude per backend.

y[b, r] = scale[r] * norm * sum_j code(state(r, j)) * x~[b, j], for up to 8 rows b of x~.

Work split: a threadgroup of ROWS SIMD groups (CUDA warps / Metal simdgroups) owns ROWS output
rows, one row per SIMD group. The row is walked in chunks of 1024 columns = 32 groups of 32
weights; lane l takes group l of the chunk. A group of 32 weights is exactly K packed words (a
coalesced read across the lanes), plus the word after it for the windows that run over its end
(the block's first word at a block end: tail-biting). The chunk of x is staged once per
threadgroup in shared memory with one pad word per 32 floats, so the lanes (32 columns apart)
read 32 different banks. With i and K compile-time constants the unrolled loop turns every window
into a funnel shift, and a weight costs one integer multiply-add (the LCG), a byte sum, two float
ops and BATCH fused multiply-adds. The lanes' partial sums are then reduced across the SIMD group.

The body sees: inputs ``packed`` (uint32), ``scales`` (float16/float32), ``x`` (DT), output ``y``
(DT); template constants K, L, TB (block length), N_IN, N_OUT, BATCH, CODE (0 = 1MAD, 1 = 3INST),
ROWS (rows per threadgroup); from the backend prologue ``lane``, ``row``, ``stage_tid`` and
``stage_threads``. Helpers from the backend prelude: TRELLIS_FN, TRELLIS_UNROLL, TRELLIS_SHARED,
TRELLIS_BARRIER, u32, trellis_as_float, trellis_half_bits, trellis_byte_sum. The epilogue reduces
``acc`` over the SIMD group and writes ``y``.

Besides CUDA and Metal there is a C++ prelude (``cpu_harness_source``) that runs the same body
one lane at a time, so CPU-only CI compiles and checks this exact text with g++.
"""

from __future__ import annotations

from kernels.common import cpu_half_to_float_source, warp_reduce_source

# Shared by every backend: the code functions and the per-lane arithmetic.
SHARED_HELPERS = r"""
TRELLIS_FN float trellis_1mad(u32 s) {
    // x = s*34038481 + 76625530 mod 2^32; value*147.8 = (sum of x's four bytes) - 510.
    const u32 x = s * 34038481u + 76625530u;
    // 2^23 + sum as float bits (the byte sum lands on the bits of 2^23, with dp4a in the same
    // instruction), minus (2^23 + 510): an exact integer, no int-to-float convert.
    return trellis_as_float(trellis_byte_sum_plus(x, 0x4B000000u)) - 8389118.0f;
}

TRELLIS_FN float trellis_1mad_denormal(u32 s) {
    // The byte sum itself as float bits: the denormal sum * 2^-149 (exact). The caller scales x up
    // by 2^64, so each product sum * x * 2^-85 is a normal float, and removes 510 * sum(x) once per
    // row: a weight costs the LCG, the byte sum and one FMA. Needs denormals kept (CUDA without
    // fast math / ftz); Metal flushes them, so Metal never uses it.
    return trellis_as_float(trellis_byte_sum_plus(s * 34038481u + 76625530u, 0u));
}

TRELLIS_FN float trellis_3inst(u32 s) {
    // x = s*89226354 + 64248484 mod 2^32; two float16 halves with a pinned exponent, summed.
    const u32 x = s * 89226354u + 64248484u;
    const u32 m = (x & 0x8FFF8FFFu) ^ 0x3B603B60u;
    return trellis_half_bits(m & 0xFFFFu) + trellis_half_bits(m >> 16);
}
"""

XS_STRIDE = 1056  # floats per staged row of x: 1024 columns + one pad word per 32 (no bank conflicts)

BODY = r"""
    TRELLIS_SHARED float xs[BATCH * 1056];
    float acc[BATCH];
    TRELLIS_UNROLL
    for (int b = 0; b < BATCH; ++b) {
        acc[b] = 0.0f;
    }
    const u32 words_per_row = (u32)(N_IN * K / 32);
    const u32 words_per_block = (u32)(TB * K / 32);
    const u32 groups_per_block = (u32)(TB / 32);
    const u32 num_groups = (u32)(N_IN / 32);
    const u32 num_chunks = (num_groups + 31u) / 32u;
    // A chunk is 32 groups (1024 columns): lane l of every row's SIMD group takes group l.
    for (u32 chunk = 0; chunk < num_chunks; ++chunk) {
        const u32 g = chunk * 32u + lane;
        const bool active = row < (u32)N_OUT && g < num_groups;
        u32 w[K + 1];
        if (active) {
            const u32 blk = g / groups_per_block;
            const u32 gi = g - blk * groups_per_block;
            const u32 base = row * words_per_row + blk * words_per_block;
            TRELLIS_UNROLL
            for (int k = 0; k < K; ++k) {
                w[k] = packed[base + gi * (u32)K + (u32)k];
            }
            // the word after the group; at a block's end, the block's first word (tail-biting)
            w[K] = packed[base + ((gi + 1u) * (u32)K) % words_per_block];
        } else {
            TRELLIS_UNROLL
            for (int k = 0; k <= K; ++k) {
                w[k] = 0u;
            }
        }
        // Stage this chunk of x (every row uses it) in shared memory, padded: column j of the
        // chunk lives at j + j/32, so the 32 lanes (32 columns apart) hit 32 different banks.
        for (u32 idx = stage_tid; idx < (u32)(BATCH * 1024); idx += stage_threads) {
            const u32 b = idx >> 10;
            const u32 j = idx & 1023u;
            const u32 col = chunk * 1024u + j;
            xs[b * 1056u + j + (j >> 5)] = col < (u32)N_IN ? (float)x[b * (u32)N_IN + col] : 0.0f;
        }
        TRELLIS_BARRIER();
        if (active) {
            const u32 xb = lane * 33u;
            TRELLIS_UNROLL
            for (int i = 0; i < 32; ++i) {
                const int p = i * K;
                const int q = p >> 5;
                const u32 off = (u32)(p & 31);
                const u32 win = (w[q] << off) | ((w[q + 1] >> 1) >> (31u - off));
                const u32 state = win >> (32 - L);
                const float v = (CODE == 0) ? trellis_1mad(state) : trellis_3inst(state);
                TRELLIS_UNROLL
                for (int b = 0; b < BATCH; ++b) {
                    acc[b] += v * xs[(u32)b * 1056u + xb + (u32)i];
                }
            }
        }
        TRELLIS_BARRIER();
    }
    const float code_norm = (CODE == 0) ? (1.0f / 147.800537109375f) : 1.0f;
"""


# ---- the register-resident body ("xreg"): the default for batches of 1-4 -----------------------
#
# Work split: lane `lane` of warp column `wc` owns GPL groups of 32 columns, g = (wc*GPL + j)*32 +
# lane: its GPL*32 columns of x (times BATCH rows) are loaded once into registers and reused for
# every output row the warp walks, so the inner loop reads no shared memory. A warp walks RW = RWU
# x NCH rows: NCH chunks of RWU rows; the words of the next chunk are loaded while the current one
# is decoded. WC warp columns cover a row (WC = ceil(N_IN / (32 * 32 * GPL))), RS warps of rows
# share a threadgroup, so a threadgroup owns RS * RW output rows. After each chunk the backend's
# TRELLIS_REDUCE_CHUNK sums acc[] over the SIMD group into red[] (shared); the epilogue adds the
# WC warp columns and stores y.
#
# DEN = 1 (CUDA only, 1MAD only): the denormal decode (see trellis_1mad_denormal); x is held
# times 2^64 and 510 * sum(x) is taken off once per row. DEN = 0 is the arithmetic Metal runs.
#
# Template constants beyond the first body: GPL, RWU, NCH, RS, WC, NP (RWU * BATCH rounded up to
# a power of two: the reduction's width), DEN.
BODY_XREG = r"""
    const u32 words_per_row = (u32)(N_IN * K / 32);
    const u32 groups_per_block = (u32)(TB / 32);
    const u32 num_groups = (u32)(N_IN / 32);
    const bool denormal = (DEN != 0) && (CODE == 0);
    // every row of the grid exists / every lane's group of columns exists
    const bool full_rows = (N_OUT % (RS * RWU * NCH)) == 0;
    const bool full_cols = (N_IN % (1024 * GPL)) == 0;
    TRELLIS_SHARED float red[RS * RWU * NCH * BATCH * WC];
    u32 gcol[GPL];
    u32 gnext[GPL];
    bool gon[GPL];
    TRELLIS_UNROLL
    for (int j = 0; j < GPL; ++j) {
        const u32 g = (wc * (u32)GPL + (u32)j) * 32u + lane;
        gon[j] = g < num_groups;
        gcol[j] = g * (u32)K;
        // the word after the group; at a block's end, the block's first word (tail-biting)
        const u32 gi = g % groups_per_block;
        gnext[j] = (gi + 1u == groups_per_block ? g + 1u - groups_per_block : g + 1u) * (u32)K;
    }
    // This lane's columns of x, held in registers for every row the warp walks.
    float xr[GPL * BATCH * 32];
    float xsum[BATCH];
    TRELLIS_UNROLL
    for (int b = 0; b < BATCH; ++b) {
        xsum[b] = 0.0f;
    }
    TRELLIS_UNROLL
    for (int j = 0; j < GPL; ++j) {
        const u32 col0 = (wc * (u32)GPL + (u32)j) * 1024u + lane * 32u;
        TRELLIS_UNROLL
        for (int b = 0; b < BATCH; ++b) {
            TRELLIS_UNROLL
            for (int i = 0; i < 32; i += 4) {
                // four columns at a time (one 16-byte load on CUDA for float x; col0 is 32-aligned)
                float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                if (gon[j]) {
                    trellis_load4(x + (u32)b * (u32)N_IN + col0 + (u32)i, v);
                }
                TRELLIS_UNROLL
                for (int e = 0; e < 4; ++e) {
                    xsum[b] += v[e];
                    // 2^64 (exact): keeps every product of the denormal decode a normal float
                    xr[(j * BATCH + b) * 32 + i + e] = denormal ? v[e] * trellis_as_float(0x5F800000u) : v[e];
                }
            }
        }
    }
    const u32 row_base = (group_id * (u32)RS + rs) * (u32)(RWU * NCH);
    u32 wn[RWU * GPL * (K + 1)];
    u32 w[RWU * GPL * (K + 1)];
    TRELLIS_UNROLL
    for (int t = 0; t < RWU * GPL * (K + 1); ++t) {
        wn[t] = 0u;
    }
    // chunk c is loaded in iteration c and decoded in iteration c + 1
    for (u32 c = 0; c <= (u32)NCH; ++c) {
        TRELLIS_UNROLL
        for (int t = 0; t < RWU * GPL * (K + 1); ++t) {
            w[t] = wn[t];
        }
        if (c < (u32)NCH) {
            // One base index per group for the chunk; each row's and word's offset is a constant
            // (signed indices: the compiler may fold it into the load's immediate). The bounds
            // checks vanish at compile time when the grid covers the shape exactly.
            const u32 chunk_row = row_base + c * (u32)RWU;
            TRELLIS_UNROLL
            for (int j = 0; j < GPL; ++j) {
                const int base = (int)(chunk_row * words_per_row + gcol[j]);
                const int base_next = (int)(chunk_row * words_per_row + gnext[j]);
                TRELLIS_UNROLL
                for (int r = 0; r < RWU; ++r) {
                    const bool on = (full_cols || gon[j]) && (full_rows || chunk_row + (u32)r < (u32)N_OUT);
                    TRELLIS_UNROLL
                    for (int k = 0; k < K; ++k) {
                        wn[(r * GPL + j) * (K + 1) + k] = on ? packed[base + r * (int)words_per_row + k] : 0u;
                    }
                    wn[(r * GPL + j) * (K + 1) + K] = on ? packed[base_next + r * (int)words_per_row] : 0u;
                }
            }
        }
        if (c > 0u) {
            float acc[NP];
            TRELLIS_UNROLL
            for (int t = 0; t < NP; ++t) {
                acc[t] = 0.0f;
            }
            TRELLIS_UNROLL
            for (int r = 0; r < RWU; ++r) {
                TRELLIS_UNROLL
                for (int j = 0; j < GPL; ++j) {
                    TRELLIS_UNROLL
                    for (int i = 0; i < 32; ++i) {
                        const int p = i * K;
                        const int q = p >> 5;
                        const u32 off = (u32)(p & 31);
                        const u32 hi = w[(r * GPL + j) * (K + 1) + q];
                        const u32 lo = w[(r * GPL + j) * (K + 1) + q + 1];
                        const u32 state = ((hi << off) | ((lo >> 1) >> (31u - off))) >> (32 - L);
                        const float v = denormal ? trellis_1mad_denormal(state)
                                                 : ((CODE == 0) ? trellis_1mad(state) : trellis_3inst(state));
                        TRELLIS_UNROLL
                        for (int b = 0; b < BATCH; ++b) {
                            acc[r * BATCH + b] += v * xr[(j * BATCH + b) * 32 + i];
                        }
                    }
                }
            }
            if (denormal) {
                TRELLIS_UNROLL
                for (int r = 0; r < RWU; ++r) {
                    TRELLIS_UNROLL
                    for (int b = 0; b < BATCH; ++b) {
                        // back from 2^-85 (exact), then the -510 of every weight at once
                        acc[r * BATCH + b] = acc[r * BATCH + b] * trellis_as_float(0x6A000000u) - 510.0f * xsum[b];
                    }
                }
            }
            // rows row_base + (c-1)*RWU .. : slots (rs*RW + (c-1)*RWU)*BATCH + t of red
            const u32 chunk_row0 = row_base + (c - 1u) * (u32)RWU;
            const u32 slot0 = (rs * (u32)(RWU * NCH) + (c - 1u) * (u32)RWU) * (u32)BATCH;
            TRELLIS_REDUCE_CHUNK(acc, slot0, chunk_row0);
        }
    }
    const float code_norm = (CODE == 0) ? (1.0f / 147.800537109375f) : 1.0f;
"""

# ---- CUDA -------------------------------------------------------------------------------------
CUDA_HEADER = (
    r"""
typedef unsigned int u32;
#define TRELLIS_FN __device__ __forceinline__
#define TRELLIS_UNROLL _Pragma("unroll")
#define TRELLIS_SHARED __shared__
#define TRELLIS_BARRIER() __syncthreads()
TRELLIS_FN float trellis_as_float(u32 b) { return __uint_as_float(b); }
TRELLIS_FN float trellis_half_bits(u32 h) { return __half2float(__ushort_as_half((unsigned short)h)); }
template <class T>
TRELLIS_FN void trellis_load4(const T* p, float* v) {
    v[0] = (float)p[0];
    v[1] = (float)p[1];
    v[2] = (float)p[2];
    v[3] = (float)p[3];
}
TRELLIS_FN void trellis_load4(const float* p, float* v) {
    if ((reinterpret_cast<unsigned long long>(p) & 15ull) == 0ull) {  // x may be a view at any offset
        const float4 q = *reinterpret_cast<const float4*>(p);
        v[0] = q.x;
        v[1] = q.y;
        v[2] = q.z;
        v[3] = q.w;
    } else {
        v[0] = p[0];
        v[1] = p[1];
        v[2] = p[2];
        v[3] = p[3];
    }
}
"""
)
# Byte sum: one dp4a instruction, or the portable bit trick (same as Metal's) if NVRTC lacks it.
CUDA_BYTE_SUM_DP4A = r"""
TRELLIS_FN u32 trellis_byte_sum_plus(u32 x, u32 c) { return __dp4a(x, 0x01010101u, c); }
"""
CUDA_BYTE_SUM_PORTABLE = r"""
TRELLIS_FN u32 trellis_byte_sum_plus(u32 x, u32 c) {
    const u32 t = (x & 0x00FF00FFu) + ((x >> 8) & 0x00FF00FFu);
    return (t & 0xFFFFu) + (t >> 16) + c;
}
"""


# Sum N (a power of two <= 32) values over a warp in N - 1 + 5 - log2(N) shuffles: each halving
# step trades half of the values with the partner lane, so after log2(N) steps a lane holds one
# value (index idx, from its lane bits) and plain butterflies finish it. The xreg body calls it
# through TRELLIS_REDUCE_CHUNK once per chunk of rows.
CUDA_REDUCE = warp_reduce_source(
    "trellis_lane_reduce", "TRELLIS_FN", "TRELLIS_UNROLL", "__shfl_xor_sync(0xffffffffu, {v}, o)"
) + r"""#define TRELLIS_REDUCE_CHUNK(acc, slot0, chunk_row0)                                            \
    do {                                                                                       \
        u32 idx_;                                                                              \
        const float s_ = trellis_lane_reduce<NP>(acc, lane, idx_);                             \
        if ((lane & (32u / (u32)NP - 1u)) == 0u && idx_ < (u32)(RWU * BATCH)) {               \
            red[((slot0) + idx_) * (u32)WC + wc] = s_;                                         \
        }                                                                                      \
    } while (0)
"""


def cuda_header(portable: bool = False) -> str:
    return CUDA_HEADER + (CUDA_BYTE_SUM_PORTABLE if portable else CUDA_BYTE_SUM_DP4A) + SHARED_HELPERS + CUDA_REDUCE

CUDA_PROLOGUE = r"""
    const u32 lane = threadIdx.x & 31u;
    const u32 row = blockIdx.x * (u32)ROWS + (threadIdx.x >> 5);
    const u32 stage_tid = threadIdx.x;
    const u32 stage_threads = 32u * (u32)ROWS;
"""

CUDA_EPILOGUE = r"""
    TRELLIS_UNROLL
    for (int b = 0; b < BATCH; ++b) {
        float v = acc[b];
        TRELLIS_UNROLL
        for (int o = 16; o > 0; o >>= 1) {
            v += __shfl_xor_sync(0xffffffffu, v, o);
        }
        acc[b] = v;
    }
    if (lane == 0u && row < (u32)N_OUT) {
        const float sc = (float)scales[row] * code_norm;
        TRELLIS_UNROLL
        for (int b = 0; b < BATCH; ++b) {
            y[(u32)b * (u32)N_OUT + row] = (DT)(acc[b] * sc);
        }
    }
"""

CUDA_XREG_PROLOGUE = r"""
    const u32 lane = threadIdx.x & 31u;
    const u32 wc = (threadIdx.x >> 5) % (u32)WC;
    const u32 rs = (threadIdx.x >> 5) / (u32)WC;
    const u32 group_id = blockIdx.x;
"""

# red[] holds one sum per (row of the threadgroup, row of x, warp column): add the warp columns.
XREG_STORE = r"""
        float s = 0.0f;
        TRELLIS_UNROLL
        for (int c = 0; c < WC; ++c) {
            s += red[o * (u32)WC + (u32)c];
        }
        const u32 row = group_id * (u32)(RS * RWU * NCH) + o / (u32)BATCH;
        if (row < (u32)N_OUT) {
            y[(o % (u32)BATCH) * (u32)N_OUT + row] = (DT)(s * (float)scales[row] * code_norm);
        }
"""

CUDA_XREG_EPILOGUE = (
    r"""
    TRELLIS_BARRIER();
    for (u32 o = threadIdx.x; o < (u32)(RS * RWU * NCH * BATCH); o += blockDim.x) {"""
    + XREG_STORE
    + "    }\n"
)

# ---- Metal ------------------------------------------------------------------------------------
METAL_HEADER = (
    r"""
typedef uint u32;
#define TRELLIS_FN inline
#define TRELLIS_UNROLL _Pragma("clang loop unroll(full)")
#define TRELLIS_SHARED threadgroup
#define TRELLIS_BARRIER() threadgroup_barrier(mem_flags::mem_threadgroup)
TRELLIS_FN float trellis_as_float(u32 b) { return as_type<float>(b); }
TRELLIS_FN float trellis_half_bits(u32 h) { return float(as_type<half>((ushort)h)); }
template <class T>
TRELLIS_FN void trellis_load4(const device T* p, thread float* v) {
    v[0] = (float)p[0];
    v[1] = (float)p[1];
    v[2] = (float)p[2];
    v[3] = (float)p[3];
}
TRELLIS_FN u32 trellis_byte_sum_plus(u32 x, u32 c) {
    const u32 t = (x & 0x00FF00FFu) + ((x >> 8) & 0x00FF00FFu);
    return (t & 0xFFFFu) + (t >> 16) + c;
}
"""
    + SHARED_HELPERS
)

METAL_XREG_HEADER = r"""
#define TRELLIS_REDUCE_CHUNK(acc, slot0, chunk_row0)                                            \
    do {                                                                                       \
        TRELLIS_UNROLL                                                                         \
        for (int t_ = 0; t_ < RWU * BATCH; ++t_) {                                             \
            const float s_ = simd_sum(acc[t_]);                                                \
            if (lane == 0u) {                                                                  \
                red[((slot0) + (u32)t_) * (u32)WC + wc] = s_;                                  \
            }                                                                                  \
        }                                                                                      \
    } while (0)
"""

METAL_XREG_PROLOGUE = r"""
    const u32 lane = thread_index_in_simdgroup;
    const u32 wc = simdgroup_index_in_threadgroup % (u32)WC;
    const u32 rs = simdgroup_index_in_threadgroup / (u32)WC;
    const u32 group_id = threadgroup_position_in_grid.x;
"""

METAL_XREG_EPILOGUE = (
    r"""
    TRELLIS_BARRIER();
    for (u32 o = thread_position_in_threadgroup.x; o < (u32)(RS * RWU * NCH * BATCH); o += threads_per_threadgroup.x) {"""
    + XREG_STORE
    + "    }\n"
)

METAL_PROLOGUE = r"""
    const u32 lane = thread_index_in_simdgroup;
    const u32 row = threadgroup_position_in_grid.x * (u32)ROWS + simdgroup_index_in_threadgroup;
    const u32 stage_tid = thread_position_in_threadgroup.x;
    const u32 stage_threads = 32u * (u32)ROWS;
"""

METAL_EPILOGUE = r"""
    TRELLIS_UNROLL
    for (int b = 0; b < BATCH; ++b) {
        acc[b] = simd_sum(acc[b]);
    }
    if (lane == 0u && row < (u32)N_OUT) {
        const float sc = (float)scales[row] * code_norm;
        TRELLIS_UNROLL
        for (int b = 0; b < BATCH; ++b) {
            y[(u32)b * (u32)N_OUT + row] = (DT)(acc[b] * sc);
        }
    }
"""

# ---- C++ (CPU check of the shared body) -------------------------------------------------------
CPU_HEADER = (
    r"""
#include <cstdint>
#include <cstring>
typedef uint32_t u32;
#define TRELLIS_FN static inline
#define TRELLIS_UNROLL
#define TRELLIS_SHARED
#define TRELLIS_BARRIER()
static inline float trellis_as_float(u32 b) { float f; std::memcpy(&f, &b, 4); return f; }
template <class T>
static inline void trellis_load4(const T* p, float* v) {
    for (int e = 0; e < 4; ++e) v[e] = (float)p[e];
}
"""
    + cpu_half_to_float_source("trellis_half_bits", "trellis_as_float")
    + r"""static inline u32 trellis_byte_sum_plus(u32 x, u32 c) {
    const u32 t = (x & 0x00FF00FFu) + ((x >> 8) & 0x00FF00FFu);
    return (t & 0xFFFFu) + (t >> 16) + c;
}
"""
    + SHARED_HELPERS
)


def _constants_cpp(consts: dict[str, int]) -> str:
    return "".join(f"    constexpr int {k} = {v};\n" for k, v in consts.items())


def cpu_harness_source(consts: dict[str, int]) -> str:
    """A C++ translation unit that runs BODY lane by lane and stores each lane's partial sums.

    ``trellis_lane_partials(packed, scales, x, partial)``: partial has shape (N_OUT, 32, BATCH) and
    already includes scale * code_norm, so summing over the lanes gives y.
    """
    return (
        CPU_HEADER
        + 'extern "C" void trellis_lane_partials(const u32* packed, const float* scales,\n'
        + "                                      const float* x, float* partial) {\n"
        + _constants_cpp(consts)
        + "    typedef float DT;\n"
        + "    for (u32 row = 0; row < (u32)N_OUT; ++row) {\n"
        + "    for (u32 lane = 0; lane < 32u; ++lane) {\n"
        + "    // one lane at a time, so each lane stages the whole chunk of x itself\n"
        + "    const u32 stage_tid = 0u, stage_threads = 1u;\n"
        + BODY
        + "    for (int b = 0; b < BATCH; ++b) {\n"
        + "        partial[((size_t)row * 32u + lane) * BATCH + b] = (DT)(acc[b] * scales[row] * code_norm);\n"
        + "    }\n"
        + "    }}\n}\n"
    )


CPU_XREG_REDUCE = r"""
#define TRELLIS_REDUCE_CHUNK(acc, slot0, chunk_row0)                                            \
    do {                                                                                       \
        for (int t_ = 0; t_ < RWU * BATCH; ++t_) {                                             \
            const u32 row_ = (chunk_row0) + (u32)(t_ / BATCH);                                 \
            if (row_ < (u32)N_OUT) {                                                           \
                partial[((size_t)row_ * (WC * 32u) + wc * 32u + lane) * BATCH + (t_ % BATCH)] = acc[t_]; \
            }                                                                                  \
        }                                                                                      \
    } while (0)
"""


def cpu_xreg_harness_source(consts: dict[str, int]) -> str:
    """A C++ translation unit that runs BODY_XREG thread by thread and stores each lane's sums.

    ``trellis_xreg_partials(packed, x, partial)``: partial has shape (N_OUT, WC * 32, BATCH), the
    per-lane sums before the SIMD-group reduction and before scale * code_norm.
    """
    groups = -(-consts["N_OUT"] // (consts["RS"] * consts["RWU"] * consts["NCH"]))
    return (
        CPU_HEADER
        + CPU_XREG_REDUCE
        + 'extern "C" void trellis_xreg_partials(const u32* packed, const float* x, float* partial) {\n'
        + _constants_cpp(consts)
        + "    typedef float DT;\n"
        + f"    for (u32 group_id = 0; group_id < {groups}u; ++group_id) {{\n"
        + "    for (u32 rs = 0; rs < (u32)RS; ++rs) {\n"
        + "    for (u32 wc = 0; wc < (u32)WC; ++wc) {\n"
        + "    for (u32 lane = 0; lane < 32u; ++lane) {\n"
        + BODY_XREG
        + "    (void)code_norm; (void)red;\n"
        + "    }}}}\n}\n"
    )
