/*
 * A whole forward pass of a few tokens inside one OpenMP parallel region (lesson 19).
 *
 * Operator by operator, a batch-1 decode step of the bundled model in its 4-bit form enters 2,370 PyTorch
 * operators and 151 C kernels (lesson 19's profile); compiled, the 151 kernels and inductor's fused loops
 * remain, called from generated Python that allocates each kernel's output, the loops on one thread. Here one
 * call does it all: the threads enter once per step and stay, each stage below is split between them by
 * `omp for`, and the implicit barrier at its end is the only synchronisation between stages.
 *
 * Per layer, for N tokens (rows) of a ragged batch (decodes, the k + 1 rows of a sequence verifying drafts,
 * a short prefill chunk), with bfloat16 activations, int4 weights in PyTorch's CPU packing (lesson 13) and a
 * bfloat16 KV pool:
 *   1. RMSNorm of each row                                       items: rows
 *   2. the row's 32-column groups as int16 multiples of a step   items: rows x groups
 *   3. q, k, v as one int4 product                               items: half blocks of 32 output rows
 *   4. rotary on q and k, k and v stored in the pool             items: rows x heads
 *   5. paged attention of each row over its keys                 items: rows x query heads
 *   6. the attention output's groups, as in 2
 *   7. o's product plus the residual                             items: half blocks
 *   8-9. RMSNorm and groups again
 *   10. gate and up as one product, then silu(gate) * up         items: a gate half block with its up one
 *   11. groups of the activations; 12. down's product plus the residual
 * then the final norm of the rows that sample and the head (the GGUF's Q8_0 table, or int4) in tiles of
 * vocabulary rows. Every token's keys are stored before any row attends, so a row of a sequence with several
 * new tokens sees the ones before it, as the operator path's store-then-attend does.
 *
 * The numbers are the operator path's: this file includes the int4 and Q8_0 kernels (quantized_matmul.c) and
 * the paged attention kernel (paged_decode.c) and calls their inner functions on the same inputs, rounding to
 * bfloat16 where that path's tensors are bfloat16. What differs: the RMSNorm's sum of squares is summed in
 * another order and silu's exponential is libm's, so a rounding to bfloat16 can fall the other way now and then;
 * logits agree to bfloat16's rounding, not always bitwise (tests/worker/test_native_step.py).
 *
 * A model with dense float32 or bfloat16 weights runs the same stages without the quantizing ones, its products
 * reading the plain (out, in) matrices in items of 32 output rows (native_stages.h, included once per dtype:
 * `native_step_dense_f32`, `native_step_dense_bf16`).
 *
 * Each step function returns 0, or 1 for a shape it does not take (the caller runs the step otherwise), or one of
 * the STEP_BAD_* codes for a step whose indices point outside what they index (`check_step`: a token id past the
 * vocabulary, a slot past the pool, a block table entry past the pool or its row, a logits row past the step, a
 * position past the tables, query starts that do not partition the rows). Those are a caller's bug, refused before
 * anything is read or written: an exception in the caller (native_step.py), never memory overwritten.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "../../model/csrc/quantized_matmul.c" /* int4_half_block, int4_activations, q8_tile, q8_row, ROWS, TILE */
#undef PREFETCH_AHEAD         /* paged_decode.c's own, a number of chunks */
#include "../../attention/csrc/paged_decode.c" /* slots_of, prefetch_bytes, chunk_scores_bf16, chunk_softmax, axpy_chunk_bf16 */

#define MAX_TOKENS 64         /* rows of one step (the workspace's size is the caller's) */

typedef struct { /* one int4 layer: PyTorch's CPU packing, (G, N, 2) bfloat16 scales and zeros */
    const uint8_t *packed;
    const uint16_t *scales_and_zeros;
} Int4Weight;

typedef struct { /* one dense weight: up to 3 (rows[p], K) matrices read as one stacked (sum of rows, K) */
    const void *part[3];
    int64_t rows[3]; /* each a multiple of 32; 0 for a part not there */
} DenseWeight;

typedef struct { /* one decoder layer; the norms, the pools and dense weights in the model's dtype */
    const void *input_norm, *post_norm;     /* (hidden) */
    Int4Weight qkv, o, gate_up, down;       /* qkv: (H + 2 KV) d rows; gate_up: 2 x intermediate rows */
    DenseWeight dqkv, dout, dgate_up, ddown; /* or these, parts q, k, v and gate, up */
    void *key_pool, *value_pool;            /* (blocks, block_size, KV, d) */
} NativeLayer;

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, vocab;
    int64_t group;      /* columns per int4 group (every layer's) */
    int64_t qkv_rows;   /* (H + 2 KV) d, a multiple of 64 */
    int64_t block_size; /* tokens per KV block */
    float eps, attention_scale;
    const NativeLayer *layers;
    const void *final_norm;
    const int8_t *embed_q; const uint16_t *embed_d;   /* a Q8_0 table (blocks, V, 32), (blocks, V); or */
    const void *embed_dense;                          /* (V, hidden), the model's dtype */
    const int8_t *head_q; const uint16_t *head_d;     /* the head: a Q8_0 table; or */
    Int4Weight head_int4; int64_t head_rows;          /* int4, head_rows (vocab padded to 64); or */
    const void *head_dense;                           /* (V, hidden) in the model's dtype */
    const void *cos, *sin; int64_t max_positions;     /* (max_positions, d) each, the model's own tables */
    int64_t num_blocks;                               /* the pool's blocks (every layer's pools hold this many) */
    /* workspace, for MAX_TOKENS rows (the caller's buffers) */
    void *x, *h, *qkv, *attn, *act;                   /* (rows, hidden) x 2, (rows, qkv_rows), (rows, H d), (rows, I) */
    int16_t *t; float *step, *xsum;                   /* (rows, max K), (rows, max K / group) each */
    float *xf, *xblock;                               /* the head's input in float, and its blocks' sums */
} NativeModel;

typedef struct {
    int64_t num_tokens, num_logits;
    const int64_t *input_ids, *positions, *slot_mapping, *logits_indices; /* (N,), .., (R,) */
    const int32_t *query_start_loc, *block_tables;                        /* (B + 1,), (B, table_stride) */
    int64_t num_seqs, table_stride, table_width;                          /* block_tables' rows: width entries */
    void *logits;                                                         /* (R, vocab), the model's dtype */
} NativeStep;

enum { STEP_BAD_SEQUENCES = 2, STEP_BAD_TOKEN, STEP_BAD_POSITION, STEP_BAD_SLOT, STEP_BAD_BLOCK, STEP_BAD_LOGITS_ROW };

static inline float silu(float x) { return x / (1.0f + expf(-x)); }
static inline float round_bf16(float x) { return bf16_to_float(float_to_bf16(x)); } /* a bfloat16 tensor's value */

/* Each row's groups of `group` columns as the int4 kernel's int16 multiples (int4_activations). A group that
 * holds an infinity or a NaN has none: it sets *failed, and the step goes on (every thread must meet every
 * barrier) to be run again by the operator path, which gives such numbers their float meaning. */
static void quantize_rows(const uint16_t *x, int64_t rows, int64_t K, int64_t group, int16_t *t, float *step,
                          float *xsum, int *failed) {
    const int64_t groups = K / group;
    #pragma omp for schedule(static)
    for (int64_t item = 0; item < rows * groups; item++) {
        const int64_t r = item / groups, g = item % groups;
        if (int4_activations(x + r * K + g * group, 1, group, t + r * K + g * group, step + r * groups + g,
                             xsum + r * groups + g)) {
            #pragma omp atomic write
            *failed = 1;
        }
    }
}

/* 32 outputs (a half block: rows n0 .. n0 + 15 and n0 + 32 .. n0 + 47) of an int4 product for `rows` rows,
 * rounded to bfloat16: sums[r * 32 + j], j >= 16 for the second 16. */
static void int4_item(const int16_t *t, const float *step, const float *xsum, int64_t rows, int64_t K,
                      int64_t group, Int4Weight w, int64_t N, int64_t item, float *sums) {
    const int64_t b = item / 2, h = item % 2, n0 = 64 * b + 16 * h, groups = K / group;
    const uint8_t *block = w.packed + 64 * b * (K / 2);
    const uint16_t *sz = w.scales_and_zeros + 2 * n0;
    for (int64_t r0 = 0; r0 < rows; r0 += ROWS) {
        const int m = (int)(rows - r0 < ROWS ? rows - r0 : ROWS);
        const int16_t *tr = t + r0 * K;
        const float *sr = step + r0 * groups, *xr = xsum + r0 * groups;
        float *out = sums + r0 * 32;
        switch (m) { /* R a constant in each, as in int4_matmul_bf16 */
        case 1: int4_half_block(tr, K, 1, block, (int)h, sz, N, sr, xr, groups, group, out); break;
        case 2: int4_half_block(tr, K, 2, block, (int)h, sz, N, sr, xr, groups, group, out); break;
        case 3: int4_half_block(tr, K, 3, block, (int)h, sz, N, sr, xr, groups, group, out); break;
        default: int4_half_block(tr, K, 4, block, (int)h, sz, N, sr, xr, groups, group, out); break;
        }
    }
}

static inline int64_t half_block_row(int64_t item, int j) { /* output row of lane j of a half block */
    return 64 * (item / 2) + 16 * (item % 2) + (j < 16 ? j : 16 + j);
}

/* out (rows, N) = the int4 product, rounded to bfloat16; with `residual`, residual += that instead. */
static void int4_stage(const int16_t *t, const float *step, const float *xsum, int64_t rows, int64_t K,
                       int64_t group, Int4Weight w, int64_t N, int64_t keep, uint16_t *out, uint16_t *residual) {
    #pragma omp for schedule(static)
    for (int64_t item = 0; item < N / 32; item++) {
        float sums[MAX_TOKENS * 32];
        int4_item(t, step, xsum, rows, K, group, w, N, item, sums);
        for (int64_t r = 0; r < rows; r++)
            for (int j = 0; j < 32; j++) {
                const int64_t n = half_block_row(item, j);
                if (n >= keep) continue; /* the padding rows of a layer */
                const uint16_t value = float_to_bf16(sums[r * 32 + j]);
                if (residual != NULL)
                    residual[r * keep + n] = float_to_bf16(bf16_to_float(residual[r * keep + n]) + bf16_to_float(value));
                else
                    out[r * keep + n] = value;
            }
    }
}

/* gate and up as one product (gate rows 0 .. I - 1, up rows I .. 2 I - 1) and act = silu(gate) * up, silu's
 * output rounded to bfloat16 before the product as there: item i covers gate's half block i and up's half
 * block i + I / 32, whose rows are the same rows plus I. */
static void gate_up_stage(const int16_t *t, const float *step, const float *xsum, int64_t rows, int64_t K,
                          int64_t group, Int4Weight w, int64_t I, uint16_t *act) {
    #pragma omp for schedule(static)
    for (int64_t item = 0; item < I / 32; item++) {
        float gate[MAX_TOKENS * 32], up[MAX_TOKENS * 32];
        int4_item(t, step, xsum, rows, K, group, w, 2 * I, item, gate);
        int4_item(t, step, xsum, rows, K, group, w, 2 * I, item + I / 32, up);
        for (int64_t r = 0; r < rows; r++)
            for (int j = 0; j < 32; j++) {
                const float g = round_bf16(gate[r * 32 + j]), u = round_bf16(up[r * 32 + j]);
                act[r * I + half_block_row(item, j)] = float_to_bf16(round_bf16(silu(g)) * u);
            }
    }
}

/* Row r's sequence: the b with query_start_loc[b] <= r < query_start_loc[b + 1]. */
static inline int64_t sequence_of(const NativeStep *s, int64_t r) {
    int64_t b = 0;
    while (b + 1 < s->num_seqs && s->query_start_loc[b + 1] <= r) b++;
    return b;
}

/* 0 when every index the step reads or writes through lies inside what it indexes; else the first STEP_BAD_* that
 * does not. A few hundred comparisons for a step of a few tokens (nothing next to its weights' reading). */
static int check_step(const NativeModel *m, const NativeStep *s) {
    const int64_t N = s->num_tokens, B = s->num_seqs, slots = m->num_blocks * m->block_size;
    if (B <= 0 || B > N || s->table_width < 0 || s->table_stride < s->table_width || s->query_start_loc[0] != 0
        || s->query_start_loc[B] != N)
        return STEP_BAD_SEQUENCES;
    for (int64_t b = 0; b < B; b++)
        if (s->query_start_loc[b + 1] < s->query_start_loc[b]) return STEP_BAD_SEQUENCES;
    for (int64_t r = 0; r < N; r++) {
        const int64_t position = s->positions[r];
        if (s->input_ids[r] < 0 || s->input_ids[r] >= m->vocab) return STEP_BAD_TOKEN;
        if (position < 0 || position >= m->max_positions) return STEP_BAD_POSITION;
        if (s->slot_mapping[r] < -1 || s->slot_mapping[r] >= slots) return STEP_BAD_SLOT;
        const int64_t blocks = position / m->block_size + 1; /* the blocks this row's attention reads */
        if (blocks > s->table_width) return STEP_BAD_BLOCK;
        const int32_t *table = s->block_tables + sequence_of(s, r) * s->table_stride;
        for (int64_t i = 0; i < blocks; i++)
            if (table[i] < 0 || table[i] >= m->num_blocks) return STEP_BAD_BLOCK;
    }
    for (int64_t r = 0; r < s->num_logits; r++)
        if (s->logits_indices[r] < 0 || s->logits_indices[r] >= N) return STEP_BAD_LOGITS_ROW;
    return 0;
}

#undef CHUNK_SCORES /* paged_decode.c's last instantiation's */
#undef AXPY_CHUNK
#define SUF bf16
#define ACT uint16_t
#define LOAD(v) bf16_to_float(v)
#define STORE(f) float_to_bf16(f)
#define ROUND(f) round_bf16(f)
#define LOAD16(p) load16_bf16(p)
#define CHUNK_SCORES chunk_scores_bf16
#define AXPY_CHUNK axpy_chunk_bf16
#if defined(__AVX512BF16__)
#define DOT_PAIRS
#endif
#include "native_stages.h" /* norm_rows_bf16, rotary_store_bf16, attention_bf16, native_step_dense_bf16, ...
                              (it undefines these parameters) */

#define SUF f32
#define ACT float
#define LOAD(v) (v)
#define STORE(f) (f)
#define ROUND(f) (f)
#define LOAD16(p) _mm512_loadu_ps(p)
#define CHUNK_SCORES chunk_scores_f32
#define AXPY_CHUNK axpy_chunk_f32
#include "native_stages.h" /* the same in float32: native_step_dense_f32 */

/* The embedding rows of the step's tokens, in bfloat16 (a Q8_0 row: q * d per block, rounded). */
static void embed_stage(const NativeModel *m, const NativeStep *s) {
    const int64_t K = m->hidden, blocks = K / 32;
    #pragma omp for schedule(static)
    for (int64_t r = 0; r < s->num_tokens; r++) {
        const int64_t token = s->input_ids[r];
        uint16_t *x = (uint16_t *)m->x + r * K;
        if (m->embed_dense != NULL) {
            memcpy(x, (const uint16_t *)m->embed_dense + token * K, sizeof(uint16_t) * K);
            continue;
        }
        for (int64_t b = 0; b < blocks; b++) {
            const int8_t *q = m->embed_q + (b * m->vocab + token) * 32;
            const float scale = bf16_to_float(m->embed_d[b * m->vocab + token]);
            for (int j = 0; j < 32; j++) x[b * 32 + j] = float_to_bf16((float)q[j] * scale);
        }
    }
}

/* The head over the rows that sample (already normed into m->h): logits (R, vocab) in bfloat16. */
static void head_stage(const NativeModel *m, const NativeStep *s, int *failed) {
    const int64_t R = s->num_logits, K = m->hidden, V = m->vocab;
    const uint16_t *h = (const uint16_t *)m->h;
    uint16_t *logits = (uint16_t *)s->logits;
    if (m->head_q == NULL) { /* int4 */
        quantize_rows(h, R, K, m->group, m->t, m->step, m->xsum, failed);
        int4_stage(m->t, m->step, m->xsum, R, K, m->group, m->head_int4, m->head_rows, V, logits, NULL);
        return;
    }
    const int64_t blocks = K / 32;
    #pragma omp for schedule(static)
    for (int64_t r = 0; r < R; r++) /* the rows in float, and each block's sum (the Q8_0 kernel's input) */
        for (int64_t b = 0; b < blocks; b++) {
            float total = 0.0f;
            for (int64_t k = b * 32; k < b * 32 + 32; k++) total += m->xf[r * K + k] = bf16_to_float(h[r * K + k]);
            m->xblock[r * blocks + b] = total;
        }
    const int64_t tiled = TILED_ROWS(V);
#if defined(__AVX512F__)
    #pragma omp for schedule(static)
    for (int64_t v0 = 0; v0 < tiled; v0 += TILE) {
        float dt[blocks * TILE], sums[ROWS * TILE];
        for (int64_t b = 0; b < blocks; b++)
            for (int j = 0; j < TILE; j++) dt[b * TILE + j] = bf16_to_float(m->head_d[b * V + v0 + j]);
        for (int64_t r0 = 0; r0 < R; r0 += ROWS) {
            const int rows = (int)(R - r0 < ROWS ? R - r0 : ROWS);
            q8_tile(m->xf + r0 * K, rows, m->head_q + v0 * 32, dt, NULL, m->xblock + r0 * blocks, blocks, V, sums);
            for (int r = 0; r < rows; r++)
                for (int j = 0; j < TILE; j++) logits[(r0 + r) * V + v0 + j] = float_to_bf16(sums[r * TILE + j]);
        }
    }
#endif
    #pragma omp for schedule(static)
    for (int64_t v = tiled; v < V; v++) {
        float d_v[blocks], m_v[blocks], sums[ROWS];
        for (int64_t b = 0; b < blocks; b++) d_v[b] = bf16_to_float(m->head_d[b * V + v]), m_v[b] = 0.0f;
        for (int64_t r0 = 0; r0 < R; r0 += ROWS) {
            const int rows = (int)(R - r0 < ROWS ? R - r0 : ROWS);
            q8_row(m->xf + r0 * K, rows, m->head_q + v * 32, d_v, m_v, blocks, V, sums);
            for (int r = 0; r < rows; r++) logits[(r0 + r) * V + v] = float_to_bf16(sums[r]);
        }
    }
}

int native_step_bf16(const NativeModel *m, const NativeStep *s) {
#if defined(INT4_I16)
    const int64_t N = s->num_tokens, hidden = m->hidden, I = m->intermediate, group = m->group;
    if (N <= 0 || N > MAX_TOKENS || s->num_logits < 0 || s->num_logits > N || m->head_dim > MAX_HEAD_DIM
        || m->head_dim % 2 || hidden % 64 || I % 64 || m->qkv_rows % 64 || group <= 0 || group % 16
        || group > 256 || hidden % group || I % group || (m->num_heads * m->head_dim) % group
        || m->num_heads % m->num_kv_heads)
        return 1;
    const int bad = check_step(m, s);
    if (bad) return bad;
    int failed = 0; /* shared: set by a stage, read after the region */
    uint16_t *x = (uint16_t *)m->x, *h = (uint16_t *)m->h;
    #pragma omp parallel
    {
        embed_stage(m, s);
        for (int64_t l = 0; l < m->num_layers; l++) { /* each stage ends at its `omp for`'s barrier */
            const NativeLayer *layer = &m->layers[l];
            const int64_t width = m->num_heads * m->head_dim;
            norm_rows_bf16(x, NULL, N, hidden, layer->input_norm, m->eps, h);
            quantize_rows(h, N, hidden, group, m->t, m->step, m->xsum, &failed);
            int4_stage(m->t, m->step, m->xsum, N, hidden, group, layer->qkv, m->qkv_rows, m->qkv_rows, m->qkv, NULL);
            rotary_store_bf16(m, layer, s);
            attention_bf16(m, layer, s);
            quantize_rows(m->attn, N, width, group, m->t, m->step, m->xsum, &failed);
            int4_stage(m->t, m->step, m->xsum, N, width, group, layer->o, hidden, hidden, NULL, x);
            norm_rows_bf16(x, NULL, N, hidden, layer->post_norm, m->eps, h);
            quantize_rows(h, N, hidden, group, m->t, m->step, m->xsum, &failed);
            gate_up_stage(m->t, m->step, m->xsum, N, hidden, group, layer->gate_up, I, m->act);
            quantize_rows(m->act, N, I, group, m->t, m->step, m->xsum, &failed);
            int4_stage(m->t, m->step, m->xsum, N, I, group, layer->down, hidden, hidden, NULL, x);
        }
        if (s->num_logits > 0) {
            norm_rows_bf16(x, s->logits_indices, s->num_logits, hidden, m->final_norm, m->eps, h);
            head_stage(m, s, &failed);
        }
    }
    return failed ? 1 : 0;
#else
    (void)m, (void)s;
    return 1; /* a build without AVX-512 VNNI and VBMI */
#endif
}

/* 1 where this build has the int4 kernel the step runs on (AVX-512 with VNNI and VBMI), else 0. */
int native_step_available(void) {
#if defined(INT4_I16)
    return 1;
#else
    return 0;
#endif
}

/* 1 where this build has the dense steps (native_step_dense_bf16, native_step_dense_f32: AVX-512), else 0. */
int native_step_dense_available(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}
