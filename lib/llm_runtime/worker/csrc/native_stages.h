/*
 * The stages of native_step.c that read and write activations, once per activation type: included twice,
 * with ACT and its macros defined as
 *
 *   SUF              name suffix: bf16 or f32
 *   ACT              an activation's, a norm weight's, the rotary tables' and the pool's element type
 *   LOAD(v), STORE(f), ROUND(f)   ACT -> float, float -> ACT (rounded), float -> the float ACT would hold
 *   LOAD16(p)        16 ACT at p as an __m512 (a dense weight's row)
 *   CHUNK_SCORES, AXPY_CHUNK      paged_decode.c's attention steps for a pool of ACT
 *   DOT_PAIRS        (bfloat16, where the CPU has AVX512-BF16) the dense products by vdpbf16ps, 32 weights an
 *                    instruction, instead of widening each 16 weights to float first (twice the instructions
 *                    for the same bytes: the bfloat16 step took 23.0 ms at batch 1 that way, 15.1 ms so, in two runs)
 *
 * In bfloat16 (ROUND a rounding) the stages round where the operator path's tensors are bfloat16; in float32
 * ROUND is nothing.
 */

#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)
#define FN(name) CAT(name, SUF)

/* RMSNorm of `rows` rows of x (hidden) as the operator path rounds it: x / rms(x), rounded, times the
 * weight, rounded again. */
static void FN(norm_rows)(const ACT *x, const int64_t *row_index, int64_t rows, int64_t hidden,
                          const ACT *weight, float eps, ACT *out) {
    #pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const ACT *xr = x + (row_index == NULL ? r : row_index[r]) * hidden;
        float total = 0.0f;
        for (int64_t i = 0; i < hidden; i++) {
            const float v = LOAD(xr[i]);
            total += v * v;
        }
        const float inverse = 1.0f / sqrtf(total / (float)hidden + eps);
        for (int64_t i = 0; i < hidden; i++)
            out[r * hidden + i] = STORE(LOAD(weight[i]) * ROUND(LOAD(xr[i]) * inverse));
    }
}

/* Rotary on each row's q and k heads, x * cos + rotated * sin with each product and the sum rounded (three
 * operations on tensors of ACT there), then its k and v heads stored at the row's slot (-1: nowhere). */
static void FN(rotary_store)(const NativeModel *m, const NativeLayer *layer, const NativeStep *s) {
    const int64_t d = m->head_dim, half = d / 2, heads = m->num_heads + m->num_kv_heads;
    const ACT *cos_table = (const ACT *)m->cos, *sin_table = (const ACT *)m->sin;
    ACT *key_pool = (ACT *)layer->key_pool, *value_pool = (ACT *)layer->value_pool;
    #pragma omp for schedule(static)
    for (int64_t item = 0; item < s->num_tokens * heads; item++) {
        const int64_t r = item / heads, head = item % heads;
        ACT *x = (ACT *)m->qkv + r * m->qkv_rows + head * d;
        const ACT *c = cos_table + s->positions[r] * d, *sn = sin_table + s->positions[r] * d;
        ACT turned[MAX_HEAD_DIM];
        for (int64_t i = 0; i < half; i++) {
            const float a = LOAD(x[i]), b = LOAD(x[i + half]);
            turned[i] = STORE(ROUND(a * LOAD(c[i])) + ROUND(-b * LOAD(sn[i])));
            turned[i + half] = STORE(ROUND(b * LOAD(c[i + half])) + ROUND(a * LOAD(sn[i + half])));
        }
        memcpy(x, turned, sizeof(ACT) * d);
        const int64_t slot = s->slot_mapping[r];
        if (head >= m->num_heads && slot >= 0) { /* a KV head: its key, and the value beside it in qkv */
            const int64_t g = head - m->num_heads, at = (slot * m->num_kv_heads + g) * d;
            memcpy(key_pool + at, x, sizeof(ACT) * d);
            memcpy(value_pool + at, x + m->num_kv_heads * d, sizeof(ACT) * d);
        }
    }
}

/* Attention of each row and query head over its sequence's keys 0 .. position, as paged_decode_body.h
 * computes one head (the same steps in the same order), written into attn (rows, H d). */
static void FN(attention)(const NativeModel *m, const NativeLayer *layer, const NativeStep *s) {
    const int64_t d = m->head_dim, H = m->num_heads, KV = m->num_kv_heads, group = H / KV;
    const int64_t slot_stride = KV * d, head_bytes = d * (int64_t)sizeof(ACT);
    const ACT *key_pool = (const ACT *)layer->key_pool, *value_pool = (const ACT *)layer->value_pool;
    #pragma omp for schedule(static)
    for (int64_t item = 0; item < s->num_tokens * H; item++) {
        const int64_t r = item / H, h = item % H, g = h / group;
        const int length = (int)(s->positions[r] + 1);
        const int32_t *table = s->block_tables + sequence_of(s, r) * s->table_stride;
        float q[MAX_HEAD_DIM], acc[MAX_HEAD_DIM], scores[CHUNK];
        float running_max = -FLT_MAX, running_sum = 0.0f;
        const ACT *src = (const ACT *)m->qkv + r * m->qkv_rows + h * d;
        for (int64_t i = 0; i < d; i++) q[i] = LOAD(src[i]) * m->attention_scale, acc[i] = 0.0f;
        for (int first = 0; first < length; first += CHUNK) {
            const int n = length - first < CHUNK ? length - first : CHUNK;
            const int ahead = first + PREFETCH_AHEAD * CHUNK;
            const int n_ahead = length - ahead < 0 ? 0 : (length - ahead < CHUNK ? length - ahead : CHUNK);
            int64_t slots[CHUNK], ahead_slots[CHUNK];
            slots_of(slots, table, (int)m->block_size, first, n);
            slots_of(ahead_slots, table, (int)m->block_size, ahead, n_ahead);
            const ACT *keys[CHUNK], *values[CHUNK];
            for (int t = 0; t < CHUNK; t++) {
                const int64_t offset = slots[t < n ? t : n - 1] * slot_stride + g * d;
                keys[t] = key_pool + offset;
                values[t] = value_pool + offset;
            }
            for (int t = 0; t < n_ahead; t++)
                prefetch_bytes(key_pool + ahead_slots[t] * slot_stride + g * d, head_bytes);
            CHUNK_SCORES(scores, q, keys, n, (int)d);
            const float correction = chunk_softmax(scores, n, &running_max, &running_sum);
            for (int64_t i = 0; i < d; i++) acc[i] *= correction;
            for (int t = 0; t < n_ahead; t++)
                prefetch_bytes(value_pool + ahead_slots[t] * slot_stride + g * d, head_bytes);
            AXPY_CHUNK(acc, scores, values, n, (int)d);
        }
        const float inverse = running_sum > 0.0f ? 1.0f / running_sum : 0.0f;
        ACT *dst = (ACT *)m->attn + r * H * d + h * d;
        for (int64_t i = 0; i < d; i++) dst[i] = STORE(acc[i] * inverse);
    }
}

#if defined(__AVX512F__)
/* sums[r * 32 + j] for rows r < R of x and J rows of w, j < J: R x J independent sums, so the additions into one
 * accumulator do not wait on each other (one row alone would be a chain of K / 32 dependent instructions);
 * each vector of weights loaded once for the R rows. R and J are constants where it is inlined. */
static inline __attribute__((always_inline)) void FN(dense_block)(const ACT *x, int R, int64_t K, const ACT *w,
                                                                  int J, float *sums) {
    __m512 acc[4][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < J; j++) acc[r][j] = _mm512_setzero_ps();
#if defined(DOT_PAIRS)
    for (int64_t k = 0; k < K; k += 32) { /* 16 lanes, each a pair of products */
        __m512bh xv[4];
        for (int r = 0; r < R; r++) xv[r] = (__m512bh)_mm512_loadu_si512(x + r * K + k);
        for (int j = 0; j < J; j++) {
            const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + j * K + k);
            for (int r = 0; r < R; r++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wv, xv[r]);
        }
    }
#else
    for (int64_t k = 0; k < K; k += 16) {
        __m512 xv[4];
        for (int r = 0; r < R; r++) xv[r] = LOAD16(x + r * K + k);
        for (int j = 0; j < J; j++) {
            const __m512 wv = LOAD16(w + j * K + k);
            for (int r = 0; r < R; r++) acc[r][j] = _mm512_fmadd_ps(wv, xv[r], acc[r][j]);
        }
    }
#endif
    for (int r = 0; r < R; r++)
        for (int j = 0; j < J; j++) sums[r * 32 + j] = _mm512_reduce_add_ps(acc[r][j]);
}

/* sums[r * 32 + j] = x_r . w_j for the 32 rows of w (32, K) and `rows` rows of x (rows, K), in float, rows
 * taken 4 at a time. K % 32 == 0. */
static void FN(dense_item)(const ACT *x, int64_t rows, int64_t K, const ACT *w, float *sums) {
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
        const ACT *xr = x + r0 * K;
        float *out = sums + r0 * 32;
        switch (rows - r0 < 4 ? rows - r0 : 4) { /* 4 weight rows at once: each row of x loaded once for 4 */
        case 1: for (int j = 0; j < 32; j += 4) FN(dense_block)(xr, 1, K, w + j * K, 4, out + j); break;
        case 2: for (int j = 0; j < 32; j += 4) FN(dense_block)(xr, 2, K, w + j * K, 4, out + j); break;
        case 3: for (int j = 0; j < 32; j += 4) FN(dense_block)(xr, 3, K, w + j * K, 4, out + j); break;
        default: for (int j = 0; j < 32; j += 4) FN(dense_block)(xr, 4, K, w + j * K, 4, out + j); break;
        }
    }
}

/* The 32 rows n0 .. n0 + 31 of a dense weight stacked from its parts (each part's rows a multiple of 32). */
static inline const ACT *FN(dense_rows)(DenseWeight w, int64_t n0, int64_t K) {
    int p = 0;
    while (n0 >= w.rows[p]) n0 -= w.rows[p++];
    return (const ACT *)w.part[p] + n0 * K;
}

/* out (rows, N) = x (rows, K) W^T, rounded; with `residual`, residual += that instead. */
static void FN(dense_stage)(const ACT *x, int64_t rows, int64_t K, DenseWeight w, int64_t N, ACT *out,
                            ACT *residual) {
    #pragma omp for schedule(static)
    for (int64_t item = 0; item < N / 32; item++) {
        float sums[MAX_TOKENS * 32];
        FN(dense_item)(x, rows, K, FN(dense_rows)(w, 32 * item, K), sums);
        for (int64_t r = 0; r < rows; r++)
            for (int j = 0; j < 32; j++) {
                const int64_t n = 32 * item + j;
                const ACT value = STORE(sums[r * 32 + j]);
                if (residual != NULL)
                    residual[r * N + n] = STORE(LOAD(residual[r * N + n]) + LOAD(value));
                else
                    out[r * N + n] = value;
            }
    }
}

/* act = silu(gate) * up, gate and up dense products of x: item i covers rows 32 i .. 32 i + 31 of both
 * (rows I + 32 i .. of the stacked weight), silu's output rounded before the product as there. */
static void FN(gate_up_dense)(const ACT *x, int64_t rows, int64_t K, DenseWeight w, int64_t I, ACT *act) {
    #pragma omp for schedule(static)
    for (int64_t item = 0; item < I / 32; item++) {
        float gate[MAX_TOKENS * 32], up[MAX_TOKENS * 32];
        FN(dense_item)(x, rows, K, FN(dense_rows)(w, 32 * item, K), gate);
        FN(dense_item)(x, rows, K, FN(dense_rows)(w, I + 32 * item, K), up);
        for (int64_t r = 0; r < rows; r++)
            for (int j = 0; j < 32; j++) {
                const float g = ROUND(gate[r * 32 + j]), u = ROUND(up[r * 32 + j]);
                act[r * I + 32 * item + j] = STORE(ROUND(silu(g)) * u);
            }
    }
}

/* The dense head over the rows that sample (normed into x): logits (R, vocab) of ACT; the vocabulary in items
 * of 32 rows, a last short one computed row by row. */
static void FN(head_dense)(const NativeModel *m, const NativeStep *s, const ACT *x) {
    const int64_t R = s->num_logits, K = m->hidden, V = m->vocab;
    const ACT *w = (const ACT *)m->head_dense;
    ACT *logits = (ACT *)s->logits;
    #pragma omp for schedule(static)
    for (int64_t item = 0; item < (V + 31) / 32; item++) {
        float sums[MAX_TOKENS * 32];
        const int64_t v0 = 32 * item, n = V - v0 < 32 ? V - v0 : 32;
        if (n == 32) {
            FN(dense_item)(x, R, K, w + v0 * K, sums);
        } else {
            for (int64_t r = 0; r < R; r++)
                for (int64_t j = 0; j < n; j++) {
                    float total = 0.0f;
                    for (int64_t k = 0; k < K; k++) total += LOAD(x[r * K + k]) * LOAD(w[(v0 + j) * K + k]);
                    sums[r * 32 + j] = total;
                }
        }
        for (int64_t r = 0; r < R; r++)
            for (int64_t j = 0; j < n; j++) logits[r * V + v0 + j] = STORE(sums[r * 32 + j]);
    }
}

/* The step with dense weights of ACT (native_step.py's module docstring: which models). */
int FN(native_step_dense)(const NativeModel *m, const NativeStep *s) {
    const int64_t N = s->num_tokens, hidden = m->hidden, I = m->intermediate;
    const int64_t width = m->num_heads * m->head_dim;
    if (N <= 0 || N > MAX_TOKENS || s->num_logits < 0 || s->num_logits > N || m->head_dim > MAX_HEAD_DIM
        || m->head_dim % 2 || hidden % 32 || I % 32 || width % 32 || m->qkv_rows % 32 || m->head_dense == NULL
        || m->num_heads % m->num_kv_heads || m->embed_dense == NULL)
        return 1;
    for (int64_t l = 0; l < m->num_layers; l++) {
        const NativeLayer *layer = &m->layers[l];
        const DenseWeight *weights[4] = {&layer->dqkv, &layer->dout, &layer->dgate_up, &layer->ddown};
        for (int i = 0; i < 4; i++)
            for (int p = 0; p < 3; p++)
                if (weights[i]->rows[p] % 32) return 1;
    }
    const int bad = check_step(m, s);
    if (bad) return bad;
    ACT *x = (ACT *)m->x, *h = (ACT *)m->h, *qkv = (ACT *)m->qkv, *attn = (ACT *)m->attn, *act = (ACT *)m->act;
    #pragma omp parallel
    {
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < N; r++)
            memcpy(x + r * hidden, (const ACT *)m->embed_dense + s->input_ids[r] * hidden, sizeof(ACT) * hidden);
        for (int64_t l = 0; l < m->num_layers; l++) { /* each stage ends at its `omp for`'s barrier */
            const NativeLayer *layer = &m->layers[l];
            FN(norm_rows)(x, NULL, N, hidden, (const ACT *)layer->input_norm, m->eps, h);
            FN(dense_stage)(h, N, hidden, layer->dqkv, m->qkv_rows, qkv, NULL);
            FN(rotary_store)(m, layer, s);
            FN(attention)(m, layer, s);
            FN(dense_stage)(attn, N, width, layer->dout, hidden, NULL, x);
            FN(norm_rows)(x, NULL, N, hidden, (const ACT *)layer->post_norm, m->eps, h);
            FN(gate_up_dense)(h, N, hidden, layer->dgate_up, I, act);
            FN(dense_stage)(act, N, I, layer->ddown, hidden, NULL, x);
        }
        if (s->num_logits > 0) {
            FN(norm_rows)(x, s->logits_indices, s->num_logits, hidden, (const ACT *)m->final_norm, m->eps, h);
            FN(head_dense)(m, s, h);
        }
    }
    return 0;
}
#endif

#undef FN
#undef CAT
#undef CAT_
#undef SUF /* the parameters, for the next inclusion */
#undef ACT
#undef LOAD
#undef STORE
#undef ROUND
#undef LOAD16
#undef CHUNK_SCORES
#undef AXPY_CHUNK
#undef DOT_PAIRS
