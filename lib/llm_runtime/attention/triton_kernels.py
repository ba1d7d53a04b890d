"""Triton kernels for paged attention: the KV store, one unified kernel for the mixed batch, split-KV decode.

Three kernels, each with a Python launch wrapper below it:

- `store_kv_kernel`: one program per new token copies its keys and values into the pool slot the
  slot mapping names (a slot < 0 is padding and writes nothing).
- `unified_attention_kernel`: the whole ragged batch (prefill chunks, extends over a cached prefix,
  decodes) in one launch. A program owns a tile of one sequence's new queries and one KV head (with
  every query head that shares it under GQA) and walks that sequence's keys straight out of the
  pool through its block table, with an online softmax; nothing is gathered or copied.
- `split_kv_decode_kernel` + `split_kv_reduce_kernel` (flash-decoding): for a batch of decodes
  over long contexts, each sequence's keys are cut into partitions handled by separate programs,
  which write a partial (max, sum, unnormalized output); the reduce kernel merges them.

Layouts (vLLM's): queries and outputs (N, num_heads, head_dim), new keys and values (N, num_kv_heads,
head_dim), pools (num_blocks, block_size, num_kv_heads, head_dim); any strides. Scores and
accumulators are float32 whatever the input dtype.

Triton decides when a function is decorated whether it compiles for the GPU or runs under its
interpreter, and its own library (tl.max, tl.cdiv ...) is decorated when triton is imported: to run
these kernels on CPU tensors, set TRITON_INTERPRET=1 before triton is first imported. The
interpreter runs the programs one after another in NumPy, which has no bfloat16 (it holds bf16 as
raw uint16 bits, so arithmetic on it is garbage); on the CPU the kernels therefore cast every tile
to float32 before computing (`COMPUTE_FP32`), and the interpreter's float32 -> bfloat16 store
truncates instead of rounding to nearest. It is also lenient where the compiler is not (a dot of
mismatched dtypes runs in NumPy), so the tests compile the kernels for real GPU targets as well.

A Triton launch goes to the current CUDA device (and its current stream), whatever device its tensors
are on: an engine on cuda:1 while cuda:0 is current would run its kernels on cuda:0, over addresses of
the other GPU. So each wrapper checks that its tensors share one device and launches under that device's
guard (`triton_launch.on_device`), as PyTorch's own operators do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_launch import check_attention_inputs, check_devices, dot_settings, on_device

# Keys per inner-loop step (a tile may span several pool blocks, or part of one).
DEFAULT_BLOCK_N = 32


# ---------------------------------------------------------------------------------------------
# Storing this step's keys and values
# ---------------------------------------------------------------------------------------------


@triton.jit
def store_kv_kernel(
    key_ptr, value_ptr,  # (N, KV, d): this step's new keys and values
    key_pool_ptr, value_pool_ptr,  # (num_blocks, block_size, KV, d): the layer's pools
    slot_mapping_ptr,  # (N,) int64: flat slot block * block_size + offset, or < 0 for "nowhere"
    stride_kt, stride_kh, stride_kd,  # key strides (token, head, dim)
    stride_vt, stride_vh, stride_vd,  # value strides
    stride_pb, stride_ps, stride_ph, stride_pd,  # pool strides (block, slot in block, head, dim)
    BLOCK_SIZE: tl.constexpr,  # tokens per pool block
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,  # the two above, rounded up to powers of two
):
    # One program owns one new token: all its KV heads and dims, a (BLOCK_H, BLOCK_D) tile.
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:  # a padded token: write nowhere
        return
    block = slot // BLOCK_SIZE  # which pool block ...
    offset = slot % BLOCK_SIZE  # ... and which slot inside it
    heads = tl.arange(0, BLOCK_H)  # (BLOCK_H,)
    dims = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    # The tile is padded up to powers of two; the mask keeps it inside the real heads and dims.
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)  # (BLOCK_H, BLOCK_D)
    key = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :] * stride_kd, mask=mask)
    value = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :] * stride_vd, mask=mask)
    # int64 offsets: a large pool has more than 2**31 elements.
    dest = block * stride_pb + offset * stride_ps + heads[:, None] * stride_ph + dims[None, :] * stride_pd
    tl.store(key_pool_ptr + dest, key, mask=mask)
    tl.store(value_pool_ptr + dest, value, mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key, value (N, KV, d) into the pools (num_blocks, block_size, KV, d) at `slot_mapping` (N,)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key_pool.stride() != value_pool.stride():
        raise ValueError("key_pool and value_pool must have the same strides")
    check_devices(key=key, value=value, key_pool=key_pool, value_pool=value_pool, slot_mapping=slot_mapping)
    with on_device(key):
        store_kv_kernel[(num_tokens,)](
            key, value, key_pool, value_pool, slot_mapping,
            *key.stride(), *value.stride(), *key_pool.stride(),
            BLOCK_SIZE=key_pool.shape[1], NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
            BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        )


# ---------------------------------------------------------------------------------------------
# Unified attention over the mixed ragged batch
# ---------------------------------------------------------------------------------------------


@triton.jit
def _find_sequence(query_start_loc_ptr, q_tile, num_seqs, BLOCK_Q: tl.constexpr):
    """Which sequence query tile `q_tile` belongs to, by binary search.

    Sequence b's tiles are numbered from query_start_loc[b] // BLOCK_Q + b on: a sequence of
    q_len queries needs at most cdiv(q_len, BLOCK_Q) tiles, and this numbering leaves room for
    them without any host-side table. Returns the last b whose first tile is <= q_tile.
    """
    left = 0
    right = num_seqs
    while left < right:
        mid = (left + right) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= q_tile:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def unified_attention_kernel(
    out_ptr,  # (N, H, d) output
    query_ptr,  # (N, H, d)
    key_pool_ptr, value_pool_ptr,  # (num_blocks, block_size, KV, d)
    block_tables_ptr,  # (B, max_num_blocks) int32
    seq_lens_ptr,  # (B,) int32: keys of each sequence, this step's included
    query_start_loc_ptr,  # (B + 1,) int32: sequence b owns rows query_start_loc[b] .. [b + 1] - 1
    scale,  # head_dim ** -0.5
    num_seqs,
    stride_qt, stride_qh, stride_qd,  # query strides (token, head, dim)
    stride_ot, stride_oh, stride_od,  # output strides
    stride_pb, stride_ps, stride_ph, stride_pd,  # pool strides (block, slot, head, dim)
    stride_bt,  # block table row stride
    BLOCK_SIZE: tl.constexpr,  # tokens per pool block
    NUM_QUERIES_PER_KV: tl.constexpr,  # H // KV: query heads sharing one KV head
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # rows per program: BLOCK_Q tokens x NUM_QUERIES_PER_KV heads, padded to a power of two
    BLOCK_N: tl.constexpr,  # keys per inner step
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,  # head_dim and its power-of-two padding
    COMPUTE_FP32: tl.constexpr,  # cast tiles to float32 before the dots (the CPU interpreter)
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 inputs: no TF32 shortcut on the GPU
):
    # Grid: (query tiles, KV heads). This program owns BLOCK_Q consecutive new tokens of one
    # sequence and KV head `kv_head`, together with the NUM_QUERIES_PER_KV query heads that read
    # it: one (BLOCK_M, d) block of queries. Loading each key tile once for the whole group is why
    # a program takes the group rather than a single query head.
    q_tile = tl.program_id(0)
    kv_head = tl.program_id(1)

    # --- Which sequence and which of its queries this program owns.
    seq = _find_sequence(query_start_loc_ptr, q_tile, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)  # first row of the sequence in the flat batch
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start  # its new tokens this step
    tile_in_seq = q_tile - (q_start // BLOCK_Q + seq)
    if tile_in_seq * BLOCK_Q >= q_len:  # a spare tile of the grid's upper bound: nothing to do
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # keys cached before this step

    # Row m of the block is query token m // NUM_QUERIES_PER_KV of the tile, query head
    # kv_head * NUM_QUERIES_PER_KV + m % NUM_QUERIES_PER_KV: the group's heads side by side.
    offs_m = tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    q_in_seq = tile_in_seq * BLOCK_Q + offs_m // NUM_QUERIES_PER_KV  # (BLOCK_M,) which new token
    head = kv_head * NUM_QUERIES_PER_KV + offs_m % NUM_QUERIES_PER_KV  # (BLOCK_M,) which query head
    # Rows past BLOCK_Q * NUM_QUERIES_PER_KV (padding to a power of two) or past the sequence's
    # last new token hold nothing: they load zeros and are never stored.
    row_ok = (offs_m < BLOCK_Q * NUM_QUERIES_PER_KV) & (q_in_seq < q_len)  # (BLOCK_M,)
    query_pos = context_len + q_in_seq  # (BLOCK_M,) position of each row's token in its sequence
    offs_d = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    d_ok = offs_d < HEAD_DIM  # head dims that are not powers of two are padded with zeros

    q_ptrs = query_ptr + (q_start + q_in_seq)[:, None] * stride_qt + head[:, None] * stride_qh \
        + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_M, BLOCK_D)
    if COMPUTE_FP32:
        q = q.to(tl.float32)

    # --- Online softmax state, one entry per row: running max, running sum of exp, output.
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # (BLOCK_M,) max score seen so far
    l_i = tl.zeros([BLOCK_M], tl.float32)  # (BLOCK_M,) sum of exp(score - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)  # (BLOCK_M, BLOCK_D) sum of exp(score - m_i) * value

    # The tile's last token sits at position context_len + (tile_in_seq + 1) * BLOCK_Q - 1 at most:
    # causality means no row needs a key past it, so the walk stops there (or at seq_len).
    kv_end = tl.minimum(seq_len, context_len + (tile_in_seq + 1) * BLOCK_Q)
    offs_n = tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    table_row = block_tables_ptr + seq * stride_bt
    for start_n in range(0, kv_end, BLOCK_N):
        key_pos = start_n + offs_n  # (BLOCK_N,) positions of this step's keys in the sequence
        key_ok = key_pos < kv_end  # (BLOCK_N,)
        # The paging: key position p lives in pool block table[p // BLOCK_SIZE], slot p % BLOCK_SIZE.
        # int64 before multiplying by the block stride: a large pool has more than 2**31 elements.
        block = tl.load(table_row + key_pos // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)  # (BLOCK_N,)
        slot = (block * stride_pb + (key_pos % BLOCK_SIZE) * stride_ps + kv_head * stride_ph)  # (BLOCK_N,)
        # Keys are loaded transposed, (BLOCK_D, BLOCK_N), ready for Q @ K^T; values (BLOCK_N, BLOCK_D).
        k = tl.load(key_pool_ptr + slot[None, :] + offs_d[:, None] * stride_pd,
                    mask=key_ok[None, :] & d_ok[:, None], other=0.0)  # (BLOCK_D, BLOCK_N)
        v = tl.load(value_pool_ptr + slot[:, None] + offs_d[None, :] * stride_pd,
                    mask=key_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_N, BLOCK_D)
        if COMPUTE_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        # Scores, float32 whatever the input dtype.
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale  # (BLOCK_M, BLOCK_N)
        # The mask: a row sees the keys at or before its own position (causal), of its own
        # sequence (key_ok stops at kv_end <= seq_len); everything else scores -inf.
        visible = key_ok[None, :] & (key_pos[None, :] <= query_pos[:, None])  # (BLOCK_M, BLOCK_N)
        s = tl.where(visible, s, float("-inf"))

        # The online-softmax update. With a new max m_new, everything accumulated so far was
        # scaled by exp(-m_i) and must now be scaled by exp(-m_new): multiply it by
        # alpha = exp(m_i - m_new), then add this tile's exp(s - m_new) terms.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # (BLOCK_M,)
        # A row that has seen no visible key yet (padding rows) still has max -inf; subtracting
        # 0 instead keeps exp(-inf - -inf) = NaN out: its p and alpha are then exp(-inf) = 0.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # (BLOCK_M,)
        p = tl.exp(s - m_safe[:, None])  # (BLOCK_M, BLOCK_N), 0 where masked
        alpha = tl.exp(m_i - m_safe)  # (BLOCK_M,), 0 on the first visible tile (m_i = -inf)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # P @ V in the values' dtype (bf16/fp16 tensor cores on the GPU), accumulated in float32.
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # --- Normalize and store. Every real row saw key 0, so its l_i > 0; padding rows are masked out.
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # (BLOCK_M, BLOCK_D)
    out_ptrs = out_ptr + (q_start + q_in_seq)[:, None] * stride_ot + head[:, None] * stride_oh \
        + offs_d[None, :] * stride_od
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def unified_attention(
    query: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    max_query_len: int,
    scale: float,
    block_n: int = DEFAULT_BLOCK_N,
    block_m: int | None = None,
) -> torch.Tensor:
    """Paged causal attention for a ragged batch, query (N, H, d) -> (N, H, d), in one launch. `block_m`: rows
    per program, fixed (rounded up to a whole GQA group); None chooses it from `max_query_len`."""
    check_attention_inputs(query, key_pool, value_pool, block_tables, seq_lens, query_start_loc)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_pool.shape[2]
    num_seqs = seq_lens.shape[0]
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return out
    if key_pool.stride() != value_pool.stride():
        raise ValueError("key_pool and value_pool must have the same strides")
    per_kv = num_heads // num_kv_heads
    # Rows per program: 16 at least (tl.dot's smallest tile), 64 when the batch has long chunks
    # (more queries per key tile loaded), and at least one whole GQA group.
    if block_m is None:
        block_m = 16 if max_query_len * per_kv <= 16 else 64
    block_m = max(block_m, triton.next_power_of_2(per_kv))
    block_q = block_m // per_kv  # query tokens per program
    # An upper bound on the tiles the batch needs (see _find_sequence); spare programs return at once.
    num_q_tiles = num_tokens // block_q + num_seqs
    with on_device(query):
        unified_attention_kernel[(num_q_tiles, num_kv_heads)](
            out, query, key_pool, value_pool, block_tables, seq_lens, query_start_loc, scale, num_seqs,
            *query.stride(), *out.stride(), *key_pool.stride(), block_tables.stride(0),
            BLOCK_SIZE=key_pool.shape[1], NUM_QUERIES_PER_KV=per_kv, BLOCK_Q=block_q, BLOCK_M=block_m,
            BLOCK_N=block_n, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
            **dot_settings(query),
        )
    return out


# ---------------------------------------------------------------------------------------------
# Split-KV (flash-decoding) for decode batches with long contexts
# ---------------------------------------------------------------------------------------------


@triton.jit
def split_kv_decode_kernel(
    max_ptr, sum_ptr, acc_ptr,  # partials: (B, H, num_splits), (B, H, num_splits), (B, H, num_splits, d) float32
    query_ptr,  # (N, H, d); sequence b's one query is row query_start_loc[b]
    key_pool_ptr, value_pool_ptr,  # (num_blocks, block_size, KV, d)
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    scale,
    stride_qt, stride_qh, stride_qd,
    stride_pb, stride_ps, stride_ph, stride_pd,
    stride_bt,
    NUM_SPLITS: tl.constexpr,  # partitions per sequence (the grid's third axis)
    PARTITION_SIZE: tl.constexpr,  # keys per partition, a multiple of BLOCK_N
    BLOCK_SIZE: tl.constexpr, NUM_QUERIES_PER_KV: tl.constexpr,
    BLOCK_M: tl.constexpr,  # NUM_QUERIES_PER_KV rounded up to a power of two, at least 16
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    COMPUTE_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # Grid: (decoding sequences, KV heads, partitions). This program owns the one new token of
    # sequence `seq`, the query heads of KV head `kv_head`, and the keys of one partition:
    # positions split * PARTITION_SIZE .. (split + 1) * PARTITION_SIZE - 1. A decode's one query
    # sees every key of its sequence, so there is no causal mask inside the sequence.
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    part_start = split * PARTITION_SIZE
    if part_start >= seq_len:  # a short sequence has fewer partitions; the reduce skips this one
        return
    part_end = tl.minimum(seq_len, part_start + PARTITION_SIZE)
    row = tl.load(query_start_loc_ptr + seq)  # the sequence's query row in the flat batch

    offs_m = tl.arange(0, BLOCK_M)  # (BLOCK_M,) the group's query heads, padded
    head = kv_head * NUM_QUERIES_PER_KV + offs_m  # (BLOCK_M,)
    head_ok = offs_m < NUM_QUERIES_PER_KV
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(query_ptr + row * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=head_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_M, BLOCK_D)
    if COMPUTE_FP32:
        q = q.to(tl.float32)

    # The same online softmax as the unified kernel, over this partition's keys only.
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    table_row = block_tables_ptr + seq * stride_bt
    for start_n in range(part_start, part_end, BLOCK_N):
        key_pos = start_n + offs_n  # (BLOCK_N,)
        key_ok = key_pos < part_end
        block = tl.load(table_row + key_pos // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        slot = block * stride_pb + (key_pos % BLOCK_SIZE) * stride_ps + kv_head * stride_ph  # (BLOCK_N,)
        k = tl.load(key_pool_ptr + slot[None, :] + offs_d[:, None] * stride_pd,
                    mask=key_ok[None, :] & d_ok[:, None], other=0.0)  # (BLOCK_D, BLOCK_N)
        v = tl.load(value_pool_ptr + slot[:, None] + offs_d[None, :] * stride_pd,
                    mask=key_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_N, BLOCK_D)
        if COMPUTE_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale  # (BLOCK_M, BLOCK_N)
        s = tl.where(key_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every tile holds at least one real key
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # The partial result, unnormalized: (max, sum, acc) is exactly the online-softmax state, so
    # the reduce can merge partitions the same way the loop merges tiles.
    num_heads = tl.num_programs(1) * NUM_QUERIES_PER_KV
    part = (seq * num_heads + head) * NUM_SPLITS + split  # (BLOCK_M,) index into (B, H, NUM_SPLITS)
    tl.store(max_ptr + part, m_i, mask=head_ok)
    tl.store(sum_ptr + part, l_i, mask=head_ok)
    tl.store(acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=head_ok[:, None] & d_ok[None, :])


@triton.jit
def split_kv_reduce_kernel(
    out_ptr,  # (N, H, d)
    max_ptr, sum_ptr, acc_ptr,  # the partials of split_kv_decode_kernel
    seq_lens_ptr, query_start_loc_ptr,
    stride_ot, stride_oh, stride_od,
    NUM_SPLITS: tl.constexpr, PARTITION_SIZE: tl.constexpr,
    BLOCK_S: tl.constexpr,  # NUM_SPLITS rounded up to a power of two
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # Grid: (decoding sequences, query heads). This program merges one (sequence, head)'s partials:
    # with M the largest partition max, out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s.
    seq = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_parts = tl.cdiv(seq_len, PARTITION_SIZE)  # partitions this sequence actually filled
    offs_s = tl.arange(0, BLOCK_S)  # (BLOCK_S,)
    s_ok = offs_s < num_parts
    part = (seq * num_heads + head) * NUM_SPLITS + offs_s  # (BLOCK_S,)
    m = tl.load(max_ptr + part, mask=s_ok, other=float("-inf"))  # (BLOCK_S,)
    l = tl.load(sum_ptr + part, mask=s_ok, other=0.0)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    acc = tl.load(acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=s_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_S, BLOCK_D)
    m_max = tl.max(m, axis=0)  # finite: partition 0 always holds keys
    weight = tl.exp(m - m_max)  # (BLOCK_S,), 0 for unfilled partitions (m = -inf)
    out = tl.sum(weight[:, None] * acc, axis=0) / tl.sum(weight * l, axis=0)  # (BLOCK_D,)
    row = tl.load(query_start_loc_ptr + seq)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + offs_d * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=d_ok)


def split_kv_decode_attention(
    query: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    num_splits: int,
    partition_size: int,
    scale: float,
    block_n: int = DEFAULT_BLOCK_N,
) -> torch.Tensor:
    """Decode attention (one query per sequence) with each sequence's keys split into `num_splits`
    partitions of `partition_size` keys: query (N, H, d) -> (N, H, d), in two launches."""
    check_attention_inputs(query, key_pool, value_pool, block_tables, seq_lens, query_start_loc)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_pool.shape[2]
    num_seqs = seq_lens.shape[0]
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return out
    if num_tokens != num_seqs:
        raise ValueError(f"split-KV decode needs one query per sequence, got {num_tokens} for {num_seqs}")
    if partition_size % block_n:
        raise ValueError(f"partition_size {partition_size} must be a multiple of {block_n}")
    if key_pool.stride() != value_pool.stride():
        raise ValueError("key_pool and value_pool must have the same strides")
    per_kv = num_heads // num_kv_heads
    maxes = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=query.device)
    sums = torch.empty_like(maxes)
    accs = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device)
    block_d = max(16, triton.next_power_of_2(head_dim))
    with on_device(query):
        split_kv_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
            maxes, sums, accs, query, key_pool, value_pool, block_tables, seq_lens, query_start_loc, scale,
            *query.stride(), *key_pool.stride(), block_tables.stride(0),
            NUM_SPLITS=num_splits, PARTITION_SIZE=partition_size, BLOCK_SIZE=key_pool.shape[1],
            NUM_QUERIES_PER_KV=per_kv, BLOCK_M=max(16, triton.next_power_of_2(per_kv)), BLOCK_N=block_n,
            HEAD_DIM=head_dim, BLOCK_D=block_d, **dot_settings(query),
        )
        split_kv_reduce_kernel[(num_seqs, num_heads)](
            out, maxes, sums, accs, seq_lens, query_start_loc, *out.stride(),
            NUM_SPLITS=num_splits, PARTITION_SIZE=partition_size, BLOCK_S=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim, BLOCK_D=block_d,
        )
    return out
