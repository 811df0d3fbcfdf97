"""CUDA source of the few-row affine quantized matmul: y[m, n] = sum_k x[m, k] * w_hat[n, k].

MLX's affine format: ``w`` uint32 [N, K * BITS / 32], element j of a word at bits j*BITS..;
``scales`` and ``biases`` [N, K / G] in the activation dtype; w_hat = scale * q + bias. Every
weight word is read once for all M (1..16) rows of x, in one launch; sums are float32.

Two bodies, one launch layout each (template constants beyond the shape):

``simt`` (any activation dtype; the only one for float32): a block of WPB warps owns RPW output
rows; the warps split K (warp w takes the iterations w, w + WPB, ...). An iteration is one 16-byte
(uint4) load of packed weights per lane and row, so a warp covers 32 * 4 words of a row (1024
columns at 4 bits); U iterations are loaded before any is used (more bytes in flight). Each
weight is dequantized once in float32 and multiplied into M accumulators. The lanes' sums are
reduced over the warp (the transposing shuffle reduction of kernels/common.py), then over the
block's warps through shared memory, always in the same order: a row's result does not depend on
how many rows share the call.

``mma`` (bfloat16 / float16 activations): a warp owns NT tiles of 8 output rows and runs
``mma.sync.m16n8k16`` (float32 accumulators) with the rows of x as the 16-row A operand (rows past
M are zero). Lane (g = lane / 4, t = lane % 4) loads one uint4 of row n0 + g of a tile at column
kb = base + t * EPL (EPL = 128 / BITS columns); step s of the lane's EPL columns feeds the mma
k-slots {2t, 2t+1, 2t+8, 2t+9} with columns kb + 4s + {0, 1, 2, 3}. The k order inside an mma does
not matter to the sum as long as A takes the same columns: lane (g, t) loads x rows g and g + 8 at
those columns. The weights are dequantized to the activation dtype (one rounding, as MLX's own
kernels do before their matmuls). C slots: (row g, cols 2t, 2t+1) and (row g + 8, same cols).

The wrapper MLX builds around a body (mlx/backend/cuda/custom_kernel.cpp): ``__global__ void
name(const uint32_t* w, const T* scales, const T* biases, const T* x, T* y)`` after its own
header (mlx/backend/cuda/device/utils.cuh: cuda_bf16.h, cuda_fp16.h), with the template arguments
as ``constexpr int`` / ``using T = ...`` lines at the top of the body. Each body has its own
header (HEADERS) and both are sent ``compact``: a custom-kernel call's cost grows with its text.
``harness_source`` writes the same translation unit for compiling a body with nvcc outside MLX.
"""

from __future__ import annotations

from kernels.common import warp_reduce_source

COMMON = r"""
typedef unsigned int u32;
#define QMM_FN __device__ __forceinline__
#define QMM_UNROLL _Pragma("unroll")

// q (an integer below 2^23) as float: its bits below the exponent of 2^23, minus 2^23 (exact)
QMM_FN float qmm_q(u32 q) { return __uint_as_float(0x4B000000u | q) - 8388608.0f; }

QMM_FN uint4 qmm_zero4() {
    uint4 z;
    z.x = 0u; z.y = 0u; z.z = 0u; z.w = 0u;
    return z;
}

QMM_FN u32 qmm_word(const uint4& v, int i) { return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w)); }
"""

SIMT_HELPERS = r"""
QMM_FN bool qmm_aligned16(const void* p) { return (reinterpret_cast<unsigned long long>(p) & 15ull) == 0ull; }

// four or eight activations as float (16-byte loads when aligned: x may be a view at any offset)
QMM_FN void qmm_load(const float* p, float* v, int n) {
    if (qmm_aligned16(p)) {
        for (int i = 0; i < n; i += 4) {
            const float4 q = *reinterpret_cast<const float4*>(p + i);
            v[i] = q.x; v[i + 1] = q.y; v[i + 2] = q.z; v[i + 3] = q.w;
        }
    } else {
        for (int i = 0; i < n; ++i) v[i] = p[i];
    }
}
QMM_FN float qmm_bits(unsigned short b, const __nv_bfloat16*) { return __bfloat162float(__ushort_as_bfloat16(b)); }
QMM_FN float qmm_bits(unsigned short b, const __half*) { return __half2float(__ushort_as_half(b)); }
template <class H>
QMM_FN void qmm_load16(const H* p, float* v, int n) {
    if (n == 8 && qmm_aligned16(p)) {
        const uint4 q = *reinterpret_cast<const uint4*>(p);
        const u32 words[4] = {q.x, q.y, q.z, q.w};
        QMM_UNROLL
        for (int i = 0; i < 4; ++i) {
            v[2 * i] = qmm_bits((unsigned short)(words[i] & 0xFFFFu), p);
            v[2 * i + 1] = qmm_bits((unsigned short)(words[i] >> 16), p);
        }
    } else {
        for (int i = 0; i < n; ++i) v[i] = (float)p[i];
    }
}
QMM_FN void qmm_load(const __nv_bfloat16* p, float* v, int n) { qmm_load16(p, v, n); }
QMM_FN void qmm_load(const __half* p, float* v, int n) { qmm_load16(p, v, n); }

"""

MMA_HELPERS = r"""
// four 16-bit activations as two mma registers (low element first); 8-byte loads when aligned
template <class H>
QMM_FN void qmm_pairs16(const H* p, u32& lo, u32& hi) {
    if ((reinterpret_cast<unsigned long long>(p) & 7ull) == 0ull) {
        const uint2 q = *reinterpret_cast<const uint2*>(p);
        lo = q.x;
        hi = q.y;
    } else {
        const unsigned short* h = reinterpret_cast<const unsigned short*>(p);
        lo = (u32)h[0] | ((u32)h[1] << 16);
        hi = (u32)h[2] | ((u32)h[3] << 16);
    }
}
QMM_FN void qmm_pairs(const __nv_bfloat16* p, u32& lo, u32& hi) { qmm_pairs16(p, lo, hi); }
QMM_FN void qmm_pairs(const __half* p, u32& lo, u32& hi) { qmm_pairs16(p, lo, hi); }
QMM_FN void qmm_pairs(const float*, u32& lo, u32& hi) { lo = 0u; hi = 0u; }  // never runs


// two floats as the activation dtype, packed low element first (an mma operand register)
QMM_FN u32 qmm_pack(float lo, float hi, const __nv_bfloat16*) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const u32*>(&h);
}
QMM_FN u32 qmm_pack(float lo, float hi, const __half*) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const u32*>(&h);
}
QMM_FN u32 qmm_pack(float lo, float hi, const float*) { return 0u; }  // the mma body never runs on float32

QMM_FN void qmm_mma(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1, const __nv_bfloat16*) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
QMM_FN void qmm_mma(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1, const __half*) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
QMM_FN void qmm_mma(float*, u32, u32, u32, u32, u32, u32, const float*) {}

"""

MMA4_HELPERS = r"""
// a scale or bias broadcast to both halves of a 16-bit pair
QMM_FN u32 qmm_bcast(__nv_bfloat16 v) {
    const __nv_bfloat162 p = __bfloat162bfloat162(v);
    return *reinterpret_cast<const u32*>(&p);
}
QMM_FN u32 qmm_bcast(__half v) {
    const __half2 p = __half2half2(v);
    return *reinterpret_cast<const u32*>(&p);
}
QMM_FN u32 qmm_bcast(float) { return 0u; }

// two 4-bit values at bits 0..3 and 16..19 of nib -> scale * q + bias as a 16-bit pair: the magic
// exponent makes each half 128 + q (bfloat16) or 1024 + q (float16), exact; subtract it, one fma
QMM_FN u32 qmm_dq2(u32 nib, u32 s2, u32 b2, const __nv_bfloat16*) {
    const u32 raw = nib | 0x43004300u;
    const u32 magic = 0x43004300u;
    const __nv_bfloat162 q = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&raw), *reinterpret_cast<const __nv_bfloat162*>(&magic));
    const __nv_bfloat162 r = __hfma2(q, *reinterpret_cast<const __nv_bfloat162*>(&s2), *reinterpret_cast<const __nv_bfloat162*>(&b2));
    return *reinterpret_cast<const u32*>(&r);
}
QMM_FN u32 qmm_dq2(u32 nib, u32 s2, u32 b2, const __half*) {
    const u32 raw = nib | 0x64006400u;
    const u32 magic = 0x64006400u;
    const __half2 q = __hsub2(*reinterpret_cast<const __half2*>(&raw), *reinterpret_cast<const __half2*>(&magic));
    const __half2 r = __hfma2(q, *reinterpret_cast<const __half2*>(&s2), *reinterpret_cast<const __half2*>(&b2));
    return *reinterpret_cast<const u32*>(&r);
}
QMM_FN u32 qmm_dq2(u32, u32, u32, const float*) { return 0u; }

// eight 16-bit activations (16-byte load when aligned)
template <class H>
QMM_FN void qmm_x8(const H* p, uint4& v) {
    if ((reinterpret_cast<unsigned long long>(p) & 15ull) == 0ull) {
        v = *reinterpret_cast<const uint4*>(p);
    } else {
        const unsigned short* h = reinterpret_cast<const unsigned short*>(p);
        v.x = (u32)h[0] | ((u32)h[1] << 16);
        v.y = (u32)h[2] | ((u32)h[3] << 16);
        v.z = (u32)h[4] | ((u32)h[5] << 16);
        v.w = (u32)h[6] | ((u32)h[7] << 16);
    }
}
"""

HEADERS = {
    "simt": COMMON + SIMT_HELPERS
    + warp_reduce_source("qmm_lane_reduce", "QMM_FN", "QMM_UNROLL", "__shfl_xor_sync(0xffffffffu, {v}, o)"),
    "mma": COMMON + MMA_HELPERS,
    "mma4": COMMON + MMA_HELPERS + MMA4_HELPERS,
}

# Template constants: T, M, BITS, RPW, WPB, U, NV (= M * RPW), NP (NV rounded up to a power of
# two, at most 32). N, K and the group come from the shapes of w and scales at run time (MLX passes
# w_shape and scales_shape because the body names them): one compiled kernel serves every shape.
SIMT = r"""
    constexpr int EPW = 32 / BITS;            // elements a word
    const int N = w_shape[0];
    const int KW = w_shape[1];                // words a row
    const int K = KW * EPW;
    const int KG = scales_shape[1];           // groups a row
    const int G = K / KG;
    const int ITERS = (KW + 127) / 128;       // a warp's uint4 loads cover 128 words a row
    constexpr u32 MASK = (1u << BITS) - 1u;
    const u32 lane = threadIdx.x & 31u;
    const int warp = (int)(threadIdx.x >> 5);
    const int row0 = (int)blockIdx.x * RPW;
    float acc[NV];
    QMM_UNROLL
    for (int i = 0; i < NV; ++i) acc[i] = 0.0f;
    for (int it0 = warp; it0 < ITERS; it0 += WPB * U) {
        uint4 wv[U][RPW];
        float sc[U][RPW];
        float bi[U][RPW];
        QMM_UNROLL
        for (int u = 0; u < U; ++u) {
            const int wi = ((it0 + u * WPB) * 32 + (int)lane) * 4;
            QMM_UNROLL
            for (int r = 0; r < RPW; ++r) {
                const int row = row0 + r;
                const bool on = wi < KW && row < N;
                const size_t off = (size_t)row * KW + (size_t)wi;
                wv[u][r] = on ? *reinterpret_cast<const uint4*>(w + off) : qmm_zero4();
                const size_t gi = (size_t)row * KG + (size_t)(wi * EPW / G);
                sc[u][r] = on ? (float)scales[gi] : 0.0f;
                bi[u][r] = on ? (float)biases[gi] : 0.0f;
            }
        }
        QMM_UNROLL
        for (int u = 0; u < U; ++u) {
            const int wi = ((it0 + u * WPB) * 32 + (int)lane) * 4;
            if (wi < KW) {
                QMM_UNROLL
                for (int j = 0; j < 4; ++j) {
                    float wf[RPW][EPW];
                    QMM_UNROLL
                    for (int r = 0; r < RPW; ++r) {
                        const u32 word = qmm_word(wv[u][r], j);
                        QMM_UNROLL
                        for (int e = 0; e < EPW; ++e) {
                            wf[r][e] = fmaf(sc[u][r], qmm_q((word >> (e * BITS)) & MASK), bi[u][r]);
                        }
                    }
                    const int k0 = (wi + j) * EPW;
                    QMM_UNROLL
                    for (int m = 0; m < M; ++m) {
                        float xv[EPW];
                        qmm_load(x + (size_t)m * K + k0, xv, EPW);
                        QMM_UNROLL
                        for (int r = 0; r < RPW; ++r) {
                            QMM_UNROLL
                            for (int e = 0; e < EPW; ++e) {
                                acc[m * RPW + r] = fmaf(wf[r][e], xv[e], acc[m * RPW + r]);
                            }
                        }
                    }
                }
            }
        }
    }
    // warp sums, NP values at a time; then the warps of the block, in order
    __shared__ float red[WPB * NV];
    QMM_UNROLL
    for (int c0 = 0; c0 < NV; c0 += NP) {
        float v[NP];
        QMM_UNROLL
        for (int i = 0; i < NP; ++i) v[i] = (c0 + i < NV) ? acc[c0 + i] : 0.0f;
        u32 idx;
        const float s = qmm_lane_reduce<NP>(v, lane, idx);
        const int o = c0 + (int)idx;
        if ((lane & (32u / (u32)NP - 1u)) == 0u && o < NV) {
            if (WPB == 1) {
                const int row = row0 + o % RPW;
                if (row < N) y[(size_t)(o / RPW) * N + row] = (T)s;
            } else {
                red[warp * NV + o] = s;
            }
        }
    }
    if (WPB > 1) {
        __syncthreads();
        for (int o = (int)threadIdx.x; o < NV; o += 32 * WPB) {
            float s = 0.0f;
            for (int q = 0; q < WPB; ++q) s += red[q * NV + o];
            const int row = row0 + o % RPW;
            if (row < N) y[(size_t)(o / RPW) * N + row] = (T)s;
        }
    }
"""

# Template constants: T, BITS, M16 (1: more than 8 rows, the mma's rows 8..15 are loaded), NT,
# WPB, U. N, K, the group and the row count M come from the shapes of w, scales and x at run time.
MMA = r"""
    constexpr int EPW = 32 / BITS;            // elements a word
    constexpr int EPL = 4 * EPW;              // columns of one lane's uint4
    constexpr int KSTEP = 4 * EPL;            // columns of a row an iteration covers (4 lanes)
    const int N = w_shape[0];
    const int KW = w_shape[1];
    const int K = KW * EPW;
    const int KG = scales_shape[1];
    const int G = K / KG;
    const int ITERS = (K + KSTEP - 1) / KSTEP;
    int M = 1;                                // rows of x: its leading dims
    for (int d = 0; d + 1 < x_ndim; ++d) M *= x_shape[d];
    constexpr u32 MASK = (1u << BITS) - 1u;
    const u32 lane = threadIdx.x & 31u;
    const int g = (int)(lane >> 2);
    const int t = (int)(lane & 3u);
    const int warp = (int)(threadIdx.x >> 5);
    const int n0 = (int)blockIdx.x * (8 * NT);
    const T* tag = nullptr;
    float c[NT][4];
    QMM_UNROLL
    for (int j = 0; j < NT; ++j) {
        c[j][0] = 0.0f; c[j][1] = 0.0f; c[j][2] = 0.0f; c[j][3] = 0.0f;
    }
    for (int it0 = warp; it0 < ITERS; it0 += WPB * U) {
        uint4 wv[U][NT];
        float sc[U][NT];
        float bi[U][NT];
        QMM_UNROLL
        for (int u = 0; u < U; ++u) {
            const int kb = (it0 + u * WPB) * KSTEP + t * EPL;
            QMM_UNROLL
            for (int j = 0; j < NT; ++j) {
                const int row = n0 + 8 * j + g;
                const bool on = kb < K && row < N;
                wv[u][j] = on ? *reinterpret_cast<const uint4*>(w + (size_t)row * KW + kb / EPW)
                              : qmm_zero4();
                const size_t gi = (size_t)row * KG + (size_t)(kb / G);
                sc[u][j] = on ? (float)scales[gi] : 0.0f;
                bi[u][j] = on ? (float)biases[gi] : 0.0f;
            }
        }
        QMM_UNROLL
        for (int u = 0; u < U; ++u) {
            if (it0 + u * WPB < ITERS) {  // the same for every lane of the warp: mma needs all 32
                const int kb = (it0 + u * WPB) * KSTEP + t * EPL;
                const bool kon = kb < K;
                QMM_UNROLL
                for (int s = 0; s < EPL / 4; ++s) {
                    // A: rows g and g + 8 of x at columns kb + 4s .. kb + 4s + 3 (8 bytes each)
                    u32 a0 = 0u, a1 = 0u, a2 = 0u, a3 = 0u;
                    if (kon && g < M) {
                        qmm_pairs(x + (size_t)g * K + kb + 4 * s, a0, a2);
                    }
                    if (M16 && kon && g + 8 < M) {
                        qmm_pairs(x + (size_t)(g + 8) * K + kb + 4 * s, a1, a3);
                    }
                    QMM_UNROLL
                    for (int j = 0; j < NT; ++j) {
                        const u32 word = qmm_word(wv[u][j], (4 * s) / EPW);
                        const int e0 = (4 * s) % EPW;
                        float f[4];
                        QMM_UNROLL
                        for (int e = 0; e < 4; ++e) {
                            f[e] = fmaf(sc[u][j], qmm_q((word >> ((e0 + e) * BITS)) & MASK), bi[u][j]);
                        }
                        qmm_mma(c[j], a0, a1, a2, a3, qmm_pack(f[0], f[1], tag), qmm_pack(f[2], f[3], tag), tag);
                    }
                }
            }
        }
    }
"""

# The mma body for 4 bits with the dequantization in 16-bit pairs: nibbles i and i + 4 of a word
# (v >> 4i & 0x000F000F) become one register of two weights in one LOP3, one subtract and one fma
# (two weights each), instead of a float32 fma and a convert per weight. The pair holds columns
# c0 + i and c0 + i + 4 of the word's eight, so the x pairs are gathered the same way from the
# eight activations (byte_perm). Template constants as MMA (BITS is 4).
MMA4 = r"""
    static_assert(BITS == 4, "the mma4 body takes 4-bit weights");
    const int N = w_shape[0];
    const int KW = w_shape[1];
    const int K = KW * 8;
    const int KG = scales_shape[1];
    const int G = K / KG;
    const int ITERS = (K + 127) / 128;        // an iteration: 4 lanes x 32 columns of a row
    int M = 1;
    for (int d = 0; d + 1 < x_ndim; ++d) M *= x_shape[d];
    const u32 lane = threadIdx.x & 31u;
    const int g = (int)(lane >> 2);
    const int t = (int)(lane & 3u);
    const int warp = (int)(threadIdx.x >> 5);
    const int n0 = (int)blockIdx.x * (8 * NT);
    const T* tag = nullptr;
    float c[NT][4];
    QMM_UNROLL
    for (int j = 0; j < NT; ++j) {
        c[j][0] = 0.0f; c[j][1] = 0.0f; c[j][2] = 0.0f; c[j][3] = 0.0f;
    }
    for (int it0 = warp; it0 < ITERS; it0 += WPB * U) {
        uint4 wv[U][NT];
        u32 sc[U][NT];
        u32 bi[U][NT];
        QMM_UNROLL
        for (int u = 0; u < U; ++u) {
            const int kb = (it0 + u * WPB) * 128 + t * 32;
            QMM_UNROLL
            for (int j = 0; j < NT; ++j) {
                const int row = n0 + 8 * j + g;
                const bool on = kb < K && row < N;
                wv[u][j] = on ? *reinterpret_cast<const uint4*>(w + (size_t)row * KW + kb / 8) : qmm_zero4();
                const size_t gi = (size_t)row * KG + (size_t)(kb / G);
                sc[u][j] = on ? qmm_bcast(scales[gi]) : 0u;
                bi[u][j] = on ? qmm_bcast(biases[gi]) : 0u;
            }
        }
        QMM_UNROLL
        for (int u = 0; u < U; ++u) {
            if (it0 + u * WPB < ITERS) {
                const int kb = (it0 + u * WPB) * 128 + t * 32;
                const bool kon = kb < K;
                QMM_UNROLL
                for (int wd = 0; wd < 4; ++wd) {
                    uint4 x0 = qmm_zero4();
                    uint4 x1 = qmm_zero4();
                    if (kon && g < M) qmm_x8(x + (size_t)g * K + kb + 8 * wd, x0);
                    if (M16 && kon && g + 8 < M) qmm_x8(x + (size_t)(g + 8) * K + kb + 8 * wd, x1);
                    // pair i = (column i, column i + 4) of the eight
                    const u32 p0 = __byte_perm(x0.x, x0.z, 0x5410u), p1 = __byte_perm(x0.x, x0.z, 0x7632u);
                    const u32 p2 = __byte_perm(x0.y, x0.w, 0x5410u), p3 = __byte_perm(x0.y, x0.w, 0x7632u);
                    const u32 r0 = __byte_perm(x1.x, x1.z, 0x5410u), r1 = __byte_perm(x1.x, x1.z, 0x7632u);
                    const u32 r2 = __byte_perm(x1.y, x1.w, 0x5410u), r3 = __byte_perm(x1.y, x1.w, 0x7632u);
                    QMM_UNROLL
                    for (int j = 0; j < NT; ++j) {
                        const u32 v = qmm_word(wv[u][j], wd);
                        const u32 w0 = qmm_dq2(v & 0x000F000Fu, sc[u][j], bi[u][j], tag);
                        const u32 w1 = qmm_dq2((v >> 4) & 0x000F000Fu, sc[u][j], bi[u][j], tag);
                        const u32 w2 = qmm_dq2((v >> 8) & 0x000F000Fu, sc[u][j], bi[u][j], tag);
                        const u32 w3 = qmm_dq2((v >> 12) & 0x000F000Fu, sc[u][j], bi[u][j], tag);
                        qmm_mma(c[j], p0, r0, p1, r1, w0, w1, tag);
                        qmm_mma(c[j], p2, r2, p3, r3, w2, w3, tag);
                    }
                }
            }
        }
    }
"""

# the C slots to y (and the sum over the warps of a block), shared by MMA and MMA4
MMA_EPILOGUE = r"""
    // C slots of lane (g, t): i = 0, 1 -> (row g, col 2t + i); i = 2, 3 -> (row g + 8, col 2t + i - 2)
    if (WPB == 1) {
        QMM_UNROLL
        for (int j = 0; j < NT; ++j) {
            QMM_UNROLL
            for (int i = 0; i < 4; ++i) {
                const int m = g + (i >= 2 ? 8 : 0);
                const int n = n0 + 8 * j + 2 * t + (i & 1);
                if (m < M && n < N) y[(size_t)m * N + n] = (T)c[j][i];
            }
        }
    } else {
        __shared__ float red[WPB * NT * 4 * 32];
        QMM_UNROLL
        for (int j = 0; j < NT; ++j) {
            QMM_UNROLL
            for (int i = 0; i < 4; ++i) red[((warp * NT + j) * 4 + i) * 32 + (int)lane] = c[j][i];
        }
        __syncthreads();
        for (int o = (int)threadIdx.x; o < NT * 4 * 32; o += 32 * WPB) {
            float s = 0.0f;
            for (int q = 0; q < WPB; ++q) s += red[q * NT * 4 * 32 + o];
            const int ln = o & 31;
            const int i = (o >> 5) & 3;
            const int j = o >> 7;
            const int m = (ln >> 2) + (i >= 2 ? 8 : 0);
            const int n = n0 + 8 * j + 2 * (ln & 3) + (i & 1);
            if (m < M && n < N) y[(size_t)m * N + n] = (T)s;
        }
    }
"""

BODIES = {"simt": SIMT, "mma": MMA + MMA_EPILOGUE, "mma4": MMA4 + MMA_EPILOGUE}


def compact(text: str) -> str:
    """The text without comment lines, trailing comments, indentation or blank lines: MLX
    rebuilds and carries the whole source on every call, and a call's cost grows with it."""
    out = []
    for line in text.splitlines():
        code = line.split("//", 1)[0].strip() if "//" in line and '"' not in line.split("//", 1)[0] else line.strip()
        if code:
            out.append(code)
    return "\n".join(out) + "\n"

INPUT_NAMES = ("w", "scales", "biases", "x")
OUTPUT_NAMES = ("y",)

_CUDA_TYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}


# what MLX's device header brings that the bodies use, for a build without MLX's source tree
MINIMAL_PRELUDE = (
    "#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n#include <cstdint>\n#include <cstddef>\n#include <cuda/std/array>\n#include <cooperative_groups.h>\n"
    "namespace mlx::core::cu { using Shape = cuda::std::array<int32_t, 10>; "
    "using Strides = cuda::std::array<int64_t, 10>; }\n"
)
MLX_PRELUDE = '#include "mlx/backend/cuda/device/utils.cuh"\n#include <cooperative_groups.h>\n'


def kernel_signature(body: str, dtype: str, name: str) -> str:
    """The kernel's parameter list as MLX writes it: each input's pointer, then its shape,
    strides and ndim where the body names them, then the outputs."""
    cu = _CUDA_TYPES[dtype]
    types = {"w": "uint32_t", "scales": cu, "biases": cu, "x": cu}
    text = BODIES[body]
    params = []
    for n in INPUT_NAMES:
        params.append(f"const {types[n]}* {n}")
        if f"{n}_shape" in text:
            params.append(f"const __grid_constant__ Shape {n}_shape")
        if f"{n}_strides" in text:
            params.append(f"const __grid_constant__ Strides {n}_strides")
        if f"{n}_ndim" in text:
            params.append(f"const __grid_constant__ int {n}_ndim")
    params += [f"{cu}* {n}" for n in OUTPUT_NAMES]
    return f"__global__ void {name}(" + ", ".join(params) + ")"


def harness_source(body: str, consts: dict[str, int], dtype: str, name: str = "affine_qmm", mlx_header: bool = False) -> str:
    """The translation unit MLX's cuda_kernel builds around `body` (its wrapper, written out):
    MLX's device header (or MINIMAL_PRELUDE), the body's header, then the kernel with the
    template constants as its first lines. For compiling with nvcc outside MLX (`-I` a checkout
    of MLX's source for its header)."""
    lines = "".join(f"  constexpr int {k} = {v};\n" for k, v in consts.items())
    return (
        (MLX_PRELUDE if mlx_header else MINIMAL_PRELUDE)
        + compact(HEADERS[body])
        + "namespace mlx::core::cu {\nnamespace cg = cooperative_groups;\n"
        + kernel_signature(body, dtype, name)
        + " {\n"
        + f"  using T = {_CUDA_TYPES[dtype]};\n"
        + lines
        + compact(BODIES[body])
        + "\n}\n} // namespace mlx::core::cu\n"
    )
