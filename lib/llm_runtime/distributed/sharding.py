"""One rank's shard of a model (lesson 17): Megatron-style tensor parallelism, as vLLM and SGLang run it.

Per decoder layer, with `size` ranks:

- q, k and v are column-parallel: rank r keeps the rows of its query heads (num_heads / size of them) and of
  the KV heads those heads read. With at least as many KV heads as ranks, each rank has num_kv_heads / size of
  them; with fewer, each KV head is replicated on size / num_kv_heads ranks (vLLM's rule), so a rank still
  holds whole heads and attends without talking to the others.
- o is row-parallel: rank r keeps the columns that read its heads' outputs, so each rank's product is a partial
  sum of the full one, and one all-reduce adds them (`Attention.tp`).
- gate and up are column-parallel over the MLP's inner size, down row-parallel over it: again one all-reduce
  (`MLP.tp`). A bias of a row-parallel projection is kept on rank 0 only (zeros elsewhere), so the sum adds it
  once.
- The embedding and the LM head are vocabulary-parallel: rank r keeps ceil(vocab / size) rows (the last rank's
  padded with zeros). A token's embedding comes from the one rank that holds its row (the others contribute
  zeros: one all-reduce); the logits are each rank's slice, gathered side by side on rank 0 (`CausalLM.tp`).
- Norms, rotary tables and everything per token are replicated.

The shard keeps the checkpoint's parameter names and `nn.Linear` modules (of their local shapes), so packing,
compiling and the loader work as they do unsharded; `model.config` becomes the rank's own shape (its heads,
its slice of the MLP), which is what sizes its KV pool. `plan_shards` says, per checkpoint tensor, which slice
a rank keeps: the loader reads just that slice from the safetensors files (model/loader.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
import torch.nn.functional as F

from ..config import ModelConfig
from .group import TensorParallelGroup


def tensor_parallel_unsupported_reason(config: ModelConfig, size: int) -> str | None:
    """None when a model of this shape splits over `size` ranks; otherwise why not."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        return f"tensor_parallel_size must be an integer >= 1, got {size!r}"
    if config.num_heads % size:
        return f"the model's {config.num_heads} attention heads do not divide over {size} ranks"
    kv = config.num_kv_heads
    if kv % size and size % kv:
        return (f"the model's {kv} KV heads neither divide over {size} ranks nor replicate evenly on them "
                f"({size} is not a multiple of {kv})")
    if config.intermediate_size % size:
        return f"the model's MLP size {config.intermediate_size} does not divide over {size} ranks"
    return None


@dataclass(frozen=True)
class Shard:
    """The part of a checkpoint tensor a rank keeps: rows or columns [start, stop) along `dim` (None: all of
    it), then zero rows up to `padded` along dim 0 (the vocabulary's last shard), and zeros throughout where
    `zero` (a row-parallel bias on ranks other than 0)."""

    dim: int | None = None
    start: int = 0
    stop: int = 0
    padded: int | None = None
    zero: bool = False

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """This shard of the whole tensor (a view where nothing is padded or zeroed)."""
        part = tensor if self.dim is None else tensor.narrow(self.dim, self.start, self.stop - self.start)
        if self.zero:
            part = torch.zeros_like(part)
        if self.padded is not None and part.shape[0] < self.padded:
            part = F.pad(part, (0, 0) * (part.dim() - 1) + (0, self.padded - part.shape[0]))
        return part

    def read(self, source: Any) -> torch.Tensor:
        """This shard from a safetensors slice (`safe_open(...).get_slice(name)`), reading only its rows or
        columns from the file."""
        if self.dim is None:
            part = source[:]
        elif self.dim == 0:
            part = source[self.start : self.stop]
        elif self.dim == 1:
            part = source[:, self.start : self.stop]
        else:
            raise ValueError(f"shards split dimension 0 or 1, not {self.dim}")
        return Shard(padded=self.padded, zero=self.zero).take(part)

    def shape(self, full: torch.Size) -> torch.Size:
        """The shape of `take` for a tensor of shape `full`."""
        shape = list(full)
        if self.dim is not None:
            shape[self.dim] = self.stop - self.start
        if self.padded is not None:
            shape[0] = max(shape[0], self.padded)
        return torch.Size(shape)


def heads_of_rank(num_heads: int, num_kv_heads: int, rank: int, size: int) -> tuple[range, range]:
    """The query heads and the KV heads rank `rank` of `size` holds (module docstring), for a shape that
    splits (tensor_parallel_unsupported_reason)."""
    per_rank = num_heads // size
    queries = range(rank * per_rank, (rank + 1) * per_rank)
    if num_kv_heads >= size:
        kv_per_rank = num_kv_heads // size
        return queries, range(rank * kv_per_rank, (rank + 1) * kv_per_rank)
    kv = rank * num_kv_heads // size  # replicated: the one KV head this rank's query heads read
    return queries, range(kv, kv + 1)


def vocab_rows(config: ModelConfig, rank: int, size: int) -> tuple[int, int, int]:
    """(first, stop, rows): the vocabulary ids [first, stop) rank `rank` holds, in `rows` rows (padded)."""
    rows = -(-config.vocab_size // size)
    first = min(rank * rows, config.vocab_size)
    return first, min(first + rows, config.vocab_size), rows


def plan_shards(config: ModelConfig, rank: int, size: int) -> dict[str, Shard]:
    """Per checkpoint tensor name, the Shard rank `rank` of `size` keeps (absent names: the whole tensor)."""
    reason = tensor_parallel_unsupported_reason(config, size)
    if reason is not None:
        raise ValueError(reason)
    if size == 1:
        return {}
    queries, kvs = heads_of_rank(config.num_heads, config.num_kv_heads, rank, size)
    d = config.head_dim
    inner = config.intermediate_size // size
    first, stop, rows = vocab_rows(config, rank, size)
    q_rows = Shard(0, queries.start * d, queries.stop * d)
    kv_rows = Shard(0, kvs.start * d, kvs.stop * d)
    plan = {"model.embed_tokens.weight": Shard(0, first, stop, padded=rows)}
    if not config.tie_word_embeddings:
        plan["lm_head.weight"] = Shard(0, first, stop, padded=rows)
    for layer in range(config.num_layers):
        attn, mlp = f"model.layers.{layer}.self_attn", f"model.layers.{layer}.mlp"
        for suffix in ("weight", "bias"):
            plan[f"{attn}.q_proj.{suffix}"] = q_rows
            plan[f"{attn}.k_proj.{suffix}"] = plan[f"{attn}.v_proj.{suffix}"] = kv_rows
            plan[f"{mlp}.gate_proj.{suffix}"] = plan[f"{mlp}.up_proj.{suffix}"] = Shard(0, rank * inner,
                                                                                        (rank + 1) * inner)
        plan[f"{attn}.o_proj.weight"] = Shard(1, queries.start * d, queries.stop * d)
        plan[f"{mlp}.down_proj.weight"] = Shard(1, rank * inner, (rank + 1) * inner)
        plan[f"{mlp}.down_proj.bias"] = Shard(zero=rank != 0)
    return plan


def local_config(config: ModelConfig, size: int) -> ModelConfig:
    """The shape of one rank's shard: its heads and its slice of the MLP (the vocabulary stays whole: it is
    the width of the logits rank 0 gathers)."""
    if size == 1:
        return config
    kv = config.num_kv_heads // size if config.num_kv_heads >= size else 1
    return dataclasses.replace(config, num_heads=config.num_heads // size, num_kv_heads=kv,
                               intermediate_size=config.intermediate_size // size)


class VocabParallelEmbedding(nn.Embedding):
    """Rows [first, stop) of the vocabulary's embedding (padded to `num_embeddings`); a token outside them
    embeds as zeros here, and the all-reduce over ranks gives every rank every token's row."""

    def __init__(self, rows: int, hidden: int, first: int, stop: int, tp: TensorParallelGroup,
                 device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(rows, hidden, device=device, dtype=dtype)
        self.first, self.stop, self.tp = first, stop, tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        mine = (input_ids >= self.first) & (input_ids < self.stop)  # (...,) the tokens whose rows are here
        local = torch.where(mine, input_ids - self.first, 0)
        out = super().forward(local) * mine.unsqueeze(-1).to(self.weight.dtype)  # (..., hidden), zeros elsewhere
        return self.tp.all_reduce(out)

    def extra_repr(self) -> str:
        return f"vocabulary [{self.first}, {self.stop}) of rank {self.tp.rank}, {self.embedding_dim}"


def _narrow_linear(linear: nn.Linear, weight: Shard, bias: Shard | None) -> nn.Linear:
    """A new nn.Linear holding `weight`'s (and `bias`'s) shard of `linear`, on its device and in its dtype."""
    w = weight.take(linear.weight.detach())
    new = nn.Linear(w.shape[1], w.shape[0], bias=linear.bias is not None, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        if w.device.type != "meta":
            new.weight.copy_(w)
        if linear.bias is not None:
            b = (bias or Shard()).take(linear.bias.detach())
            if b.device.type != "meta":
                new.bias.copy_(b)
    return new


def shard_model_(model: nn.Module, tp: TensorParallelGroup) -> nn.Module:
    """Turn a whole `CausalLM` into rank `tp.rank`'s shard, in place (module docstring), and return it. On the
    meta device (the loader's skeleton) only the shapes change; otherwise the weights are sliced from the model's
    own. `tp.size == 1` leaves the model as it is."""
    config: ModelConfig = model.config
    if tp.size == 1:
        return model
    plan = plan_shards(config, tp.rank, tp.size)
    local = local_config(config, tp.size)
    for index, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        prefix = f"model.layers.{index}"
        for owner, names, kind in ((attn, ("q_proj", "k_proj", "v_proj", "o_proj"), "self_attn"),
                                   (mlp, ("gate_proj", "up_proj", "down_proj"), "mlp")):
            if getattr(owner, "qkv_proj", None) is not None or getattr(owner, "gate_up_proj", None) is not None:
                raise ValueError("shard the model before its linear layers are packed")
            for name in names:
                key = f"{prefix}.{kind}.{name}"
                linear = getattr(owner, name)
                if type(linear) is not nn.Linear:
                    raise ValueError(f"{key} is a {type(linear).__name__}: only unquantized nn.Linear layers shard "
                                     f"(quantize after sharding)")
                setattr(owner, name, _narrow_linear(linear, plan[f"{key}.weight"], plan.get(f"{key}.bias")))
            owner.tp = tp
        attn.num_heads, attn.num_kv_heads = local.num_heads, local.num_kv_heads
    first, stop, rows = vocab_rows(config, tp.rank, tp.size)
    old = model.model.embed_tokens
    if type(old) is not nn.Embedding:
        raise ValueError(f"the embedding is a {type(old).__name__}: only an unquantized nn.Embedding shards")
    table = plan["model.embed_tokens.weight"].take(old.weight.detach())
    embedding = VocabParallelEmbedding(rows, config.hidden_size, first, stop, tp, device=table.device,
                                       dtype=table.dtype)
    if table.device.type != "meta":
        with torch.no_grad():
            embedding.weight.copy_(table)
    model.model.embed_tokens = embedding
    if config.tie_word_embeddings:
        head = nn.Linear(config.hidden_size, rows, bias=False, device=table.device, dtype=table.dtype)
        head.weight = embedding.weight
    else:
        head = _narrow_linear(model.lm_head, plan["lm_head.weight"], None)
    model.lm_head = head
    model.config = local
    model.tp = tp
    return model
