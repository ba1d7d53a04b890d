/*
 * The kernel's body, included once per pair of types by paged_decode.c with these macros set:
 * NAME (the exported function), Q (the query's and the output's type) with LOAD_Q / STORE_Q (one
 * element to and from float), P (the pool's element type), CHUNK_SCORES (one head's scores for a
 * chunk of keys of P) and AXPY_CHUNK (a float row plus the weighted sum of a chunk of rows of P).
 * Accumulation is always float32. With TURNED_KEYS defined (an int8 pool, P int8_t), keys are stored
 * turned back by the rotary embedding: the function takes the keys' and values' scales and zeros
 * (KV, d) and the cosines and sines of every position (positions, d / 2), turns each chunk of keys
 * before scoring, and writes the output in values (the weighted mean of stored values, scaled).
 *
 * One work item per query row b. It walks the row's block table CHUNK keys at a time. For every
 * chunk and KV head g, it computes the scores of the query heads that share g, then updates their
 * online softmax (running maximum, running sum, running numerator): each key and value is read
 * from memory once per step and layer. Blocks lie anywhere in the pool, so the CPU's prefetcher
 * cannot know where the next chunk is; while head g of this chunk is computed, head g's keys and
 * values of the chunk PREFETCH_AHEAD on are requested, a few lines at a time, so that the requests
 * overlap the arithmetic instead of stalling it in one burst.
 */
int NAME(const Q *query, int64_t q_row_stride, int64_t q_head_stride,
         const P *key_pool, const P *value_pool,
         const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
         const int64_t *rows, int64_t num_seqs, Q *out,
         int num_heads, int num_kv_heads, int head_dim, int block_size, float scale
#ifdef TURNED_KEYS
         , const float *key_scale, const float *key_zero, const float *value_scale, const float *value_zero,
         const float *turn_cos, const float *turn_sin
#endif
         ) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads || block_size <= 0
        || (int64_t)num_heads * head_dim > MAX_STATE || num_heads > MAX_HEADS)
        return 1;
#ifdef TURNED_KEYS
    if (head_dim % 2 || head_dim > MAX_HEAD_DIM)
        return 1;
#endif
    const int group = num_heads / num_kv_heads;
    const int64_t slot_stride = (int64_t)num_kv_heads * head_dim;  /* one pool slot: every KV head */
    const int64_t head_bytes = head_dim * (int64_t)sizeof(P);  /* one KV head of one slot */

    #pragma omp parallel for schedule(dynamic, 1)
    for (int64_t b = 0; b < num_seqs; b++) {
        const int length = seq_lens[b];
        const int32_t *table = block_tables + b * table_stride;
        float q[MAX_STATE];    /* the queries (head h at h * head_dim), times the softmax scale */
        float acc[MAX_STATE];  /* running numerators: sum over keys of p * v, per head */
        float running_max[MAX_HEADS], running_sum[MAX_HEADS], scores[MAX_HEADS][CHUNK];

        for (int h = 0; h < num_heads; h++) {
            const Q *src = query + rows[b] * q_row_stride + (int64_t)h * q_head_stride;
            for (int i = 0; i < head_dim; i++) q[h * head_dim + i] = LOAD_Q(src[i]) * scale;
            memset(acc + h * head_dim, 0, sizeof(float) * head_dim);
            running_max[h] = -FLT_MAX;
            running_sum[h] = 0.0f;
        }

        for (int first = 0; first < length; first += CHUNK) {
            /* Where keys first .. first + n - 1 lie, and the keys of the chunk PREFETCH_AHEAD on. */
            const int n = length - first < CHUNK ? length - first : CHUNK;
            const int ahead = first + PREFETCH_AHEAD * CHUNK;
            const int n_ahead = length - ahead < 0 ? 0 : (length - ahead < CHUNK ? length - ahead : CHUNK);
            int64_t slots[CHUNK], ahead_slots[CHUNK];
            slots_of(slots, table, block_size, first, n);
            slots_of(ahead_slots, table, block_size, ahead, n_ahead);
            for (int g = 0; g < num_kv_heads; g++) {
                const int h0 = g * group;  /* query heads h0 .. h0 + group - 1 share KV head g */
                const P *keys[CHUNK], *values[CHUNK];  /* past the chunk's end: its last row again */
                for (int t = 0; t < CHUNK; t++) {
                    const int64_t offset = slots[t < n ? t : n - 1] * slot_stride + (int64_t)g * head_dim;
                    keys[t] = key_pool + offset;
                    values[t] = value_pool + offset;
                }
                /* 1. Scores of this chunk, s = q . k, for each head of the group. */
                for (int t = 0; t < n_ahead; t++)
                    prefetch_bytes(key_pool + ahead_slots[t] * slot_stride + (int64_t)g * head_dim, head_bytes);
#ifdef TURNED_KEYS
                /* int8 keys stored turned back: read, scaled and turned to their positions once per chunk and
                   KV head, then scored as float32 keys by every head of the group. */
                float turned[CHUNK][MAX_HEAD_DIM];
                const float *turned_rows[CHUNK];
                turn_keys(turned, keys, n, first, head_dim, key_scale + (int64_t)g * head_dim,
                          key_zero + (int64_t)g * head_dim, turn_cos, turn_sin);
                for (int t = 0; t < CHUNK; t++) turned_rows[t] = turned[t < n ? t : n - 1];
                for (int h = h0; h < h0 + group; h++)
                    chunk_scores_f32(scores[h], q + h * head_dim, turned_rows, n, head_dim);
#else
                for (int h = h0; h < h0 + group; h++) CHUNK_SCORES(scores[h], q + h * head_dim, keys, n, head_dim);
#endif
                /* 2. The online softmax: a new running maximum, what was summed under the old one
                      rescaled, and this chunk's weights p = exp(s - max) added to the running sum. */
                for (int h = h0; h < h0 + group; h++) {
                    const float correction = chunk_softmax(scores[h], n, &running_max[h], &running_sum[h]);
                    float *a = acc + h * head_dim;
                    #pragma omp simd
                    for (int i = 0; i < head_dim; i++) a[i] *= correction;
                }
                /* 3. The numerators: acc += sum over the chunk of p * v, for each head of the group. */
                for (int t = 0; t < n_ahead; t++)
                    prefetch_bytes(value_pool + ahead_slots[t] * slot_stride + (int64_t)g * head_dim, head_bytes);
                for (int h = h0; h < h0 + group; h++) AXPY_CHUNK(acc + h * head_dim, scores[h], values, n, head_dim);
            }
        }

        for (int h = 0; h < num_heads; h++) {  /* out = numerator / denominator */
            Q *dst = out + (rows[b] * num_heads + h) * (int64_t)head_dim;
            const float inverse = running_sum[h] > 0.0f ? 1.0f / running_sum[h] : 0.0f;
#ifdef TURNED_KEYS  /* the mean of stored values, in values: times the value scale plus its zero */
            const float *vs = value_scale + (int64_t)(h / group) * head_dim, *vz = value_zero + (int64_t)(h / group) * head_dim;
            for (int i = 0; i < head_dim; i++) dst[i] = STORE_Q(acc[h * head_dim + i] * inverse * vs[i] + vz[i]);
#else
            for (int i = 0; i < head_dim; i++) dst[i] = STORE_Q(acc[h * head_dim + i] * inverse);
#endif
        }
    }
    return 0;
}
