"""How many bytes the KV pool gets, when the config does not say: one rule, on CUDA and on the CPU.

    pool = min(device memory x gpu_memory_utilization - what the process already holds,
               what max_num_seqs sequences of max_model_len tokens could ever use, in whole blocks)

On CUDA, "already holds" is measured: the peak of a profiled forward pass over the largest step
(weights, activations, and every tensor still alive in the process, another engine's pool
included) plus the memory held outside PyTorch. On the CPU the device is emulated: its memory is
`EngineConfig.cpu_device_memory`, and "already holds" is counted: this model's weights, an
estimate of the activations of the largest step, and the pools and weights (packed or plain) of
every engine still alive in the process (the `DeviceLedger`). So a notebook that creates a second engine while the
first still holds its pool fails on a laptop exactly where it would fail on a GPU, and
`LLM.shutdown()` (or `with LLM(...) as llm:`) gives the memory back on both.

Where the CPU plays a GPU (`LLM_RUNTIME_DEVICE_PROFILE`), the rule above still runs over the CPU's emulated
device (a pool of a T4's 15 GiB or an H100's 80 GiB would not fit in a laptop's memory), and the GPU's own
memory is a second limit (`check_profile_memory`): weights, activations and a pool asked for explicitly
(num_kv_blocks, kv_cache_memory) must fit in it, or the engine refuses as that GPU would (there, with an
out-of-memory error while allocating).
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Sequence
from typing import Protocol

import torch

from ..attention.kv_cache import kv_block_bytes
from ..config import EngineConfig
from ..device import device_profile
from ..model import CausalLM


class DeviceHolder(Protocol):
    """What the ledger asks of what it counts (a `Worker`): its device, the bytes of its pools, its models."""

    @property
    def device(self) -> torch.device: ...

    @property
    def kv_pool_bytes(self) -> int: ...

    @property
    def device_models(self) -> list[torch.nn.Module]: ...


def tensor_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers, each storage counted once (tied embeddings share one)."""
    seen: dict[int, int] = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.is_mkldnn:  # an opaque packed weight (model/packed_linear.py): no storage to look at
            seen[id(tensor)] = tensor.numel() * tensor.element_size()
            continue
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def activation_bytes(model: CausalLM, config: EngineConfig) -> int:
    """An estimate of the peak activations of a `max_num_batched_tokens` step: per token, a few hidden-sized
    buffers (residual, norm, attention output), q/k/v, the MLP's gate, up and product; plus the logits
    of `max_num_seqs` rows in float32. (On CUDA this is measured instead.)"""
    c = model.config
    per_token = 6 * c.hidden_size + 3 * c.intermediate_size + (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    num_tokens = min(config.max_num_batched_tokens, c.max_position_embeddings)
    itemsize = torch.empty((), dtype=model.dtype).element_size()
    return num_tokens * per_token * itemsize + config.max_num_seqs * c.vocab_size * 4


class DeviceLedger:
    """The live workers of this process's engines on the emulated CPU device, held weakly: a worker nobody
    references any more holds nothing, and one that was shut down holds nothing either.

    It is the one piece of process-wide state in the package, because device memory is one: on
    CUDA the driver keeps this book; on the CPU, this class does.
    """

    def __init__(self) -> None:
        self._holders: weakref.WeakSet[DeviceHolder] = weakref.WeakSet()

    def register(self, holder: DeviceHolder) -> None:
        self._holders.add(holder)

    def release(self, holder: DeviceHolder) -> None:
        self._holders.discard(holder)

    def num_live(self, device: torch.device) -> int:
        return sum(holder.device == device for holder in list(self._holders))

    def held_bytes(self, device: torch.device, besides: Sequence[torch.nn.Module] = ()) -> int:
        """Bytes held on `device` by live engines (their pools, their draft models' pools, their models' and
        draft models' weights), with the weights of `besides` (the models about to get an engine) counted once."""
        gc.collect()  # an engine in a reference cycle that nobody can reach is not live
        models: dict[int, torch.nn.Module] = {id(module): module for module in besides}
        pools = 0
        for holder in list(self._holders):
            if holder.device != device:
                continue
            pools += holder.kv_pool_bytes
            models.update((id(module), module) for module in holder.device_models)
        # One storage counted once across the modules too (a native step's plain weights may be the model's own).
        return pools + tensor_bytes(torch.nn.ModuleList(models.values()))


CPU_DEVICE = DeviceLedger()


def kv_cache_memory(model: CausalLM, config: EngineConfig, max_model_len: int, reserve: int = 0,
                    block_bytes: int | None = None, others: Sequence[torch.nn.Module] = ()) -> int:
    """Bytes for the KV pool by the rule above (the config gave neither num_kv_blocks nor kv_cache_memory),
    less `reserve` bytes that something else will take later (CUDA graphs' memory pool). `block_bytes`: what
    one block takes (the model's, unless a draft model's pool grows with it); `others`: more modules the
    engine keeps on the device (a draft model; on CUDA their weights are measured with everything else)."""
    block = block_bytes or kv_block_bytes(model.config, config.block_size, model.dtype, config.kv_cache_dtype)
    if model.device.type == "cuda":
        headroom = profile_kv_cache_memory(model, config, min_bytes=block + reserve) - reserve
    else:
        total = int(config.cpu_device_memory * config.gpu_memory_utilization)
        held = CPU_DEVICE.held_bytes(model.device, besides=[model, *others]) + activation_bytes(model, config) + reserve
        headroom = total - held
        if headroom < block:
            raise RuntimeError(
                f"no device memory left for the KV cache: {held / 2**30:.3f} GiB is held (weights, activations "
                f"and the pools of {CPU_DEVICE.num_live(model.device)} live engine(s)) of the emulated CPU "
                f"device's {config.cpu_device_memory / 2**30:.3f} GiB x gpu_memory_utilization "
                f"{config.gpu_memory_utilization}. Shut down the engines you are done with (llm.shutdown(), or "
                f"`with LLM(...) as llm:`), or give each engine an explicit budget (kv_cache_memory, num_kv_blocks)"
            )
    # Whole blocks: a sequence of max_model_len tokens holds ceil(max_model_len / block_size) of them.
    full = config.max_num_seqs * -(-max_model_len // config.block_size) * block
    return min(headroom, full)


def check_profile_memory(model: CausalLM, config: EngineConfig, pool_bytes: int,
                         others: Sequence[torch.nn.Module] = ()) -> None:
    """Where the CPU plays a GPU: raise unless the weights of every live engine and of this one, the activations
    of its largest step and its pool of `pool_bytes` fit in that GPU's memory x gpu_memory_utilization."""
    profile = device_profile(model.device)
    if not profile.emulated or profile.memory_bytes is None:
        return
    total = int(profile.memory_bytes * config.gpu_memory_utilization)
    held = CPU_DEVICE.held_bytes(model.device, besides=[model, *others]) + activation_bytes(model, config)
    if held + pool_bytes > total:
        raise RuntimeError(
            f"out of memory on {profile.describe()}: weights and activations ({held / 2**30:.2f} GiB) and a KV "
            f"pool of {pool_bytes / 2**30:.2f} GiB exceed its {profile.memory_bytes / 2**30:.0f} GiB x "
            f"gpu_memory_utilization {config.gpu_memory_utilization}. Ask for a smaller pool (num_kv_blocks, "
            f"kv_cache_memory), a smaller model or dtype, or shut down the engines you are done with"
        )


@torch.inference_mode()
def profile_kv_cache_memory(model: CausalLM, config: EngineConfig, min_bytes: int = 1) -> int:
    """CUDA: bytes left for the KV pool = total x gpu_memory_utilization - (weights + peak activations
    of a `max_num_batched_tokens` forward pass + every other live tensor + memory held outside PyTorch)."""
    device = model.device
    if device.type != "cuda":
        raise ValueError(f"profiling measures CUDA memory; the model is on {device} (set num_kv_blocks "
                         f"or kv_cache_memory instead)")
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    num_tokens = min(config.max_num_batched_tokens, model.config.max_position_embeddings)
    input_ids = torch.zeros((1, num_tokens), dtype=torch.long, device=device)  # (1, T) dummy prompt
    hidden = model(input_ids)
    model.compute_logits(hidden[0, -config.max_num_seqs :])  # (max_num_seqs, vocab): the sampler's input
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    outside_torch = total - free - torch.cuda.memory_reserved(device)
    del hidden
    torch.cuda.empty_cache()
    available = int(total * config.gpu_memory_utilization) - peak - outside_torch
    if available < min_bytes:
        raise RuntimeError(
            f"no GPU memory left for the KV cache: weights, activations and other live tensors (another "
            f"engine's pool?) peak at {peak / 2**30:.2f} GiB of {total / 2**30:.2f} GiB x gpu_memory_utilization "
            f"{config.gpu_memory_utilization}. Shut down the engines you are done with (llm.shutdown(), or "
            f"`with LLM(...) as llm:`), raise gpu_memory_utilization or lower max_num_batched_tokens"
        )
    return available
