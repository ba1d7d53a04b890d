"""`CausalLM`: one pure-PyTorch decoder for the Llama family (Llama 2/3, SmolLM2, Qwen2/2.5, Qwen3).

`forward` returns hidden states and `compute_logits` turns the ones you need into logits, as in
vLLM: generation only needs the last position's logits, and the vocabulary projection is large.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..config import ModelConfig
from ..attention.kv_cache import ContiguousKVCache, KVCache
from .layers import DecoderLayer, RMSNorm
from .rope import RotaryEmbedding

if TYPE_CHECKING:
    from ..distributed.group import TensorParallelGroup


class Model(nn.Module):
    """Embeddings, the decoder layers and the final norm (Hugging Face's `model.` prefix)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.rope, config.head_dim)


class CausalLM(nn.Module):
    """A decoder-only language model whose forward takes an explicit KV cache."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # The name `load_model` loaded it by: a folder or a hub id, "" for the bundled model; None when built
        # otherwise. A self-draft (speculative decoding, lesson 14) loads the same weights again by it.
        self.source: str | None = None
        self.model = Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Sharded (distributed/sharding.py): this rank's slice of the vocabulary, gathered on rank 0.
        self.tp: TensorParallelGroup | None = None

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device  # the norms stay plain when linears and embedding are quantized

    @property
    def dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype

    def forward(
        self,
        input_ids: torch.Tensor,
        kv_cache: KVCache | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids (B, T) -> hidden states (B, T, hidden).

        Without a cache the T tokens are the whole sequence. With one, they follow the
        `kv_cache.num_tokens` tokens it holds, and their keys and values are appended to it.
        Positions default to the slots the tokens occupy; batches whose rows sit at different
        positions (padded or ragged batches) pass them explicitly.
        """
        if positions is None:
            if kv_cache is not None and not isinstance(kv_cache, ContiguousKVCache):
                raise ValueError(f"positions are required with a {type(kv_cache).__name__}")
            num_cached = kv_cache.num_tokens if kv_cache is not None else 0
            positions = torch.arange(num_cached, num_cached + input_ids.shape[1], device=input_ids.device)
            positions = positions.expand(input_ids.shape[0], -1)  # (B, T)
        x = self.model.embed_tokens(input_ids)  # (B, T, hidden)
        cos, sin = self.model.rotary_emb(positions, x.dtype)  # (B, T, head_dim) each
        for layer in self.model.layers:
            x = layer(x, cos, sin, kv_cache)
        if kv_cache is not None:
            kv_cache.advance(input_ids.shape[1])
        return self.model.norm(x)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """(..., hidden) -> (..., vocab_size). Sharded, rank 0 gets the whole vocabulary's logits; the other
        ranks get their own slice's (and have no use for them)."""
        logits = self.lm_head(hidden_states)
        if self.tp is None:
            return logits
        return self.tp.gather_to_first(logits)[..., : self.config.vocab_size]  # padded columns dropped

    def first_layers(self, num_layers: int) -> "CausalLM":
        """This model exited early: its first `num_layers` decoder layers, then its own final norm and head (the
        draft of self-speculation, as in LayerSkip). The modules are this model's, shared, not copied. ValueError
        unless 1 <= num_layers < its layers; a sharded model (its collectives span ranks) cannot be cut."""
        if not 1 <= num_layers < self.config.num_layers:
            raise ValueError(f"num_layers must be in 1..{self.config.num_layers - 1} for a model of "
                             f"{self.config.num_layers} layers, got {num_layers}")
        if self.tp is not None:
            raise ValueError("a sharded model cannot be cut to its first layers: load the draft whole")
        draft = CausalLM.__new__(CausalLM)
        nn.Module.__init__(draft)
        draft.config = dataclasses.replace(self.config, num_layers=num_layers)
        draft.source, draft.tp = None, None
        inner = Model.__new__(Model)
        nn.Module.__init__(inner)
        inner.embed_tokens, inner.norm, inner.rotary_emb = (self.model.embed_tokens, self.model.norm,
                                                            self.model.rotary_emb)
        inner.layers = nn.ModuleList(list(self.model.layers)[:num_layers])
        draft.model, draft.lm_head = inner, self.lm_head
        return draft

    def new_kv_cache(self, batch_size: int, max_seq_len: int) -> ContiguousKVCache:
        """A contiguous cache for this model, on its device and in its dtype."""
        return ContiguousKVCache.for_model(self.config, batch_size, max_seq_len, dtype=self.dtype,
                                           device=self.device)
