"""The draft-model proposer: a smaller model with the target's tokenizer guesses the next k tokens (lesson 14).

A draft model is any model whose token ids mean what the target's mean: a smaller one of the same family,
or (on the CPU) the target itself with its weights in 4 bits (`{"method": "draft", "model": "self",
"quantization": "gguf"}`: the bundled model's own Q4_1 file), which reads a fifth of the bytes per step and
agrees with the float32 model on most tokens (lesson 13).

Its keys and values live in a paged pool of its own (`PagedKVCache`, the engine's layout), with as many
blocks as the engine's pool and a `BlockManager` of its own: the engine counts both pools in its KV budget,
so speculation never takes KV memory the budget did not give it, and no forward pass of the draft holds more
than the engine's `max_num_batched_tokens` tokens (the activations the budget has room for, the draft being
no larger than the target). Per sequence it keeps the tokens its blocks hold keys and values for. Before a
step it brings every decoding sequence up to its tokens at once: the prefix both share is kept (the drafts
the target kept are exactly the draft's own tokens), the rest (at least the last token; the whole prompt for
a sequence new to the draft) runs as ragged batches over all the sequences, and then k - 1 more passes of
one token per sequence draw the other guesses, each from its own logits: greedy requests take the argmax (a
sure guess), sampled ones draw from the draft's distribution after the request's temperature, min-p,
top-k and top-p, which the rejection sampler needs (`Sequence.draft_probs`). A seeded request draws its
guesses with the very noise its verification draws with (its seed, at the same draws): it keeps a guess exactly
when the guess is the target's own draw (sampling/rejection.py), so its output is the target's whatever the
draft computed, or beside what, and where the draft's distribution is close to the target's its guess wins the
same race. Any draft distribution keeps the output exact; a closer one keeps more guesses.

When the pool has no room for a sequence, that sequence gets no guesses this step (it decodes one token, as
without speculation); a sequence that leaves (finished or preempted) gives its blocks back (`keep_only`).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..attention.backend import AttentionBackend, PagedAttentionStep
from ..attention.kv_cache import PagedKVCache
from ..attention.metadata import AttentionMetadata
from ..attention.selector import select_backend
from ..config import SpeculativeConfig
from ..core.block_manager import BlockManager
from ..model import CausalLM, load_model
from ..sampling import sampling_probs
from ..sampling.seeded import exponential_noise

if TYPE_CHECKING:
    from ..core.sequence import Sequence

@dataclass
class _Plan:
    """One sequence's proposal this step: its tokens, how many of them its blocks already hold, how many guesses."""

    seq: Sequence
    tokens: list[int]
    num_cached: int
    num_drafts: int


class DraftModelProposer:
    """Guesses up to k tokens for every decoding sequence with `model`, all sequences in one batch per guess."""

    def __init__(self, model: CausalLM, num_speculative_tokens: int, *, num_blocks: int, block_size: int = 16,
                 attention_backend: AttentionBackend | None = None, max_tokens_per_pass: int = 2048,
                 seed: int = 0) -> None:
        """A pool of `num_blocks` blocks of `block_size` tokens (the engine gives its own pool's); the attention
        backend the engine runs (None: the one `select_backend` picks for the draft's device and dtype); at most
        `max_tokens_per_pass` tokens in one forward pass (the engine's `max_num_batched_tokens`, whose activations
        its budget has room for)."""
        if attention_backend is None:
            attention_backend = select_backend("auto", model.device, model.dtype, None, block_size)
        if max_tokens_per_pass < 1:
            raise ValueError(f"max_tokens_per_pass must be >= 1, got {max_tokens_per_pass}")
        self.model = model
        self.num_speculative_tokens = num_speculative_tokens
        self.max_tokens_per_pass = max_tokens_per_pass
        self.kv_cache = PagedKVCache.for_model(model.config, num_blocks, block_size, dtype=model.dtype,
                                               device=model.device)
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.attention_backend = attention_backend
        self.generator = torch.Generator(device=model.device).manual_seed(seed)  # unseeded requests' noise
        self.cached: dict[Sequence, list[int]] = {}  # per sequence: the tokens its blocks hold, in order

    @property
    def nbytes(self) -> int:
        """The pool's bytes (fixed for the proposer's life)."""
        return self.kv_cache.nbytes

    def release(self) -> None:
        """Drop the pool's tensors (the engine is shutting down): the proposer holds no memory afterwards."""
        for seq in list(self.cached):
            self._drop(seq)
        self.kv_cache.release()

    @torch.inference_mode()
    def propose(self, sequences: list[Sequence]) -> None:
        """Set each sequence's `draft_token_ids` (up to k) and, for a sampled request, `draft_probs` (k, V)."""
        for seq in sequences:
            seq.draft_token_ids, seq.draft_probs = [], None
        plans = [plan for plan in map(self._plan, sequences) if plan is not None]
        drafts: dict[Sequence, list[int]] = {plan.seq: [] for plan in plans}
        probs: dict[Sequence, list[torch.Tensor]] = {plan.seq: [] for plan in plans}
        # First what each sequence's blocks lack (at least its last token; a whole prompt for a sequence new to the
        # draft), in passes of at most max_tokens_per_pass tokens; a sequence draws its first guess from the pass
        # that reaches its last token.
        pending = [(plan, plan.num_cached) for plan in plans]  # (plan, the next position its blocks lack)
        while pending:
            room, pieces, rest = self.max_tokens_per_pass, [], []
            for plan, start in pending:
                take = min(len(plan.tokens) - start, room)
                if take:
                    pieces.append((plan, start, plan.tokens[start : start + take]))
                    room -= take
                if start + take < len(plan.tokens):
                    rest.append((plan, start + take))
            ends = [j for j, (plan, start, chunk) in enumerate(pieces) if start + len(chunk) == len(plan.tokens)]
            logits = self._forward([plan.seq for plan, _, _ in pieces], [start for _, start, _ in pieces],
                                   [chunk for _, _, chunk in pieces], ends)  # (len(ends), vocab)
            finished = [pieces[j][0] for j in ends]
            for plan, token in zip(finished, self._draw(finished, logits, 0, probs)):
                drafts[plan.seq].append(token)
            pending = rest
        # Then one guess per pass: the one just drawn runs, at the position after the last.
        active = [plan for plan in plans if plan.num_drafts > 1]
        for guess in range(1, max((plan.num_drafts for plan in plans), default=0)):
            starts = [len(plan.tokens) + guess - 1 for plan in active]
            logits = self._forward([plan.seq for plan in active], starts, [[drafts[plan.seq][-1]] for plan in active])
            for plan, token in zip(active, self._draw(active, logits, guess, probs)):
                drafts[plan.seq].append(token)
            active = [plan for plan in active if plan.num_drafts > guess + 1]
        for plan in plans:  # only now, after every pass ran: what the blocks hold (the last guess was not run)
            seq = plan.seq
            self.cached[seq] = plan.tokens + drafts[seq][:-1]
            seq.draft_token_ids = drafts[seq]
            seq.draft_probs = torch.stack(probs[seq]) if probs[seq] else None

    def keep_only(self, running: Collection[Sequence]) -> None:
        """Give back the blocks of sequences that finished or were preempted (a preempted one starts again)."""
        for seq in [seq for seq in self.cached if seq not in running]:
            self._drop(seq)

    def _drop(self, seq: Sequence) -> None:
        del self.cached[seq]
        if self.block_manager.has_blocks(seq):
            self.block_manager.free(seq)

    def _plan(self, seq: Sequence) -> _Plan | None:
        """How many guesses `seq` gets (none past its max_tokens, none without room in the pool) and where its
        blocks' keys stop being its tokens'; grows its blocks to hold its tokens and every guess but the last."""
        tokens = seq.prompt_token_ids + seq.output_token_ids
        num_drafts = min(self.num_speculative_tokens, seq.max_new_tokens - seq.num_output_tokens - 1)
        if num_drafts < 1:
            return None
        cached = self.cached.get(seq, [])
        shared = 0
        limit = min(len(cached), len(tokens) - 1)  # the last token's keys are never cached yet
        while shared < limit and cached[shared] == tokens[shared]:
            shared += 1
        self.cached[seq] = tokens[:shared]  # true whatever happens next: positions past it are rewritten
        blocks = self.block_manager
        if not blocks.has_blocks(seq):
            if blocks.num_free_blocks < 1:
                self._drop(seq)
                return None
            blocks.allocate(seq, tokens[:1], use_cache=False)
        while num_drafts > 0 and not blocks.can_append(seq, len(tokens) + num_drafts - 1):
            num_drafts -= 1
        if num_drafts == 0:  # no room even for its own tokens: its blocks go back to the others
            self._drop(seq)
            return None
        blocks.append_slots(seq, len(tokens) + num_drafts - 1)
        return _Plan(seq, tokens, shared, num_drafts)

    def _forward(self, sequences: list[Sequence], starts: list[int], chunks: list[list[int]],
                 rows: list[int] | None = None) -> torch.Tensor:
        """One ragged batch through the draft: chunk b at positions starts[b] onwards of sequence b; the logits of
        the last token of each chunk `rows` names (all by default), (len(rows), vocab)."""
        model, block_size = self.model, self.kv_cache.block_size
        counts = [len(chunk) for chunk in chunks]
        metadata = AttentionMetadata.build([self.block_manager.block_tables[seq] for seq in sequences], starts, counts,
                                           block_size=block_size, device=model.device)
        input_ids = torch.tensor([[t for chunk in chunks for t in chunk]], device=model.device)  # (1, N)
        positions = torch.tensor(np.concatenate([np.arange(s, s + c) for s, c in zip(starts, counts)]),
                                 device=model.device)[None]  # (1, N)
        hidden = model(input_ids, PagedAttentionStep(self.kv_cache, self.attention_backend, metadata), positions)
        last_rows = np.cumsum(counts) - 1  # (B,)
        if rows is not None:
            last_rows = last_rows[rows]
        return model.compute_logits(hidden[0, torch.tensor(last_rows, device=model.device)])  # (rows, vocab)

    def _draw(self, plans: list[_Plan], logits: torch.Tensor, guess: int,
              probs: dict[Sequence, list[torch.Tensor]]) -> list[int]:
        """Guess `guess` (0-based) of each sequence from its row of logits (B, vocab): the argmax for a greedy
        request; for a sampled one a draw from its distribution (kept in `probs`), by an exponential race
        with noise from its own seed at its output position, the noise its verification draws with (seeded), or
        from this proposer's generator."""
        tokens = logits.argmax(dim=-1).tolist()  # the first of equal maxima, as the Sampler's greedy rows
        sampled = [b for b, plan in enumerate(plans) if not plan.seq.params.is_greedy]
        if not sampled:
            return tokens
        rows = torch.tensor(sampled, device=logits.device)
        p = sampling_probs(logits[rows], [plans[b].seq.params for b in sampled])  # (S, vocab)
        noise = torch.empty_like(p).exponential_(generator=self.generator)
        seeded = [j for j, b in enumerate(sampled) if plans[b].seq.params.seed is not None]
        if seeded:
            seeds = torch.tensor([plans[sampled[j]].seq.params.seed for j in seeded], dtype=torch.int64)
            draws = torch.tensor([plans[sampled[j]].seq.num_output_tokens + guess for j in seeded], dtype=torch.int64)
            noise[torch.tensor(seeded, device=p.device)] = exponential_noise(seeds.to(p.device), draws.to(p.device),
                                                                             p.shape[1])
        drawn = (p / noise.clamp_min(torch.finfo(noise.dtype).tiny)).argmax(dim=-1).tolist()  # (S,)
        for j, b in enumerate(sampled):
            tokens[b] = drawn[j]
            probs[plans[b].seq].append(p[j])
        return tokens


def load_draft_model(config: SpeculativeConfig, target: CausalLM) -> CausalLM:
    """The draft model a "draft" config names, on the target's device: `model` as `load_model` takes it, or
    "self" for the target's own weights loaded again (by the name the target was loaded by), each with
    `quantization`, and cut to its first `num_layers` layers where the config says so ("self" unquantized and
    unsharded: the target's own modules, cut; nothing is loaded). ValueError if its token ids cannot be the
    target's (another vocabulary size), or if it has no more layers than `num_layers`."""
    if config.model == "self" and config.quantization is None and config.num_layers is not None and target.tp is None:
        return target.first_layers(config.num_layers)
    if config.model == "self":
        if target.source is None:
            raise ValueError('a "self" draft loads the target again by its name, and this model was not loaded '
                             'by load_model: name the draft model instead')
        name = target.source or None  # "": the bundled model
    else:
        name = config.model
    draft, _ = load_model(name, device=target.device, quantization=config.quantization)
    check_same_vocabulary(draft, target)
    return draft if config.num_layers is None else draft.first_layers(config.num_layers)


def check_same_vocabulary(draft: CausalLM, target: CausalLM) -> None:
    """ValueError unless the draft's token ids can be the target's (the same vocabulary size)."""
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({draft.config.vocab_size} tokens) is not the target's "
                         f"({target.config.vocab_size}): it must share its tokenizer")
