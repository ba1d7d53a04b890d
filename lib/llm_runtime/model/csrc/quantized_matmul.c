/*
 * Matrix products with 4-bit and 8-bit weights on the CPU, reading the weights as stored (lesson 13).
 *
 * At one row a product reads every weight once and does two flops with each: PyTorch's int4 kernel
 * and the Q8_0 product below turn each stored weight into a float in registers, and the memory stays
 * the bottleneck. At many rows (a prefill, a large decode batch) the arithmetic dominates instead, and
 * PyTorch's quantized kernels lose to its dense product (oneDNN, bfloat16 dot instructions) by up to
 * 3x here: so at many rows the weights are turned back into the compute dtype first, once per call,
 * and the dense product multiplies them. Turning 1.8 M weights back costs about a tenth of the
 * product it feeds at 256 rows.
 *
 * Two weight formats:
 *
 *   int4, as PyTorch's CPU int4 kernel packs it (`torch._convert_weight_to_int4pack_for_cpu`, PyTorch
 *     2.13; quantized_kernels.py checks the layout on first use): W[n, k] = (q - 8) * scale + zero,
 *     q in 0..15, with scale and zero from `scales_and_zeros` (K / group, N, 2) for group k / group.
 *     The N rows come in blocks of 64: for block b and column k, 32 bytes where byte j holds row
 *     64 b + j in its low nibble and row 64 b + j + 32 in its high one. The last N % 64 rows, if
 *     any, hold (N % 64) / 2 bytes per column, byte j rows 2 j and 2 j + 1 of that tail.
 *   int8, Q8_0 (the GGUF's embedding): W[v, k] = q * d[b, v], b = k / 32. `q` (B, V, 32) int8 is
 *     block-major (each block of 32 columns one contiguous (V, 32) matrix), d (B, V). With a minimum
 *     m (B, V) (int8 in groups with a zero, quantized_linear.py): W[v, k] = q * d[b, v] + m[b, v].
 *
 * Exported, each in float32 and bfloat16 (`_f32`, `_bf16`: the activations', outputs' and scales'
 * type; arithmetic in float32):
 *   int4_dequantize_t  out (K, N) = W^T               the whole weight, transposed, so that each
 *                                                     column k of the packing is one contiguous write
 *   q8_dequantize      out (v1 - v0, K) = W[v0:v1]    a tile of rows (mins may be NULL)
 *   q8_matmul          out (M, V) = x (M, K) W^T      the few-row product, up to ROWS rows at once
 *                                                     (mins may be NULL)
 * Each returns 0, or 1 for shapes it does not handle.
 */
#include <stdint.h>
#include <stdlib.h>

#include "number_formats.h"

#define ROWS 4 /* rows of x multiplied with each decoded weight at once (their sums stay in registers) */

#if defined(__AVX512F__)
#include <immintrin.h>
static inline void decode32_i8(const int8_t *q, __m512 *low, __m512 *high) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)q);
    *low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v)));
    *high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1)));
}
#endif

/* One output row v of the Q8_0 product for m <= ROWS rows of x: out_v[r] = sum_k x[r, k] W[v, k], with
 * each block's minimum m_v[b] added to its weights (all zero for Q8_0 itself). */
static inline void q8_row(const float *x, int m, const int8_t *q, const float *d_v, const float *m_v,
                          int64_t blocks, int64_t V, float *out_v) {
    const int64_t K = blocks * 32;
#if defined(__AVX512F__)
    __m512 acc[ROWS];
    for (int r = 0; r < m; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m512 low, high;
        decode32_i8(q + b * V * 32, &low, &high);
        const __m512 s = _mm512_set1_ps(d_v[b]), z = _mm512_set1_ps(m_v[b]);
        low = _mm512_fmadd_ps(low, s, z);
        high = _mm512_fmadd_ps(high, s, z);
        for (int r = 0; r < m; r++) {
            acc[r] = _mm512_fmadd_ps(low, _mm512_loadu_ps(x + r * K + b * 32), acc[r]);
            acc[r] = _mm512_fmadd_ps(high, _mm512_loadu_ps(x + r * K + b * 32 + 16), acc[r]);
        }
    }
    for (int r = 0; r < m; r++) out_v[r] = _mm512_reduce_add_ps(acc[r]);
#else
    float total[ROWS] = {0.0f};
    for (int64_t b = 0; b < blocks; b++) {
        const int8_t *qb = q + b * V * 32;
        for (int r = 0; r < m; r++) {
            float part = 0.0f;
            const float *xr = x + r * K + b * 32;
            #pragma omp simd reduction(+ : part)
            for (int j = 0; j < 32; j++) part += ((float)qb[j] * d_v[b] + m_v[b]) * xr[j];
            total[r] += part;
        }
    }
    for (int r = 0; r < m; r++) out_v[r] = total[r];
#endif
}

/* The exported functions, once per compute type T with LOAD / STORE (one element to and from float). */
#define DEFINE_KERNELS(SUFFIX, T, LOAD, STORE)                                                         \
int int4_dequantize_t_##SUFFIX(const uint8_t *packed, const T *scales_and_zeros, int64_t N, int64_t K,       \
                               int64_t group, T *out) {                                                \
    if (group <= 0 || K % group || N % 2 || N <= 0) return 1;                                           \
    const int64_t full = N / 64 * 64, blocks = (N + 63) / 64, groups = K / group;                      \
    _Pragma("omp parallel for collapse(2) schedule(static)")                                           \
    for (int64_t b = 0; b < blocks; b++)                                                               \
        for (int64_t g = 0; g < groups; g++) {                                                         \
            const int64_t n0 = b * 64, rows = N - n0 < 64 ? N - n0 : 64;                               \
            float s[64], z[64];  /* W = q * s + z with z = zero - 8 scale */                           \
            for (int64_t j = 0; j < rows; j++) {                                                       \
                s[j] = LOAD(scales_and_zeros[(g * N + n0 + j) * 2]);                                   \
                z[j] = LOAD(scales_and_zeros[(g * N + n0 + j) * 2 + 1]) - 8.0f * s[j];                 \
            }                                                                                          \
            for (int64_t k = g * group; k < (g + 1) * group; k++) {                                    \
                T *dst = out + k * N + n0;                                                             \
                if (n0 < full) {                                                                       \
                    const uint8_t *bytes = packed + n0 * (K / 2) + k * 32;                             \
                    for (int j = 0; j < 32; j++) {                                                     \
                        dst[j] = STORE((float)(bytes[j] & 0x0f) * s[j] + z[j]);                        \
                        dst[j + 32] = STORE((float)(bytes[j] >> 4) * s[j + 32] + z[j + 32]);           \
                    }                                                                                  \
                } else {                                                                               \
                    const uint8_t *bytes = packed + full * (K / 2) + k * (rows / 2);                   \
                    for (int64_t j = 0; j < rows / 2; j++) {                                           \
                        dst[2 * j] = STORE((float)(bytes[j] & 0x0f) * s[2 * j] + z[2 * j]);            \
                        dst[2 * j + 1] = STORE((float)(bytes[j] >> 4) * s[2 * j + 1] + z[2 * j + 1]);  \
                    }                                                                                  \
                }                                                                                      \
            }                                                                                          \
        }                                                                                              \
    return 0;                                                                                          \
}                                                                                                      \
                                                                                                       \
int q8_matmul_##SUFFIX(const T *x, int64_t x_stride, int64_t M, const int8_t *q, const T *d,           \
                       const T *mins, int64_t V, int64_t blocks, T *out) {                               \
    if (M <= 0 || blocks <= 0) return 1;                                                               \
    const int64_t K = blocks * 32;                                                                     \
    float *xf = malloc(sizeof(float) * (size_t)(M * K));                                               \
    if (xf == NULL) return 1;                                                                          \
    for (int64_t r = 0; r < M; r++)                                                                    \
        for (int64_t k = 0; k < K; k++) xf[r * K + k] = LOAD(x[r * x_stride + k]);                     \
    for (int64_t r0 = 0; r0 < M; r0 += ROWS) {                                                         \
        const int m = (int)(M - r0 < ROWS ? M - r0 : ROWS);                                            \
        _Pragma("omp parallel for schedule(static)")                                                   \
        for (int64_t v = 0; v < V; v++) {                                                              \
            float d_v[blocks], m_v[blocks], sums[ROWS];                                                \
            for (int64_t b = 0; b < blocks; b++) {                                                     \
                d_v[b] = LOAD(d[b * V + v]);                                                           \
                m_v[b] = mins == NULL ? 0.0f : LOAD(mins[b * V + v]);                                  \
            }                                                                                          \
            q8_row(xf + r0 * K, m, q + v * 32, d_v, m_v, blocks, V, sums);                             \
            for (int r = 0; r < m; r++) out[(r0 + r) * V + v] = STORE(sums[r]);                        \
        }                                                                                              \
    }                                                                                                  \
    free(xf);                                                                                          \
    return 0;                                                                                          \
}                                                                                                      \
                                                                                                       \
int q8_dequantize_##SUFFIX(const int8_t *q, const T *d, const T *mins, int64_t V, int64_t blocks, int64_t v0, \
                           int64_t v1, T *out) {                                                         \
    if (blocks <= 0 || v0 < 0 || v1 < v0 || v1 > V) return 1;                                           \
    const int64_t K = blocks * 32;                                                                     \
    _Pragma("omp parallel for schedule(static)")                                                       \
    for (int64_t v = v0; v < v1; v++)                                                                  \
        for (int64_t b = 0; b < blocks; b++) {                                                         \
            const float s = LOAD(d[b * V + v]), z = mins == NULL ? 0.0f : LOAD(mins[b * V + v]);       \
            const int8_t *qb = q + (b * V + v) * 32;                                                   \
            for (int j = 0; j < 32; j++) out[(v - v0) * K + b * 32 + j] = STORE((float)qb[j] * s + z); \
        }                                                                                              \
    return 0;                                                                                          \
}

#define LOAD_F32(x) (x)
#define STORE_F32(x) (x)
DEFINE_KERNELS(f32, float, LOAD_F32, STORE_F32)
DEFINE_KERNELS(bf16, uint16_t, bf16_to_float, float_to_bf16)
