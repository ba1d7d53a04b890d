"""The draft-model proposer: a smaller model with the target's tokenizer guesses the next k tokens (lesson 14).

A draft model is any model whose token ids mean what the target's mean: a smaller one of the same family,
or (on the CPU) the target itself with its weights in 4 bits (`{"method": "draft", "model": "self",
"quantization": "gguf"}`: the bundled model's own Q4_1 file), which reads a fifth of the bytes per step and
agrees with the float32 model on most tokens (lesson 13).

Per sequence it keeps a KV cache of its own (`ContiguousKVCache`) and the tokens that cache was computed
for. Before a step it brings the cache up to the sequence's tokens: the prefix both share is kept (the drafts
the target kept are exactly the draft's own tokens), the rest is run as one chunk, and then it decodes k
tokens one at a time, each from its own logits: greedy requests take the argmax (a sure guess), sampled
ones draw from the draft's distribution after the request's temperature, min-p, top-k and top-p, which
the rejection sampler needs (`Sequence.draft_probs`). Any draft distribution keeps the output exact; a
closer one keeps more of the guesses.

The caches are not in the engine's KV budget: they are the draft's, sized to each sequence's longest
length, and dropped when the sequence finishes or is preempted (`keep_only`).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

import torch

from ..attention.kv_cache import ContiguousKVCache
from ..config import SpeculativeConfig
from ..model import CausalLM, load_model
from ..sampling import sampling_probs

if TYPE_CHECKING:
    from ..engine.sequence import Sequence


class DraftModelProposer:
    """Guesses k tokens per decoding sequence with `model`, one sequence at a time."""

    def __init__(self, model: CausalLM, num_speculative_tokens: int, seed: int = 0) -> None:
        self.model = model
        self.num_speculative_tokens = num_speculative_tokens
        self.generator = torch.Generator(device=model.device).manual_seed(seed)
        self.caches: dict[Sequence, tuple[ContiguousKVCache, list[int]]] = {}  # cache, the tokens it holds

    @torch.inference_mode()
    def propose(self, sequences: list[Sequence]) -> None:
        """Set each sequence's `draft_token_ids` (k of them) and, for a sampled request, `draft_probs` (k, V)."""
        for seq in sequences:
            self._propose(seq)

    def keep_only(self, running: Collection[Sequence]) -> None:
        """Drop the caches of sequences that finished or were preempted (a preempted one starts again)."""
        for seq in [seq for seq in self.caches if seq not in running]:
            del self.caches[seq]

    def _propose(self, seq: Sequence) -> None:
        k, model = self.num_speculative_tokens, self.model
        tokens = seq.prompt_token_ids + seq.output_token_ids
        if seq not in self.caches:
            longest = seq.num_prompt_tokens + seq.max_new_tokens + k
            self.caches[seq] = (ContiguousKVCache.for_model(model.config, 1, longest, dtype=model.dtype,
                                                            device=model.device), [])
        cache, cached = self.caches[seq]
        shared = 0
        while shared < min(len(cached), len(tokens) - 1) and cached[shared] == tokens[shared]:
            shared += 1
        cache.num_tokens = shared  # keys past the shared prefix were for tokens since replaced: overwritten
        pending = tokens[shared:]  # at least the last token, whose keys no step has computed yet
        room = cache.max_seq_len - len(tokens)
        drafts: list[int] = []
        probs: list[torch.Tensor] = []
        for _ in range(min(k, room)):
            input_ids = torch.tensor([pending], device=model.device)  # (1, T)
            logits = model.compute_logits(model(input_ids, cache)[:, -1])  # (1, vocab)
            if seq.params.is_greedy:
                token = int(logits.argmax(dim=-1))
            else:
                p = sampling_probs(logits, [seq.params])  # (1, vocab)
                token = int(torch.multinomial(p, 1, generator=self.generator))
                probs.append(p[0])
            drafts.append(token)
            pending = [token]
        self.caches[seq] = (cache, tokens + drafts[:-1])  # the last draft was sampled, not run
        seq.draft_token_ids = drafts
        seq.draft_probs = torch.stack(probs) if probs else None


def load_draft_model(config: SpeculativeConfig, target: CausalLM) -> CausalLM:
    """The draft model a "draft" config names, on the target's device: `model` as `load_model` takes it, or
    "self" for the target's own weights loaded again (by the name the target was loaded by), each with
    `quantization`. ValueError if its token ids cannot be the target's (another vocabulary size)."""
    if config.model == "self":
        if target.source is None:
            raise ValueError('a "self" draft loads the target again by its name, and this model was not loaded '
                             'by load_model: name the draft model instead')
        name = target.source or None  # "": the bundled model
    else:
        name = config.model
    draft, _ = load_model(name, device=target.device, quantization=config.quantization)
    check_same_vocabulary(draft, target)
    return draft


def check_same_vocabulary(draft: CausalLM, target: CausalLM) -> None:
    """ValueError unless the draft's token ids can be the target's (the same vocabulary size)."""
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({draft.config.vocab_size} tokens) is not the target's "
                         f"({target.config.vocab_size}): it must share its tokenizer")
