/*
 * Two of this package's operators registered from C++, so that a compiled decode step calls them without
 * entering Python (native/operators.py explains when they are used, and measures them).
 *
 * The operators `llm_runtime::int4_matmul` (model/quantized_linear.py) and `llm_runtime::cpu_paged_attention`
 * (attention/cpu_kernels.py) are Python functions: each call from a compiled graph goes through the
 * dispatcher into the interpreter, checks its arguments there and reaches the C kernels by ctypes, about
 * 25 us of a layer's attention and 6 us of an int4 product on the 2-core CI machine. A one-sequence decode
 * step of the bundled model makes 150 such calls. Here the same two operators are C++ functions under the
 * namespace `llm_runtime_native`, with the same schemas, the same checks and the same C kernels, linked
 * into this library (the .c files are compiled beside this one). `DENSE_ROWS` comes from the build, set to
 * the Python layer's constant.
 *
 * Errors match the Python versions' types: TORCH_CHECK_TYPE raises TypeError, TORCH_CHECK_VALUE ValueError.
 */
#include <ATen/core/Tensor.h>
#include <ATen/ops/_weight_int4pack_mm_for_cpu.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

#ifndef DENSE_ROWS
#error "build with -DDENSE_ROWS=<model/quantized_linear.py's DENSE_ROWS>"
#endif

// The C kernels (attention/csrc/paged_decode.c, store_kv.c; model/csrc/quantized_matmul.c); bfloat16 is
// uint16_t there.
extern "C" {
int store_kv(const char *key, int64_t k_row, int64_t k_head, const char *value, int64_t v_row, int64_t v_head,
             const int64_t *slot_mapping, int64_t num_rows, char *key_pool, char *value_pool, int64_t num_slots,
             int num_kv_heads, int64_t head_bytes);
int paged_decode_f32(const float *query, int64_t q_row_stride, int64_t q_head_stride, const float *key_pool,
                     const float *value_pool, const int32_t *block_tables, int64_t table_stride,
                     const int32_t *seq_lens, const int64_t *rows, int64_t num_seqs, float *out, int num_heads,
                     int num_kv_heads, int head_dim, int block_size, float scale);
int paged_decode_bf16(const uint16_t *query, int64_t q_row_stride, int64_t q_head_stride,
                      const uint16_t *key_pool, const uint16_t *value_pool, const int32_t *block_tables,
                      int64_t table_stride, const int32_t *seq_lens, const int64_t *rows, int64_t num_seqs,
                      uint16_t *out, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale);
int int4_dequantize_t_f32(const uint8_t *packed, const float *scales_and_zeros, int64_t N, int64_t K,
                          int64_t group, float *out);
int int4_dequantize_t_bf16(const uint8_t *packed, const uint16_t *scales_and_zeros, int64_t N, int64_t K,
                           int64_t group, uint16_t *out);
int int4_matmul_bf16(const uint16_t *x, int64_t x_stride, int64_t M, const uint8_t *packed,
                     const uint16_t *scales_and_zeros, int64_t N, int64_t K, int64_t group, uint16_t *out);
}

namespace {

bool is_kernel_dtype(at::ScalarType dtype) { return dtype == at::kFloat || dtype == at::kBFloat16; }

// W^T (K, N) in scales_and_zeros' dtype from PyTorch's CPU int4 packing, as quantized_kernels.int4_dequantize_t.
at::Tensor int4_dequantize_t(const at::Tensor &packed, const at::Tensor &scales_and_zeros, int64_t K,
                             int64_t group_size) {
    const int64_t N = packed.size(0);
    TORCH_CHECK_VALUE(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.size(1) * 2 == K && N % 2 == 0
                          && packed.is_contiguous(),
                      "packed must be contiguous uint8 (N, ", K / 2, ") with an even N, got ", packed.sizes());
    TORCH_CHECK_VALUE(group_size > 0 && K % group_size == 0 && scales_and_zeros.dim() == 3
                          && scales_and_zeros.size(0) == K / group_size && scales_and_zeros.size(1) == N
                          && scales_and_zeros.size(2) == 2 && scales_and_zeros.is_contiguous(),
                      "scales_and_zeros must be contiguous (", K / group_size, ", ", N, ", 2), got ",
                      scales_and_zeros.sizes());
    TORCH_CHECK_TYPE(is_kernel_dtype(scales_and_zeros.scalar_type()),
                     "the quantized C kernels compute in float32 and bfloat16, got ", scales_and_zeros.scalar_type());
    at::Tensor out = at::empty({K, N}, scales_and_zeros.options());  // (K, N)
    const int status = scales_and_zeros.scalar_type() == at::kFloat
        ? int4_dequantize_t_f32(packed.data_ptr<uint8_t>(), scales_and_zeros.data_ptr<float>(), N, K, group_size,
                                out.data_ptr<float>())
        : int4_dequantize_t_bf16(packed.data_ptr<uint8_t>(),
                                 static_cast<const uint16_t *>(scales_and_zeros.data_ptr()), N, K, group_size,
                                 static_cast<uint16_t *>(out.data_ptr()));
    TORCH_CHECK_VALUE(status == 0, "the int4 kernel refused K=", K, ", group ", group_size,
                      " (a multiple of 32 dividing K)");
    return out;
}

// rows (M, K) @ W^T -> (M, N padded): quantized_linear.int4_product on the CPU, where the C kernels build.
at::Tensor int4_matmul(const at::Tensor &rows, const at::Tensor &packed, int64_t group_size,
                       const at::Tensor &scales_and_zeros) {
    if (rows.size(0) > DENSE_ROWS || rows.scalar_type() == at::kFloat)  // the weight back, then a dense product
        return at::mm(rows, int4_dequantize_t(packed, scales_and_zeros, rows.size(1), group_size));
    // This package's kernel where it applies (quantized_kernels.int4_matmul), else PyTorch's.
    const int64_t N = packed.dim() == 2 ? packed.size(0) : 0, K = rows.dim() == 2 ? rows.size(1) : 0;
    if (rows.scalar_type() == at::kBFloat16 && scales_and_zeros.scalar_type() == at::kBFloat16 && rows.dim() == 2
        && rows.stride(1) == 1 && packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.size(1) * 2 == K
        && packed.is_contiguous() && group_size > 0 && K % group_size == 0 && scales_and_zeros.dim() == 3
        && scales_and_zeros.size(0) == K / group_size && scales_and_zeros.size(1) == N
        && scales_and_zeros.size(2) == 2 && scales_and_zeros.is_contiguous()) {
        at::Tensor out = at::empty({rows.size(0), N}, rows.options());  // (M, N)
        if (int4_matmul_bf16(static_cast<const uint16_t *>(rows.data_ptr()), rows.stride(0), rows.size(0),
                             packed.data_ptr<uint8_t>(), static_cast<const uint16_t *>(scales_and_zeros.data_ptr()),
                             N, K, group_size, static_cast<uint16_t *>(out.data_ptr())) == 0)
            return out;
    }
    return at::_weight_int4pack_mm_for_cpu(rows, packed, group_size, scales_and_zeros);
}

// ValueError unless every index the C kernel follows stays inside its tensor, as cpu_kernels.check_indices: rows
// in the batch, lengths within the table, every table entry within the pool. A loop over the small index
// tensors (B x max_blocks entries), nothing beside the attention that follows; dtypes and shapes checked before.
void check_indices(const at::Tensor &block_tables, const at::Tensor &seq_lens, const at::Tensor &rows,
                   int64_t num_rows, int64_t num_blocks, int64_t block_size) {
    const int64_t num_seqs = rows.size(0), width = block_tables.size(1), stride = block_tables.stride(0);
    const int64_t *row = rows.data_ptr<int64_t>();
    const int32_t *length = seq_lens.data_ptr<int32_t>(), *tables = block_tables.data_ptr<int32_t>();
    for (int64_t b = 0; b < num_seqs; b++) {
        TORCH_CHECK_VALUE(row[b] >= 0 && row[b] < num_rows, "rows must lie in [0, ", num_rows, "), got ", row[b]);
        TORCH_CHECK_VALUE(length[b] >= 1 && length[b] <= width * block_size, "seq_lens must lie in [1, ",
                          width * block_size, "] for tables of ", width, " blocks of ", block_size, ", got ",
                          length[b]);
        for (int64_t i = 0; i < width; i++) {
            const int32_t block = tables[b * stride + i];
            TORCH_CHECK_VALUE(block >= 0 && block < num_blocks, "block table entries must lie in [0, ", num_blocks,
                              "), got ", block);
        }
    }
}

// store_kv of this step's key, value (N, KV, d), then paged_decode of query (N, H, d) for every row of `rows`:
// out (N, H, d). cpu_kernels._cpu_paged_attention, with the same checks, all made before anything is written.
at::Tensor cpu_paged_attention(const at::Tensor &query, const at::Tensor &key, const at::Tensor &value,
                               const at::Tensor &key_pool, const at::Tensor &value_pool,
                               const at::Tensor &slot_mapping, const at::Tensor &block_tables,
                               const at::Tensor &seq_lens, const at::Tensor &rows) {
    const auto dtype = query.scalar_type();
    TORCH_CHECK_TYPE(key.scalar_type() == dtype && value.scalar_type() == dtype && key_pool.scalar_type() == dtype
                         && value_pool.scalar_type() == dtype && is_kernel_dtype(dtype),
                     "query, key, value and pools of one dtype in torch.float32, torch.bfloat16");
    TORCH_CHECK_TYPE(slot_mapping.scalar_type() == at::kLong && rows.scalar_type() == at::kLong
                         && block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
                     "slot_mapping and rows are int64, block_tables and seq_lens int32");
    TORCH_CHECK_VALUE(query.dim() == 3 && key.dim() == 3 && value.sizes() == key.sizes() && key_pool.dim() == 4
                          && value_pool.sizes() == key_pool.sizes() && key.size(0) == query.size(0)
                          && key_pool.size(2) == key.size(1) && key_pool.size(3) == key.size(2)
                          && query.size(2) == key.size(2) && slot_mapping.dim() == 1
                          && slot_mapping.size(0) == key.size(0) && block_tables.dim() == 2
                          && seq_lens.dim() == 1 && rows.dim() == 1 && seq_lens.size(0) == rows.size(0)
                          && block_tables.size(0) == rows.size(0),
                      "shapes disagree: query ", query.sizes(), ", key ", key.sizes(), ", value ", value.sizes(),
                      ", pools ", key_pool.sizes(), " / ", value_pool.sizes(), ", slots ", slot_mapping.sizes(),
                      ", tables ", block_tables.sizes(), ", lengths ", seq_lens.sizes(), ", rows ", rows.sizes());
    TORCH_CHECK_VALUE(query.stride(2) == 1 && key.stride(2) == 1 && value.stride(2) == 1 && key_pool.is_contiguous()
                          && value_pool.is_contiguous() && slot_mapping.is_contiguous() && rows.is_contiguous()
                          && seq_lens.is_contiguous() && block_tables.stride(1) == 1,
                      "query, key and value need a contiguous last dimension, the pools, slots, rows and lengths "
                      "to be contiguous, and each block table too");
    check_indices(block_tables, seq_lens, rows, query.size(0), key_pool.size(0), key_pool.size(1));
    const int64_t size = key.element_size(), num_slots = key_pool.size(0) * key_pool.size(1);
    const int num_heads = query.size(1), num_kv_heads = key_pool.size(2), head_dim = query.size(2);
    auto *key_bytes = static_cast<const char *>(key.data_ptr());
    auto *value_bytes = static_cast<const char *>(value.data_ptr());
    TORCH_CHECK_VALUE(store_kv(key_bytes, key.stride(0) * size, key.stride(1) * size, value_bytes,
                               value.stride(0) * size, value.stride(1) * size, slot_mapping.data_ptr<int64_t>(),
                               key.size(0), static_cast<char *>(key_pool.data_ptr()),
                               static_cast<char *>(value_pool.data_ptr()), num_slots, num_kv_heads,
                               head_dim * size) == 0,
                      "slot_mapping has a slot outside [-1, ", num_slots, ")");
    at::Tensor out = at::empty(query.sizes(), query.options());  // (N, H, d), contiguous
    const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
    const int block_size = key_pool.size(1);
    const int status = dtype == at::kFloat
        ? paged_decode_f32(query.data_ptr<float>(), query.stride(0), query.stride(1), key_pool.data_ptr<float>(),
                           value_pool.data_ptr<float>(), block_tables.data_ptr<int32_t>(), block_tables.stride(0),
                           seq_lens.data_ptr<int32_t>(), rows.data_ptr<int64_t>(), rows.size(0),
                           out.data_ptr<float>(), num_heads, num_kv_heads, head_dim, block_size, scale)
        : paged_decode_bf16(static_cast<const uint16_t *>(query.data_ptr()), query.stride(0), query.stride(1),
                            static_cast<const uint16_t *>(key_pool.data_ptr()),
                            static_cast<const uint16_t *>(value_pool.data_ptr()), block_tables.data_ptr<int32_t>(),
                            block_tables.stride(0), seq_lens.data_ptr<int32_t>(), rows.data_ptr<int64_t>(),
                            rows.size(0), static_cast<uint16_t *>(out.data_ptr()), num_heads, num_kv_heads,
                            head_dim, block_size, scale);
    TORCH_CHECK_VALUE(status == 0, "the C kernel does not handle ", num_heads, " heads over ", num_kv_heads,
                      " KV heads of dim ", head_dim, " (at most 256 query heads, and heads x head dim at most 16384)");
    return out;
}

}  // namespace

TORCH_LIBRARY(llm_runtime_native, m) {
    m.def("int4_matmul(Tensor rows, Tensor packed, SymInt group_size, Tensor scales_and_zeros) -> Tensor");
    m.def("cpu_paged_attention(Tensor query, Tensor key, Tensor value, Tensor(a3!) key_pool, Tensor(a4!) value_pool, "
          "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, Tensor rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(llm_runtime_native, CPU, m) {
    m.impl("int4_matmul", &int4_matmul);
    m.impl("cpu_paged_attention", &cpu_paged_attention);
}
