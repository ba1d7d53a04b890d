/*
 * The cpu backend's KV store: this step's keys and values written into the paged pool where the
 * slot mapping says, in one call per layer instead of a handful of PyTorch indexing operations.
 *
 * Row i of key and value (num_kv_heads heads of head_bytes each) goes to flat pool slot
 * slot_mapping[i] (block * block_size + offset); a slot of -1 writes nowhere (a padded row). It
 * copies bytes, so one function serves every dtype. Every slot is checked before anything is
 * written: it returns 1, having written nothing, if one lies outside the pool, else 0.
 *
 * Layouts (byte strides): key (N, KV, d) with row stride k_row and head stride k_head, each head's
 * d elements contiguous; value the same with v_row, v_head; key_pool, value_pool (num_slots, KV, d)
 * contiguous.
 *
 * store_kv_int8_f32 and store_kv_int8_bf16 store into an int8 pool (kv_quant.py) from float32 or
 * bfloat16 keys and values: each key turned back by its position's rotary angles (a table of cosines
 * and sines, (num_positions, d / 2)), then every element x rounded to q = round((x - z) / s) in
 * [-127, 127] with its channel's scale s and zero z ((KV, d) each, float32). The arithmetic is the
 * Python path's (`QuantizedPools.store`) operation for operation, nothing fused, so both store the
 * same bytes. Strides there are in elements. They return 1, having written nothing, for a slot
 * outside the pool or a position outside the table, 2 for an odd head size.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "number_formats.h"

int store_kv(const char *key, int64_t k_row, int64_t k_head, const char *value, int64_t v_row, int64_t v_head,
             const int64_t *slot_mapping, int64_t num_rows, char *key_pool, char *value_pool, int64_t num_slots,
             int num_kv_heads, int64_t head_bytes) {
    for (int64_t i = 0; i < num_rows; i++)
        if (slot_mapping[i] < -1 || slot_mapping[i] >= num_slots) return 1;
    const int64_t slot_bytes = num_kv_heads * head_bytes;
    #pragma omp parallel for if (num_rows >= 64)
    for (int64_t i = 0; i < num_rows; i++) {
        const int64_t slot = slot_mapping[i];
        if (slot < 0) continue;
        for (int h = 0; h < num_kv_heads; h++) {
            memcpy(key_pool + slot * slot_bytes + h * head_bytes, key + i * k_row + h * k_head, head_bytes);
            memcpy(value_pool + slot * slot_bytes + h * head_bytes, value + i * v_row + h * v_head, head_bytes);
        }
    }
    return 0;
}

/* No a * b + c fused into one rounding here: the Python path rounds each product. */
#if defined(__clang__)
#define NO_CONTRACTION _Pragma("clang fp contract(off)")
#else
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#define NO_CONTRACTION
#endif

static inline int8_t to_int8(float x, float scale, float zero) {
    const float q = nearbyintf((x - zero) / scale);  /* to nearest, ties to even, as torch.round */
    return (int8_t)(q < -127.0f ? -127.0f : (q > 127.0f ? 127.0f : q));
}

#define LOAD_f32(x) (x)
#define LOAD_bf16(x) bf16_to_float(x)
#define DEFINE_STORE_KV_INT8(NAME, T, LOAD)                                                                   \
int NAME(const T *key, int64_t k_row, int64_t k_head, const T *value, int64_t v_row, int64_t v_head,           \
         const int64_t *slot_mapping, const int64_t *positions, int64_t num_rows, int8_t *key_pool,              \
         int8_t *value_pool, int64_t num_slots, int num_kv_heads, int head_dim, const float *key_scale,          \
         const float *key_zero, const float *value_scale, const float *value_zero, const float *turn_cos,        \
         const float *turn_sin, int64_t num_positions) {                                                         \
    NO_CONTRACTION                                                                                               \
    if (head_dim % 2) return 2;                                                                                  \
    for (int64_t i = 0; i < num_rows; i++) {                                                                     \
        if (slot_mapping[i] < -1 || slot_mapping[i] >= num_slots) return 1;                                      \
        if (slot_mapping[i] >= 0 && (positions[i] < 0 || positions[i] >= num_positions)) return 1;               \
    }                                                                                                            \
    const int half = head_dim / 2;                                                                               \
    _Pragma("omp parallel for if (num_rows >= 64)")                                                              \
    for (int64_t i = 0; i < num_rows; i++) {                                                                     \
        const int64_t slot = slot_mapping[i];                                                                    \
        if (slot < 0) continue;                                                                                  \
        const float *c = turn_cos + positions[i] * half, *s = turn_sin + positions[i] * half;                    \
        for (int g = 0; g < num_kv_heads; g++) {                                                                 \
            const T *k = key + i * k_row + g * k_head, *v = value + i * v_row + g * v_head;                      \
            const int64_t at = (slot * num_kv_heads + g) * (int64_t)head_dim;                                    \
            const float *ks = key_scale + g * head_dim, *kz = key_zero + g * head_dim;                           \
            const float *vs = value_scale + g * head_dim, *vz = value_zero + g * head_dim;                       \
            for (int j = 0; j < half; j++) {  /* the pair (j, j + half) turned back: by minus the angle */       \
                const float a = LOAD(k[j]), b = LOAD(k[j + half]);                                               \
                const float first = a * c[j] - b * -s[j], second = b * c[j] + a * -s[j];                         \
                key_pool[at + j] = to_int8(first, ks[j], kz[j]);                                                 \
                key_pool[at + j + half] = to_int8(second, ks[j + half], kz[j + half]);                           \
            }                                                                                                    \
            for (int j = 0; j < head_dim; j++) value_pool[at + j] = to_int8(LOAD(v[j]), vs[j], vz[j]);           \
        }                                                                                                        \
    }                                                                                                            \
    return 0;                                                                                                    \
}
DEFINE_STORE_KV_INT8(store_kv_int8_f32, float, LOAD_f32)
DEFINE_STORE_KV_INT8(store_kv_int8_bf16, uint16_t, LOAD_bf16)

#if !defined(__clang__)
#pragma GCC pop_options
#endif
