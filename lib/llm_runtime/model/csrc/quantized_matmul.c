/*
 * Matrix products with 4-bit and 8-bit weights on the CPU, reading the weights as stored (lesson 13).
 *
 * At one row a product reads every weight once and does two flops with each: the Q8_0 product below
 * turns each stored weight into a float in registers, the int4 product multiplies the 4-bit values as
 * 16-bit integers, and the memory stays the bottleneck. At many rows (a prefill, a large decode batch)
 * the arithmetic dominates instead, and PyTorch's quantized kernels lose to its dense product (oneDNN,
 * bfloat16 dot instructions) by up to 3x here: so at many rows the weights are turned back into the
 * compute dtype first, once per call, and the dense product multiplies them. Turning 1.8 M weights back
 * costs about a tenth of the product it feeds at 256 rows.
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
 * and in bfloat16 only:
 *   int4_matmul_bf16   out (M, N) = x (M, K) W^T      the few-row int4 product (below)
 * Each returns 0, or 1 for shapes (or a build) it does not handle.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "number_formats.h"

#define ROWS 4 /* rows of x multiplied with each decoded weight at once (their sums stay in registers) */

#if defined(__AVX512F__)
#include <immintrin.h>
/* A prefetch of the byte `ahead` bytes past p, which may lie past the end of p's array: the address is
 * computed as an integer, so no pointer out of bounds is formed, and a prefetch never faults. (A macro: as a
 * static inline function GCC 12 dropped the prefetches of the int4 kernel, 1.3x of its speed.) */
#define PREFETCH_AHEAD(p, ahead) _mm_prefetch((const char *)((uintptr_t)(p) + (size_t)(ahead)), _MM_HINT_T0)
static inline void decode32_i8(const int8_t *q, __m512 *low, __m512 *high) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)q);
    *low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v)));
    *high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1)));
}
#endif

#if defined(__AVX512F__)
#define TILE 16 /* output rows of the Q8_0 product per work item */
#define PREFETCH_TILES 2 /* the Q8_0 product reads each block of the tile this many tiles on ahead */
#define TILED_ROWS(V) ((V) / TILE * TILE) /* the rows the tiles cover, the rest by q8_row */
/* 16 output rows v0 .. v0 + 15 of the Q8_0 product for m <= ROWS rows of x: sums[r * 16 + j] = sum_k x[r, k]
 * W[v0 + j, k]. `q` points at row v0 of block 0; block b of the tile is 16 x 32 contiguous bytes (so the
 * tile is read as 18 runs of 512 bytes, not one row's 18 scattered blocks at a time). dt, mt (blocks, 16): the
 * tile's scales and minimums in float (mt NULL: none); xsum (m, blocks): each block's sum of x, which the
 * minimum multiplies. Each block's scale multiplies its 32-term dot once, after the int8 values met x.
 * Row by row (q8_row: one row's 18 blocks 1.5 MB apart, its scales loaded one by one) the bundled model's
 * head (49,152 x 576) took 2.2 ms at one row on the 2-core CI machine, bound by the arithmetic around each
 * block; in tiles 1.26 ms, 22 GB/s, about what that machine reads from its cache. A tile reads 18 runs of
 * 512 bytes 1.5 MB apart, which the hardware's prefetchers do not see coming: asking for each run two tiles
 * ahead took the head, read from memory after 64 MB of other reads, from 1.85-2.11 ms to 1.53-1.61 ms (four
 * runs of each, alternated), with no change where it was in the cache already. */
static inline void q8_tile(const float *x, int m, const int8_t *q, const float *dt, const float *mt,
                           const float *xsum, int64_t blocks, int64_t V, float *sums) {
    const int64_t K = blocks * 32;
    for (int r = 0; r < m; r++) { /* one row of x at a time: the tile's 16 sums stay in registers */
        __m512 acc[TILE];
        for (int j = 0; j < TILE; j++) acc[j] = _mm512_setzero_ps();
        for (int64_t b = 0; b < blocks; b++) {
            const __m512 x_low = _mm512_loadu_ps(x + r * K + b * 32), x_high = _mm512_loadu_ps(x + r * K + b * 32 + 16);
            const int8_t *qb = q + b * V * 32;
            if (r == 0) /* block b of the tile PREFETCH_TILES on (this thread's, under a static schedule) */
                for (int line = 0; line < TILE * 32; line += 64)
                    PREFETCH_AHEAD(qb, TILE * 32 * PREFETCH_TILES + line);
            for (int j = 0; j < TILE; j++) {
                __m512 low, high;
                decode32_i8(qb + j * 32, &low, &high);
                const __m512 dot = _mm512_fmadd_ps(high, x_high, _mm512_mul_ps(low, x_low));
                acc[j] = _mm512_fmadd_ps(dot, _mm512_set1_ps(dt[b * TILE + j]), acc[j]);
            }
        }
        __m512 shift = _mm512_setzero_ps(); /* the minimums' part: sum over b of m[b, v] * (block b's sum of x) */
        if (mt != NULL)
            for (int64_t b = 0; b < blocks; b++)
                shift = _mm512_fmadd_ps(_mm512_loadu_ps(mt + b * TILE), _mm512_set1_ps(xsum[r * blocks + b]), shift);
        float shifts[TILE];
        _mm512_storeu_ps(shifts, shift);
        for (int j = 0; j < TILE; j++) sums[r * TILE + j] = _mm512_reduce_add_ps(acc[j]) + shifts[j];
    }
}
#else
#define TILED_ROWS(V) 0 /* no tiles: every row by q8_row */
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

/* Inside q8_matmul: the rows 0 .. tiled - 1 tile by tile (AVX-512 only; nothing otherwise). */
#if defined(__AVX512F__)
#define Q8_TILES(LOAD, STORE)                                                                          \
        _Pragma("omp parallel for schedule(static)")                                                   \
        for (int64_t v0 = 0; v0 < tiled; v0 += TILE) {                                                 \
            float dt[blocks * TILE], mt[blocks * TILE], sums[ROWS * TILE];                             \
            for (int64_t b = 0; b < blocks; b++)                                                       \
                for (int j = 0; j < TILE; j++) {                                                       \
                    dt[b * TILE + j] = LOAD(d[b * V + v0 + j]);                                        \
                    if (mins != NULL) mt[b * TILE + j] = LOAD(mins[b * V + v0 + j]);                   \
                }                                                                                      \
            q8_tile(xf + r0 * K, m, q + v0 * 32, dt, mins == NULL ? NULL : mt, xsum + r0 * blocks, blocks, V, sums); \
            for (int r = 0; r < m; r++)                                                                \
                for (int j = 0; j < TILE; j++) out[(r0 + r) * V + v0 + j] = STORE(sums[r * TILE + j]);  \
        }
#else
#define Q8_TILES(LOAD, STORE)
#endif

/*
 * The int4 product at a few rows (int4_matmul_bf16), in 16-bit integers.
 *
 * Turning each 4-bit value into a float costs an instruction or two before the multiply-add that uses it,
 * and at one row that is the whole work: PyTorch's kernel and a float version of this one (a table
 * lookup per 16 values, then a multiply-add) both stopped at 6 to 11 multiply-adds a cycle a core here,
 * against 32 for the multiply-adds alone. AVX-512 VNNI multiplies 16-bit integers in pairs and adds
 * both products to a 32-bit sum (vpdpwssd: 32 multiply-adds in one instruction, two a cycle here), and a
 * 4-bit value is a 16-bit integer once masked out of its byte, so it needs no conversion at all:
 *
 *   - the weights: one 64-byte load holds columns k and k + 1 of a block's 64 rows; one byte permute
 *     (vpermb) puts byte j of column k and byte j of column k + 1 into the two 16-bit halves of lane j,
 *     and a mask (and a shift, for the high nibbles) leaves (q[n, k], q[n, k + 1]) for 16 rows n;
 *   - the activations: each group's values as 16-bit integers t = x / step, step a power of two with the
 *     group's largest |x| just under 2^15 steps. A bfloat16 carries 8 significant bits, so every value
 *     within 2^7 of the group's largest is an exact multiple of the step; a smaller one is rounded to it,
 *     at most 2^-15 of the largest: well under the bfloat16 rounding of the result (2^-8 of it);
 *   - a group's sum over k of q * t is exact in 32 bits (at most 256 * 15 * 32767 < 2^31), and becomes
 *     out += (scale * step) * sum + (zero - 8 scale) * (the group's sum of x), in float32. So the error is
 *     the sum over k of q * scale * (t * step - x): each rounded x weighed by its weight less the group's
 *     zero point. A row with an infinity or a NaN has no step: the kernel refuses it.
 *
 * At one row on the 2-core CI machine, the bundled model's 120 int4 layers in turn (66 MB, after 40 MB of
 * other reads each time) took 4.3-5.1 ms against PyTorch's 5.7-6.8 ms (1.32x, three runs), and a program that
 * only reads the same bytes 3.4-3.9 ms: the kernel is near what the memory delivers, which is why it
 * prefetches the packed weights PREFETCH_COLUMNS columns ahead and each group's scales two groups ahead.
 * With the same weights in the cache, up to 32 rows: 1.2-2x PyTorch's kernel.
 *
 * Work items are half blocks: 16 bytes of each column of a block of 64 rows, rows 64 b + 16 h + j (low
 * nibbles) and 64 b + 32 + 16 h + j (high), j < 16, so that a layer of 576 rows is 18 items for the
 * threads, not 9. Only whole blocks (N a multiple of 64): the callers use PyTorch's kernel otherwise.
 */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define INT4_I16 1
#define PREFETCH_COLUMNS 128 /* 4 KB ahead in a block's packing */
/* acc += pairs of 16-bit products, in place (GCC's intrinsic copied every accumulator each iteration) */
#define DPWSSD(acc, a, b) __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b))

/* 32 outputs of R <= ROWS rows: sums[r * 32 + j] for rows n0 + j and n0 + 16 + j (j >= 16) of the weight,
 * n0 = 64 b + 16 h. t (R, K) the activations as int16, step and xsum (R, groups) each group's step and sum
 * of x; block: the block's packing (column k at k * 32); sz: scales_and_zeros + 2 n0 (bfloat16 pairs). */
static inline __attribute__((always_inline)) void int4_half_block(const int16_t *t, int64_t K, const int R,
        const uint8_t *block, int h, const uint16_t *sz, int64_t N, const float *step, const float *xsum,
        int64_t groups, int64_t group, float *sums) {
    uint8_t pick[64]; /* lane j: byte 16 h + j of column k, 0, byte 16 h + j of column k + 1, 0 */
    for (int j = 0; j < 16; j++) {
        pick[4 * j] = (uint8_t)(16 * h + j), pick[4 * j + 2] = (uint8_t)(32 + 16 * h + j);
        pick[4 * j + 1] = pick[4 * j + 3] = 0;
    }
    const __m512i index = _mm512_loadu_si512(pick), nibbles = _mm512_set1_epi32(0x000f000f);
    const __m512i high_half = _mm512_set1_epi32((int)0xffff0000u);
    const __mmask64 even_bytes = 0x5555555555555555ull;
    __m512 total[ROWS][2];
    for (int r = 0; r < R; r++) total[r][0] = total[r][1] = _mm512_setzero_ps();
    for (int64_t g = 0; g < 2 && g < groups; g++) { /* offsets in bytes: 2 a bfloat16 */
        PREFETCH_AHEAD(sz, g * N * 2 * 2);
        PREFETCH_AHEAD(sz, (g * N * 2 + 64) * 2);
    }
    for (int64_t g = 0; g < groups; g++) {
        if (g + 2 < groups) { /* the scales of two groups ahead: one row of (G, N, 2) apart each */
            PREFETCH_AHEAD(sz, (g + 2) * N * 2 * 2);
            PREFETCH_AHEAD(sz, ((g + 2) * N * 2 + 64) * 2);
        }
        __m512i acc[ROWS][2];
        for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
        for (int64_t k = g * group; k < (g + 1) * group; k += 2) {
            PREFETCH_AHEAD(block, (k + PREFETCH_COLUMNS) * 32);
            const __m512i pairs = _mm512_maskz_permutexvar_epi8(even_bytes, index, _mm512_loadu_si512(block + k * 32));
            const __m512i low = _mm512_and_si512(pairs, nibbles);
            const __m512i high = _mm512_and_si512(_mm512_srli_epi32(pairs, 4), nibbles);
            for (int r = 0; r < R; r++) {
                int32_t x_pair; /* t[r, k] and t[r, k + 1] */
                memcpy(&x_pair, t + r * K + k, sizeof x_pair);
                const __m512i x = _mm512_set1_epi32(x_pair);
                DPWSSD(acc[r][0], low, x);
                DPWSSD(acc[r][1], high, x);
            }
        }
        /* scales_and_zeros[g, n] = (scale, zero) in bfloat16: a float's top half each */
        const __m512i a = _mm512_loadu_si512(sz + g * N * 2), c = _mm512_loadu_si512(sz + g * N * 2 + 64);
        const __m512 scale_low = _mm512_castsi512_ps(_mm512_slli_epi32(a, 16));
        const __m512 scale_high = _mm512_castsi512_ps(_mm512_slli_epi32(c, 16));
        const __m512 eight = _mm512_set1_ps(8.0f);
        const __m512 zero_low = _mm512_fnmadd_ps(eight, scale_low,
                                                 _mm512_castsi512_ps(_mm512_and_si512(a, high_half)));
        const __m512 zero_high = _mm512_fnmadd_ps(eight, scale_high,
                                                  _mm512_castsi512_ps(_mm512_and_si512(c, high_half)));
        for (int r = 0; r < R; r++) {
            const __m512 s = _mm512_set1_ps(step[r * groups + g]), x_sum = _mm512_set1_ps(xsum[r * groups + g]);
            total[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][0]), _mm512_mul_ps(scale_low, s),
                                          _mm512_fmadd_ps(zero_low, x_sum, total[r][0]));
            total[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][1]), _mm512_mul_ps(scale_high, s),
                                          _mm512_fmadd_ps(zero_high, x_sum, total[r][1]));
        }
    }
    for (int r = 0; r < R; r++) {
        _mm512_storeu_ps(sums + r * 32, total[r][0]);
        _mm512_storeu_ps(sums + r * 32 + 16, total[r][1]);
    }
}

/* Row r of x (bfloat16) as int16 multiples of each group's step, with the steps and each group's sum of x;
 * 1 where a group holds an infinity or a NaN (there is no step for it), else 0. */
static int int4_activations(const uint16_t *x, int64_t groups, int64_t group, int16_t *t,
                            float *step, float *xsum) {
    for (int64_t g = 0; g < groups; g++) {
        const uint16_t *xg = x + g * group;
        __m512i largest = _mm512_setzero_si512(); /* of |x|'s bits: ordered as the numbers, NaN above all */
        __m512 sum = _mm512_setzero_ps();
        for (int64_t k = 0; k < group; k += 16) {
            const __m512i bits = _mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(xg + k))), 16);
            largest = _mm512_max_epu32(largest, _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)));
            sum = _mm512_add_ps(sum, _mm512_castsi512_ps(bits));
        }
        /* big in [2^(e - 127), 2^(e - 126)) for its biased exponent e: the step 2^(e - 141), the smallest
         * normal float for a group of zeros (or of values under 2^-112); e = 255: an infinity or a NaN */
        union { float f; uint32_t u; } big = {.u = _mm512_reduce_max_epu32(largest)}, s;
        const uint32_t e = big.u >> 23 & 0xffu;
        if (e == 0xffu) return 1;
        s.u = (e >= 15 ? e - 14 : 1u) << 23;
        const __m512 inverse = _mm512_set1_ps(1.0f / s.f); /* a power of two: x * inverse is exact */
        for (int64_t k = 0; k < group; k += 16) {
            const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(xg + k))), 16));
            _mm256_storeu_si256((__m256i *)(t + g * group + k),
                                _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(v, inverse))));
        }
        step[g] = s.f, xsum[g] = _mm512_reduce_add_ps(sum);
    }
    return 0;
}
#endif

int int4_matmul_bf16(const uint16_t *x, int64_t x_stride, int64_t M, const uint8_t *packed,
                     const uint16_t *scales_and_zeros, int64_t N, int64_t K, int64_t group, uint16_t *out) {
#if defined(INT4_I16)
    if (M <= 0 || N <= 0 || N % 64 || group <= 0 || group % 16 || group > 256 || K % group) return 1;
    const int64_t groups = K / group, items = N / 32;
    int16_t *t = malloc(sizeof(int16_t) * (size_t)(M * K) + 2 * sizeof(float) * (size_t)(M * groups));
    if (t == NULL) return 1;
    float *step = (float *)(t + M * K), *xsum = step + M * groups; /* (M, groups) each */
    for (int64_t r = 0; r < M; r++)
        if (int4_activations(x + r * x_stride, groups, group, t + r * K, step + r * groups, xsum + r * groups)) {
            free(t);
            return 1; /* an infinity or a NaN: PyTorch's kernel gives it its float meaning */
        }
    #pragma omp parallel for schedule(static)
    for (int64_t item = 0; item < items; item++) {
        const int64_t b = item / 2, h = item % 2, n0 = 64 * b + 16 * h;
        const uint8_t *block = packed + 64 * b * (K / 2);
        float sums[ROWS * 32];
        for (int64_t r0 = 0; r0 < M; r0 += ROWS) {
            const int m = (int)(M - r0 < ROWS ? M - r0 : ROWS);
            const int16_t *tr = t + r0 * K;
            const float *sr = step + r0 * groups, *xr = xsum + r0 * groups;
            const uint16_t *sz = scales_and_zeros + 2 * n0;
            switch (m) { /* R a constant in each: the sums stay in registers */
            case 1: int4_half_block(tr, K, 1, block, (int)h, sz, N, sr, xr, groups, group, sums); break;
            case 2: int4_half_block(tr, K, 2, block, (int)h, sz, N, sr, xr, groups, group, sums); break;
            case 3: int4_half_block(tr, K, 3, block, (int)h, sz, N, sr, xr, groups, group, sums); break;
            default: int4_half_block(tr, K, 4, block, (int)h, sz, N, sr, xr, groups, group, sums); break;
            }
            for (int r = 0; r < m; r++)
                for (int j = 0; j < 32; j++)
                    out[(r0 + r) * N + n0 + (j < 16 ? j : 16 + j)] = float_to_bf16(sums[r * 32 + j]);
        }
    }
    free(t);
    return 0;
#else
    (void)x, (void)x_stride, (void)M, (void)packed, (void)scales_and_zeros, (void)N, (void)K, (void)group, (void)out;
    return 1; /* a build without AVX-512 VNNI and VBMI: the callers use PyTorch's kernel */
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
    float *xf = malloc(sizeof(float) * (size_t)(M * K + M * blocks));                                  \
    if (xf == NULL) return 1;                                                                          \
    float *xsum = xf + M * K; /* (M, blocks): each block's sum of x */                                 \
    for (int64_t r = 0; r < M; r++)                                                                    \
        for (int64_t b = 0; b < blocks; b++) {                                                         \
            float total = 0.0f;                                                                        \
            for (int64_t k = b * 32; k < b * 32 + 32; k++) total += xf[r * K + k] = LOAD(x[r * x_stride + k]); \
            xsum[r * blocks + b] = total;                                                              \
        }                                                                                              \
    const int64_t tiled = TILED_ROWS(V); /* rows 0 .. tiled - 1 in tiles (AVX-512), the rest by row */ \
    for (int64_t r0 = 0; r0 < M; r0 += ROWS) {                                                         \
        const int m = (int)(M - r0 < ROWS ? M - r0 : ROWS);                                            \
        Q8_TILES(LOAD, STORE)                                                                          \
        _Pragma("omp parallel for schedule(static)")                                                   \
        for (int64_t v = tiled; v < V; v++) {                                                          \
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
