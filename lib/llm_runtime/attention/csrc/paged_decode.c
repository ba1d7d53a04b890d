/*
 * Paged decode attention on the CPU, reading keys and values where they lie in the block pool.
 *
 * The same algorithm as the Triton kernel's decode path (lesson 11), written as plain C so the
 * compiler can vectorize it and OpenMP can spread it over the cores: one work item per query row
 * (a decode, or one row of a prefill chunk, which is a decode over the keys up to its position);
 * it walks its sequence's block table, and for every chunk of keys updates an online softmax for
 * every query head, so a decode reads each key and value from memory once per step and layer.
 * Nothing is copied out of the pool and no mask is built.
 *
 * Exported, one per pair of (query and output type, pool element type), the body being
 * paged_decode_body.h included once per pair:
 *   paged_decode_f32, paged_decode_bf16          a pool in the query's own type
 *   paged_decode_f32_i8, paged_decode_bf16_i8    an int8 pool, its elements as stored, keys turned back
 *                                                by the rotary embedding (with their scales, TURNED_KEYS)
 *   paged_decode_f32_fp8, paged_decode_bf16_fp8  a float8 e4m3fn pool, without scales
 * Each returns 0, or 1 for shapes it does not handle.
 *
 * 8-bit pools (kv_quant.py) are read as stored too: an int8 element is the integer q itself, a float8
 * one its number. Elements become float32 in registers, 16 at a time, as the dot products and the
 * value sums load them. An int8 pool's element stands for q * s + z, with a scale s and a zero z per
 * layer, KV head and channel, the same for every token. Its keys were turned back by the rotary
 * embedding before they were stored, so the kernel turns each chunk of them to its positions
 * (`turn_keys`, given the scales and a table of angles) before the dot products. The output is a
 * weighted mean of the values (the weights sum to one): the mean of the stored values times s_v, plus z_v.
 *
 * Layouts (all row-major, element strides):
 *   query      (N, H, d)  rows `rows[b]` are the decodes; q_row_stride / q_head_stride given, d contiguous
 *   key_pool   (num_blocks, block_size, KV, d) contiguous; value_pool the same
 *   block_tables (B, table_stride) int32; seq_lens (B,) int32; rows (B,) int64
 *   out        (N, H, d) contiguous; only the decode rows are written
 *
 * Per chunk the body calls three steps, each defined below once for AVX-512 (this package's CI
 * machine) and once in portable C (AVX2 dot products where the compiler has them), per pool type:
 *   CHUNK_SCORES   the chunk's scores q . k for one query head
 *   chunk_softmax  the online-softmax update of one head from those scores
 *   AXPY_CHUNK     the weighted sum of the chunk's values added to one head's numerator
 *
 * Python loads this file with ctypes (cpu_kernels.py): no PyTorch headers, so it compiles in a
 * second. OpenMP here is the same libgomp PyTorch already loaded, so the threads are PyTorch's.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "number_formats.h"

#define CHUNK 16 /* keys whose scores are held at once */
#define PREFETCH_AHEAD 1 /* chunks between a prefetch and its use (1 measured fastest here, then 2, 4) */
#define MAX_HEADS 256 /* query heads */
#define MAX_STATE 16384 /* query heads x head dim: the per-sequence state kept on the stack */
#define MAX_HEAD_DIM 256 /* of keys turned in the kernel (an int8 pool's) */

/* exp(x) for x <= 0, as 2^(x log2 e) = 2^n * 2^f with n the nearest integer and f in [-1/2, 1/2]:
 * 2^f by its Taylor series to degree 6 (relative error 2.3e-7 over that range, evaluated in
 * float32), 2^n written into the exponent bits. Unlike libm's expf, the compiler can vectorize a
 * loop that calls it. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;  /* below this exp(x) is under float's smallest normal: ~0 */
    const float t = x * 1.44269504f;  /* log2(e) */
    const float n = floorf(t + 0.5f);  /* in [-126, 0] */
    const float f = t - n;
    float p = 1.54035304e-4f;  /* ln(2)^k / k!, k = 6 .. 0 */
    p = p * f + 1.33335581e-3f;
    p = p * f + 9.61812911e-3f;
    p = p * f + 5.55041087e-2f;
    p = p * f + 2.40226507e-1f;
    p = p * f + 6.93147181e-1f;
    p = p * f + 1.0f;
    union { uint32_t u; float f; } scale;
    scale.u = (uint32_t)((int32_t)n + 127) << 23;  /* 2^n */
    return p * scale.f;
}

/* ---------------------------------------------------------------- one element to float, by its bits
 * bfloat16 and float16: number_formats.h. */

/* float8 e4m3fn: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal,
 * m * 2^-9. (0x7f and 0xff are NaN; the pool never holds them: quantization clamps to +-448.) */
static inline float fp8_to_float(uint8_t x) {
    const uint32_t sign = (uint32_t)(x & 0x80u) << 24, exponent = (x >> 3) & 0xfu, mantissa = x & 0x7u;
    union { uint32_t u; float f; } v;
    if (exponent == 0) v.f = (float)mantissa * 0x1p-9f;
    else v.u = (exponent + 127 - 7) << 23 | mantissa << 20;
    v.u |= sign;
    return v.f;
}

static inline float int8_to_float(int8_t x) { return (float)x; }  /* scale and zero: applied around it */
static inline float f32_to_float(float x) { return x; }

/* slots[t] for positions first .. first + n - 1 of a sequence: pool slot = block * block_size + offset. */
static inline void slots_of(int64_t *slots, const int32_t *table, int block_size, int first, int n) {
    int block = first / block_size, offset = first % block_size;
    for (int t = 0; t < n; t++) {
        slots[t] = (int64_t)table[block] * block_size + offset;
        if (++offset == block_size) { offset = 0; block++; }
    }
}

/* Ask for `bytes` from `start` to be brought into L2, one cache line per instruction. */
static inline void prefetch_bytes(const void *start, int64_t bytes) {
    for (int64_t byte = 0; byte < bytes; byte += 64) __builtin_prefetch((const char *)start + byte, 0, 2);
}

/* q . k over d elements, q in float and k in the pool's type. A single running sum would chain
 * every addition, and GCC reduces an `omp simd` sum through memory one lane at a time (about 60
 * cycles a dot, which made this kernel compute-bound): so 16 lanes with AVX-512 or 8 with AVX2,
 * then one horizontal sum; plain C elsewhere. Each vector path loads a pool type into floats
 * with one LOAD16 (or LOAD8) function per type, and finishes a d that is not a multiple of the
 * vector with the scalar conversion above (LOAD1). */
#if defined(__AVX512F__)
#include <immintrin.h>
_Static_assert(CHUNK == 16, "the AVX-512 steps hold one chunk's scores in one vector");
static inline __m512 load16_f32(const float *x) { return _mm512_loadu_ps(x); }
static inline __m512 load16_bf16(const uint16_t *x) {  /* widen to 32 bits, shift left 16 */
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)x));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
static inline __m512 load16_i8(const int8_t *x) {  /* sign-extend to 32 bits, convert */
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)x)));
}
/* 16 float8 e4m3fn by way of float16, which the hardware converts (vcvtph2ps, subnormals included):
 * e4m3's sign goes to float16's bit 15 and its exponent and mantissa to bits 13..7, which makes the
 * float16 number 2^(7 - 15) times the e4m3 one (the exponent biases differ by 8). Sign-extending the
 * byte to 16 bits and shifting it left 7 puts everything in place but for a copy of the sign in
 * bit 14, which the mask clears. */
static inline __m512 load16_fp8(const uint8_t *x) {
    const __m256i wide = _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)x)), 7);
    const __m256i half = _mm256_and_si256(wide, _mm256_set1_epi16((short)0xbf80));
    return _mm512_mul_ps(_mm512_cvtph_ps(half), _mm512_set1_ps(256.0f));
}

#define DEFINE_DOT_AVX512(NAME, T, LOAD16, LOAD1)                                                     \
static inline float NAME(const float *q, const T *k, int d) {                                          \
    __m512 sum = _mm512_setzero_ps();                                                                  \
    int i = 0;                                                                                         \
    for (; i + 16 <= d; i += 16) sum = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), LOAD16(k + i), sum);    \
    float total = _mm512_reduce_add_ps(sum);                                                           \
    for (; i < d; i++) total += q[i] * LOAD1(k[i]);                                                    \
    return total;                                                                                      \
}
DEFINE_DOT_AVX512(dot_f32, float, load16_f32, f32_to_float)
DEFINE_DOT_AVX512(dot_bf16, uint16_t, load16_bf16, bf16_to_float)
DEFINE_DOT_AVX512(dot_fp8, uint8_t, load16_fp8, fp8_to_float)

/* a += sum over t < n of p[t] * rows[t], 64 elements (four vectors, four independent chains) at a
 * time, so the accumulators stay in registers for the whole chunk instead of a load and a store
 * per key. */
#define DEFINE_AXPY_CHUNK_AVX512(NAME, T, LOAD16, LOAD1)                                              \
static inline void NAME(float *a, const float *p, const T *const *rows, int n, int d) {                \
    int i = 0;                                                                                         \
    for (; i + 64 <= d; i += 64) {                                                                     \
        __m512 a0 = _mm512_loadu_ps(a + i), a1 = _mm512_loadu_ps(a + i + 16);                          \
        __m512 a2 = _mm512_loadu_ps(a + i + 32), a3 = _mm512_loadu_ps(a + i + 48);                     \
        for (int t = 0; t < n; t++) {                                                                  \
            const __m512 weight = _mm512_set1_ps(p[t]);                                                \
            a0 = _mm512_fmadd_ps(weight, LOAD16(rows[t] + i), a0);                                     \
            a1 = _mm512_fmadd_ps(weight, LOAD16(rows[t] + i + 16), a1);                                \
            a2 = _mm512_fmadd_ps(weight, LOAD16(rows[t] + i + 32), a2);                                \
            a3 = _mm512_fmadd_ps(weight, LOAD16(rows[t] + i + 48), a3);                                \
        }                                                                                              \
        _mm512_storeu_ps(a + i, a0); _mm512_storeu_ps(a + i + 16, a1);                                 \
        _mm512_storeu_ps(a + i + 32, a2); _mm512_storeu_ps(a + i + 48, a3);                            \
    }                                                                                                  \
    for (; i + 16 <= d; i += 16) {                                                                     \
        __m512 a0 = _mm512_loadu_ps(a + i);                                                            \
        for (int t = 0; t < n; t++) a0 = _mm512_fmadd_ps(_mm512_set1_ps(p[t]), LOAD16(rows[t] + i), a0); \
        _mm512_storeu_ps(a + i, a0);                                                                   \
    }                                                                                                  \
    for (; i < d; i++)                                                                                 \
        for (int t = 0; t < n; t++) a[i] += p[t] * LOAD1(rows[t][i]);                                  \
}

/* Lane t of the result is the sum of the 16 lanes of v[t]: a transpose-and-add in four rounds,
 * 45 instructions for the 16 sums where 16 horizontal sums take about 150. */
static inline __m512 sum_each16(const __m512 *v) {
    __m512 pairs[8], quads[4];
    for (int j = 0; j < 8; j++)  /* in each 128-bit lane: v[2j] at positions 0 and 2, v[2j+1] at 1 and 3 */
        pairs[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]),
                                 _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
    for (int j = 0; j < 4; j++) {  /* in each 128-bit lane: v[4j + i] at position i */
        const __m512d a = _mm512_castps_pd(pairs[2 * j]), b = _mm512_castps_pd(pairs[2 * j + 1]);
        quads[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    /* 128-bit lanes (0 + 1, 2 + 3) of quads[0], then of quads[1]; likewise for quads[2] and [3] */
    const __m512 low = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                                     _mm512_shuffle_f32x4(quads[0], quads[1], 0xdd));
    const __m512 high = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88),
                                      _mm512_shuffle_f32x4(quads[2], quads[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(low, high, 0x88), _mm512_shuffle_f32x4(low, high, 0xdd));
}
/* The scores of a chunk of 16 keys for one query head: lane-wise products summed over d into one
 * vector per key, then sum_each16. Past the chunk's end `keys` repeats a valid row (scores unused). */
#define DEFINE_CHUNK_SCORES_AVX512(NAME, T, LOAD16, DOT)                                              \
static inline void NAME(float *s, const float *q, const T *const *keys, int n, int d) {                \
    if (d % 16) {                                                                                      \
        for (int t = 0; t < n; t++) s[t] = DOT(q, keys[t], d);                                         \
        return;                                                                                        \
    }                                                                                                  \
    __m512 part[16];                                                                                   \
    for (int t = 0; t < 16; t++) part[t] = _mm512_setzero_ps();                                        \
    for (int i = 0; i < d; i += 16) {                                                                  \
        const __m512 qv = _mm512_loadu_ps(q + i);                                                      \
        for (int t = 0; t < 16; t++) part[t] = _mm512_fmadd_ps(qv, LOAD16(keys[t] + i), part[t]);      \
    }                                                                                                  \
    _mm512_storeu_ps(s, sum_each16(part));                                                             \
}
DEFINE_CHUNK_SCORES_AVX512(chunk_scores_f32, float, load16_f32, dot_f32)
DEFINE_CHUNK_SCORES_AVX512(chunk_scores_bf16, uint16_t, load16_bf16, dot_bf16)
DEFINE_CHUNK_SCORES_AVX512(chunk_scores_fp8, uint8_t, load16_fp8, dot_fp8)

/* exp_nonpositive on 16 lanes: the same steps, with 2^n applied by scalef. */
static inline __m512 exp_nonpositive16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f));
    const __m512 n = _mm512_roundscale_ps(_mm512_add_ps(t, _mm512_set1_ps(0.5f)),
                                          _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.54035304e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.33335581e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.61812911e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.55041087e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.40226507e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.93147181e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}
/* One head's online-softmax step over a chunk of n <= 16 scores s: s becomes the weights
 * p = exp(s - new maximum), the running maximum and sum move on, and the returned factor
 * exp(old maximum - new maximum) rescales what was accumulated before. */
static inline float chunk_softmax(float *s, int n, float *running_max, float *running_sum) {
    const __mmask16 valid = (__mmask16)((1u << n) - 1u);
    const __m512 scores = _mm512_mask_loadu_ps(_mm512_set1_ps(-FLT_MAX), valid, s);
    const float chunk_max = fmaxf(*running_max, _mm512_reduce_max_ps(scores));
    const float correction = exp_nonpositive(*running_max - chunk_max);
    const __m512 p = _mm512_maskz_mov_ps(valid, exp_nonpositive16(_mm512_sub_ps(scores, _mm512_set1_ps(chunk_max))));
    _mm512_storeu_ps(s, p);
    *running_sum = *running_sum * correction + _mm512_reduce_add_ps(p);
    *running_max = chunk_max;
    return correction;
}
DEFINE_AXPY_CHUNK_AVX512(axpy_chunk_f32, float, load16_f32, f32_to_float)
DEFINE_AXPY_CHUNK_AVX512(axpy_chunk_bf16, uint16_t, load16_bf16, bf16_to_float)
DEFINE_AXPY_CHUNK_AVX512(axpy_chunk_i8, int8_t, load16_i8, int8_to_float)
DEFINE_AXPY_CHUNK_AVX512(axpy_chunk_fp8, uint8_t, load16_fp8, fp8_to_float)
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
static inline float sum8(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}
static inline __m256 load8_f32(const float *x) { return _mm256_loadu_ps(x); }
static inline __m256 load8_bf16(const uint16_t *x) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)x));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
static inline __m256 load8_fp8(const uint8_t *x) {  /* as load16_fp8 in the AVX-512 path */
    const __m256i bits = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)x));
    const __m256i magnitude = _mm256_and_si256(bits, _mm256_set1_epi32(0x7f));
    const __m256i sign = _mm256_slli_epi32(_mm256_andnot_si256(magnitude, bits), 24);
    const __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(magnitude, 20),
                                                               _mm256_set1_epi32((127 - 7) << 23)));
    const __m256 subnormal = _mm256_mul_ps(_mm256_cvtepi32_ps(magnitude), _mm256_set1_ps(0x1p-9f));
    const __m256 is_subnormal = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), magnitude));
    const __m256 absolute = _mm256_blendv_ps(normal, subnormal, is_subnormal);
    return _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(absolute), sign));
}
#define DEFINE_DOT_AVX2(NAME, T, LOAD8, LOAD1)                                                        \
static inline float NAME(const float *q, const T *k, int d) {                                          \
    __m256 sum = _mm256_setzero_ps();                                                                  \
    int i = 0;                                                                                         \
    for (; i + 8 <= d; i += 8) sum = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), LOAD8(k + i), sum);       \
    float total = sum8(sum);                                                                           \
    for (; i < d; i++) total += q[i] * LOAD1(k[i]);                                                    \
    return total;                                                                                      \
}
DEFINE_DOT_AVX2(dot_f32, float, load8_f32, f32_to_float)
DEFINE_DOT_AVX2(dot_bf16, uint16_t, load8_bf16, bf16_to_float)
DEFINE_DOT_AVX2(dot_fp8, uint8_t, load8_fp8, fp8_to_float)
#else
#define DEFINE_DOT_PORTABLE(NAME, T, LOAD1)                                                           \
static inline float NAME(const float *q, const T *k, int d) {                                          \
    float part[8] = {0.0f};                                                                            \
    int i = 0;                                                                                         \
    for (; i + 8 <= d; i += 8)                                                                         \
        for (int j = 0; j < 8; j++) part[j] += q[i + j] * LOAD1(k[i + j]);                             \
    for (; i < d; i++) part[0] += q[i] * LOAD1(k[i]);                                                  \
    return ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));  \
}
DEFINE_DOT_PORTABLE(dot_f32, float, f32_to_float)
DEFINE_DOT_PORTABLE(dot_bf16, uint16_t, bf16_to_float)
DEFINE_DOT_PORTABLE(dot_fp8, uint8_t, fp8_to_float)
#endif

#if !defined(__AVX512F__)
#define DEFINE_CHUNK_SCORES(NAME, T, DOT)                                                             \
static inline void NAME(float *s, const float *q, const T *const *keys, int n, int d) {                \
    for (int t = 0; t < n; t++) s[t] = DOT(q, keys[t], d);                                             \
}
DEFINE_CHUNK_SCORES(chunk_scores_f32, float, dot_f32)
DEFINE_CHUNK_SCORES(chunk_scores_bf16, uint16_t, dot_bf16)
DEFINE_CHUNK_SCORES(chunk_scores_fp8, uint8_t, dot_fp8)
static inline float chunk_softmax(float *s, int n, float *running_max, float *running_sum) {
    float chunk_max = *running_max;
    for (int t = 0; t < n; t++) chunk_max = s[t] > chunk_max ? s[t] : chunk_max;
    const float correction = exp_nonpositive(*running_max - chunk_max);
    float chunk_sum = 0.0f;
    for (int t = 0; t < n; t++) s[t] = exp_nonpositive(s[t] - chunk_max);  /* p */
    for (int t = 0; t < n; t++) chunk_sum += s[t];
    *running_sum = *running_sum * correction + chunk_sum;
    *running_max = chunk_max;
    return correction;
}
/* a += sum over t < n of p[t] * rows[t]; the compiler vectorizes the inner loop. */
#define DEFINE_AXPY_CHUNK(NAME, T, LOAD1)                                                             \
static inline void NAME(float *a, const float *p, const T *const *rows, int n, int d) {                \
    for (int t = 0; t < n; t++)                                                                        \
        for (int i = 0; i < d; i++) a[i] += p[t] * LOAD1(rows[t][i]);                                  \
}
DEFINE_AXPY_CHUNK(axpy_chunk_f32, float, f32_to_float)
DEFINE_AXPY_CHUNK(axpy_chunk_bf16, uint16_t, bf16_to_float)
DEFINE_AXPY_CHUNK(axpy_chunk_i8, int8_t, int8_to_float)
DEFINE_AXPY_CHUNK(axpy_chunk_fp8, uint8_t, fp8_to_float)
#endif

/* An int8 pool's keys are stored turned back by the rotary embedding, as q with a scale s and a zero z
 * per channel (kv_quant.py). Key t of a chunk, at position first + t, becomes float32 in turned[t]:
 * x = q * s + z, then each pair of channels (i, i + d/2) turned by that position's angles, as the
 * model turned it before storing: (x_i cos - x_j sin, x_j cos + x_i sin). */
static inline void turn_keys(float turned[][MAX_HEAD_DIM], const int8_t *const *keys, int n, int first, int d,
                             const float *scale, const float *zero, const float *cos_table,
                             const float *sin_table) {
    const int half = d / 2;
    for (int t = 0; t < n; t++) {
        const int8_t *k = keys[t];
        const float *c = cos_table + (int64_t)(first + t) * half, *s = sin_table + (int64_t)(first + t) * half;
        float *out = turned[t];
        #pragma omp simd
        for (int i = 0; i < half; i++) {
            const float a = (float)k[i] * scale[i] + zero[i];
            const float b = (float)k[i + half] * scale[i + half] + zero[i + half];
            out[i] = a * c[i] - b * s[i];
            out[i + half] = b * c[i] + a * s[i];
        }
    }
}

/* ---------------------------------------------------------------- the exported kernels
 * For each: NAME, Q (the query's and the output's type) with LOAD_Q / STORE_Q (one element to and
 * from float), P (the pool's element type) with its CHUNK_SCORES and AXPY_CHUNK. */
#define LOAD_Q_f32(x) (x)
#define STORE_Q_f32(x) (x)
#define LOAD_Q_bf16(x) bf16_to_float(x)
#define STORE_Q_bf16(x) float_to_bf16(x)

#define NAME paged_decode_f32
#define Q float
#define LOAD_Q LOAD_Q_f32
#define STORE_Q STORE_Q_f32
#define P float
#define CHUNK_SCORES chunk_scores_f32
#define AXPY_CHUNK axpy_chunk_f32
#include "paged_decode_body.h"
#undef NAME
#undef P
#undef CHUNK_SCORES
#undef AXPY_CHUNK

#define NAME paged_decode_f32_i8
#define P int8_t
#define AXPY_CHUNK axpy_chunk_i8
#define TURNED_KEYS
#include "paged_decode_body.h"
#undef TURNED_KEYS
#undef NAME
#undef P
#undef AXPY_CHUNK

#define NAME paged_decode_f32_fp8
#define P uint8_t
#define CHUNK_SCORES chunk_scores_fp8
#define AXPY_CHUNK axpy_chunk_fp8
#include "paged_decode_body.h"
#undef NAME
#undef Q
#undef LOAD_Q
#undef STORE_Q
#undef P
#undef CHUNK_SCORES
#undef AXPY_CHUNK

#define NAME paged_decode_bf16
#define Q uint16_t
#define LOAD_Q LOAD_Q_bf16
#define STORE_Q STORE_Q_bf16
#define P uint16_t
#define CHUNK_SCORES chunk_scores_bf16
#define AXPY_CHUNK axpy_chunk_bf16
#include "paged_decode_body.h"
#undef NAME
#undef P
#undef CHUNK_SCORES
#undef AXPY_CHUNK

#define NAME paged_decode_bf16_i8
#define P int8_t
#define AXPY_CHUNK axpy_chunk_i8
#define TURNED_KEYS
#include "paged_decode_body.h"
#undef TURNED_KEYS
#undef NAME
#undef P
#undef AXPY_CHUNK

#define NAME paged_decode_bf16_fp8
#define P uint8_t
#define CHUNK_SCORES chunk_scores_fp8
#define AXPY_CHUNK axpy_chunk_fp8
#include "paged_decode_body.h"
