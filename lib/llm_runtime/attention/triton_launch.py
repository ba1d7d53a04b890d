"""What every launch of the Triton attention kernels (triton_kernels.py) does first: check that its tensors share
one device and have the shapes and index dtypes the kernels walk, make that device current (a launch goes to the
current CUDA device, whatever device its tensors are on), and pick the dtype-dependent settings of the dots."""

from __future__ import annotations

import contextlib

import torch


def on_device(tensor: torch.Tensor) -> contextlib.AbstractContextManager:
    """The guard that makes `tensor`'s GPU current for a launch; none on the CPU (the interpreter)."""
    if tensor.device.type == "cuda":
        return torch.cuda.device(tensor.device)
    return contextlib.nullcontext()


def check_devices(**tensors: torch.Tensor) -> None:
    """ValueError unless every tensor is on the first one's device (a kernel reads them all from one GPU)."""
    (first_name, first), *rest = tensors.items()
    for name, tensor in rest:
        if tensor.device != first.device:
            raise ValueError(f"{name} is on {tensor.device}, {first_name} on {first.device}: the kernel reads "
                             f"every tensor on one device")


def check_attention_inputs(query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor) -> None:
    """What a kernel cannot check for itself and costs nothing to check here: one device, and index tensors of
    the shapes the kernels walk, in an integer dtype (each is loaded as its own dtype, int32 or int64). The
    indices' values are not read: that would wait for the GPU, and a captured CUDA graph replays without this."""
    check_devices(query=query, key_pool=key_pool, value_pool=value_pool, block_tables=block_tables,
                   seq_lens=seq_lens, query_start_loc=query_start_loc)
    for name, tensor in (("block_tables", block_tables), ("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        if tensor.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be int32 or int64, got {tensor.dtype}")
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if (query.dim() != 3 or key_pool.dim() != 4 or value_pool.shape != key_pool.shape
            or key_pool.shape[3] != query.shape[2] or block_tables.dim() != 2 or block_tables.shape[0] != num_seqs
            or query_start_loc.shape != (num_seqs + 1,)):
        raise ValueError(f"shapes disagree: query {tuple(query.shape)} (N, H, d), pools {tuple(key_pool.shape)} / "
                         f"{tuple(value_pool.shape)} (blocks, block_size, KV, d), block_tables "
                         f"{tuple(block_tables.shape)} (B, max_blocks), seq_lens {tuple(seq_lens.shape)} (B,), "
                         f"query_start_loc {tuple(query_start_loc.shape)} (B + 1,)")
    if key_pool.shape[2] < 1 or query.shape[1] % key_pool.shape[2]:
        raise ValueError(f"{query.shape[1]} query heads do not share {key_pool.shape[2]} KV heads evenly")


def dot_settings(query: torch.Tensor) -> dict:
    """The two dtype-dependent constexprs: float32 tiles on the CPU interpreter, exact float32 dots."""
    return {
        # A CPU tensor reaching a Triton kernel means the interpreter is running it (NumPy: no bf16).
        "COMPUTE_FP32": not query.is_cuda,
        "DOT_PRECISION": "ieee" if query.dtype == torch.float32 else "tf32",
    }
