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
 */
#include <stdint.h>
#include <string.h>

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
