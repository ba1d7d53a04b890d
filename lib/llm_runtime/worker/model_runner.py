"""The model runner: one step's ragged batch in, one sampled token per finishing sequence out.

A ragged (varlen) batch has no padding. The tokens of every scheduled sequence are concatenated
into one row, `(1, N)` with N = total new tokens, each with its own position. The linear layers
(most of the compute) run once over all N tokens; attention splits them back per sequence, since
each sequence attends only to its own past, which the attention backend finds in the blocks of one
shared pool through each sequence's block table (lessons 07 and 11). The step's inputs, with its
`AttentionMetadata` (offsets, lengths, block tables, slot mapping) that every layer reads, are built
once into persistent buffers (`input_batch.py`, lesson 12).

A decode-only step runs from a CUDA graph when the engine captured them (`cuda_graphs.py`, lesson 12);
prefill and mixed steps always run eagerly. On the CPU, a step whose attention the backend can serve inside
a compiled graph runs the whole forward pass as one (`compiled_forward.py`, lesson 12), and a step of a few
tokens on a model the native step covers runs as one native call instead (`native_step.py`, lesson 19).

A constrained sequence's logits rows are masked by its grammar before they are sampled (lesson 15): one row,
or 1 + k for a sequence verifying k drafts (the masks after each draft). The masks are filled on the host
after the forward pass is launched: on CUDA the GPU is still computing the logits then, so the mask work hides
behind it; on the CPU the forward pass has finished, and the mask work adds to the step (`StepProfile.grammar`
says how much). An unconstrained batch does none of it.

The runner reads and writes the engine's pool; `kv_budget.py` decides how big it is.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..attention.backend import AttentionBackend, PagedAttentionStep
from ..attention.kv_cache import PagedKVCache
from ..attention.torch_gather import TorchGatherBackend
from ..errors import SamplingError, is_device_fault
from ..model import CausalLM
from ..sampling import Logprobs, Sampler
from ..sampling.rejection import RejectionSampler
from ..structured_output import allocate_bitmask, apply_bitmask
from ..core.scheduler import ScheduledBatch, ScheduledSequence
from ..core.sequence import Sequence, sample_sequences, verify_drafts
from .compiled_forward import CompiledForward
from .cuda_graphs import DecodeGraphs
from .input_batch import InputBuffers, ModelInput, assemble_model_input
from .native_step import NativeStep

if TYPE_CHECKING:
    from .step_channel import StepChannel, StepMessage

PROMPT_LOGPROB_ROWS = 256  # prompt positions turned into logits at once (each row is vocab-sized)


@dataclass
class StepProfile:
    """Seconds spent in each phase of the engine's steps, summed over steps (the runner fills prepare,
    forward and sample, the engine the others). On CUDA, kernels run asynchronously: their
    time lands in `sample`, where the one device-to-host copy of the step waits for them."""

    num_steps: int = 0
    propose: float = 0.0  # speculative decoding's proposer (lesson 14): guesses for the decoding sequences
    schedule: float = 0.0  # Scheduler.schedule: admission, blocks, preemption
    prepare: float = 0.0  # model inputs: token ids, positions, slot mapping, block tables
    forward: float = 0.0  # the model and the logits
    sample: float = 0.0  # the sampler and the copy of sampled tokens to the host
    postprocess: float = 0.0  # appending tokens, stop rules, freeing blocks, outputs
    # Structured output (lesson 15): filling and applying grammar masks, checking drafts against the grammar and
    # finding the tokens it forces (jump-forward).
    grammar: float = 0.0
    # Part of `forward`: the attention layers (storing K/V and attending), timed around each layer's call
    # (lesson 11). On CUDA it only sees the kernel launches.
    attention: float = 0.0

    def reset(self) -> None:
        """Zero every counter, in place: a fresh breakdown that the engine and its runner still share."""
        for f in fields(self):
            setattr(self, f.name, f.default)

    def fractions(self) -> dict[str, float]:
        """Each phase's share of step time (the phases sum to 1), and attention's share of it."""
        phases = [f.name for f in fields(self) if f.name not in ("num_steps", "attention")]
        total = sum(getattr(self, name) for name in phases) or 1.0
        return {**{name: getattr(self, name) / total for name in phases}, "attention": self.attention / total}


@dataclass
class ModelRunnerOutput:
    """What one step computed: a token (and logprobs, if asked) for each sequence that sampled, the drafts
    each speculating sequence keeps before it, and the logprobs of prompt tokens for prefill chunks whose
    request asked for them."""

    sampled: dict[Sequence, int] = field(default_factory=dict)
    accepted: dict[Sequence, list[int]] = field(default_factory=dict)  # kept drafts, before the sampled token
    logprobs: dict[Sequence, list[Logprobs]] = field(default_factory=dict)  # per new token: kept drafts, sampled
    # (sequence, chunk start, logprobs of prompt tokens start + 1, start + 2, ...)
    prompt_logprobs: list[tuple[Sequence, int, list[Logprobs]]] = field(default_factory=list)


class ModelRunner:
    """Turns a ScheduledBatch into model inputs, runs the forward pass over the paged pool and samples."""

    def __init__(self, model: CausalLM, sampler: Sampler, kv_cache: PagedKVCache,
                 profile: StepProfile | None = None, attention_backend: AttentionBackend | None = None) -> None:
        self.model = model
        self.sampler = sampler
        self.rejection_sampler = RejectionSampler(sampler)  # drafts verified (lesson 14)
        self.kv_cache = kv_cache
        self.attention_backend = attention_backend if attention_backend is not None else TorchGatherBackend()
        self.profile = profile if profile is not None else StepProfile()
        self.inputs = InputBuffers(model.device, kv_cache.block_size)
        self.graphs: DecodeGraphs | None = None  # set by the engine when it captures decode steps
        self.compiled: CompiledForward | None = None  # set by the engine when it compiles the forward pass
        self.native: NativeStep | None = None  # set by the engine when short steps run as one native call
        # Set by a tensor-parallel engine (lesson 17): each step's inputs go to the other ranks, which compute it too.
        # Its runner has no graphs and no native step (the plan chooses neither; the executor checks).
        self.channel: StepChannel | None = None

    @torch.inference_mode()
    def capture_graphs(self, graphs: DecodeGraphs) -> None:
        """Capture decode steps (after the pool exists: the graphs read and write it) and replay them from now on."""
        graphs.capture()
        self.graphs = graphs

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> ModelRunnerOutput:
        """One forward pass over the batch; samples for every sequence whose chunk reaches its last token."""
        started = time.perf_counter()
        self.kv_cache.copy_blocks(batch.block_copies)  # copy-on-write, before anyone writes this step
        model_input = self.inputs.prepare(batch)  # persistent buffers, one copy to the device (input_batch.py)
        if self.graphs is not None and self.graphs.can_run(model_input):
            prepared = time.perf_counter()
            self.profile.prepare += prepared - started
            logits = self.graphs.run(model_input)  # (R, vocab): the whole forward pass in one replay
            self.profile.forward += time.perf_counter() - prepared
            return self._sample(batch, model_input.sampling_items, logits, ModelRunnerOutput())
        sampling = model_input.sampling_items
        wants_prompt_logprobs = any(item.is_prefill and item.seq.params.prompt_logprobs is not None
                                    for item in batch.items)  # they need every position's hidden state
        if self.native is not None and not wants_prompt_logprobs and self.native.can_run(model_input):
            prepared = time.perf_counter()
            self.profile.prepare += prepared - started
            logits = self.native.run(model_input)  # (R, vocab): the whole forward pass in one native call
            if logits is not None:  # else handed back (an infinity or a NaN): the step runs below instead
                self.profile.forward += time.perf_counter() - prepared
                return self._sample(batch, sampling, logits, ModelRunnerOutput()) if sampling else ModelRunnerOutput()
            started = time.perf_counter()
        kv = PagedAttentionStep(self.kv_cache, self.attention_backend, model_input.metadata, self.profile)
        prepared = time.perf_counter()
        self.profile.prepare += prepared - started
        # None: the step runs eagerly (nothing compiled, prompt logprobs wanted, or attention the graph cannot run).
        plan = self.compiled.plan_for(kv) if self.compiled is not None and not wants_prompt_logprobs else None
        if self.channel is not None:  # the other ranks run the step the same way, compiled or not
            self._send_step(batch, model_input, compiled=plan is not None)
        if plan is not None:
            assert self.compiled is not None
            logits = self.compiled.run(model_input, kv, plan)  # (R, vocab)
            assert logits is not None
            self.profile.forward += time.perf_counter() - prepared
            return self._sample(batch, sampling, logits, ModelRunnerOutput()) if sampling else ModelRunnerOutput()
        hidden = self.model(model_input.input_ids, kv, model_input.positions)  # (1, N, hidden)

        output = ModelRunnerOutput()
        offsets = model_input.query_start_host
        for item, offset in zip(batch.items, offsets):
            if item.is_prefill and item.seq.params.prompt_logprobs is not None:
                self._prompt_logprobs(item, hidden[0, offset : offset + item.num_new_tokens], output)
        # Only a sequence whose chunk reaches its last known token samples; take that position.
        if not sampling:
            self.profile.forward += time.perf_counter() - prepared
            return output
        logits = self.model.compute_logits(hidden[0, model_input.logits_indices])  # (R, vocab)
        self.profile.forward += time.perf_counter() - prepared
        return self._sample(batch, sampling, logits, output)

    @torch.inference_mode()
    def run_remote(self, message: StepMessage) -> None:
        """A worker rank's part of rank 0's step (lesson 17): the same forward pass, compiled or not as rank 0 ran
        it, over the inputs rank 0 prepared, and the same logits calls in the same order, so that every collective
        meets its twin; rank 0 alone samples."""
        self.kv_cache.copy_blocks(message.block_copies)
        step = assemble_model_input(message.buffer.to(self.model.device), message.host, message.layout,
                                    self.kv_cache.block_size, message.block_tables_host, ())
        kv = PagedAttentionStep(self.kv_cache, self.attention_backend, step.metadata)
        if message.compiled:
            if self.compiled is None or self.compiled.run(step, kv) is None:
                raise RuntimeError("rank 0 ran a step compiled that this rank cannot run compiled")
            return
        hidden = self.model(step.input_ids, kv, step.positions)  # (1, N, hidden), the same on every rank
        for first, rows in message.prompt_rows:
            for part in prompt_logprob_slices(rows):
                self.model.compute_logits(hidden[0, first + part.start : first + part.stop])
        if message.samples:
            self.model.compute_logits(hidden[0, step.logits_indices])

    def _send_step(self, batch: ScheduledBatch, model_input: ModelInput, compiled: bool) -> None:
        """The step to the other ranks: its buffer, whether it runs compiled, and which logits it computes, in the
        order this rank will."""
        assert self.channel is not None and model_input.layout is not None
        prompt_rows = [(offset, self._prompt_rows(item)) for item, offset in zip(batch.items, model_input.query_start_host)
                       if item.is_prefill and item.seq.params.prompt_logprobs is not None]
        self.channel.send_step(model_input.layout, self.inputs.host, model_input.metadata.block_tables_host,
                               batch.block_copies, prompt_rows, samples=bool(model_input.sampling_items),
                               compiled=compiled)

    def _sample(self, batch: ScheduledBatch, sampling: tuple[int, ...], logits: torch.Tensor,
                output: ModelRunnerOutput) -> ModelRunnerOutput:
        """`_sample_now`; what fails in it (a grammar's mask, the sampler) is raised as a SamplingError, which says
        that the step's forward pass, and every collective of a sharded one, completed: it may be run again."""
        try:
            return self._sample_now(batch, sampling, logits, output)
        except Exception as error:
            if is_device_fault(error):
                raise
            raise SamplingError(f"sampling the step failed: {type(error).__name__}: {error}") from error

    def _sample_now(self, batch: ScheduledBatch, sampling: tuple[int, ...], logits: torch.Tensor,
                    output: ModelRunnerOutput) -> ModelRunnerOutput:
        """A token for each of the items `sampling` names, from their logits rows (R, vocab): one row per item,
        or 1 + k rows for an item verifying k drafts (the rejection sampler keeps some, then draws one)."""
        items = [batch.items[i] for i in sampling]
        first_rows = np.cumsum([0] + [1 + len(item.draft_token_ids) for item in items])[:-1].tolist()
        if any(item.seq.grammar is not None for item in items):
            logits = self._apply_grammars(items, first_rows, logits)
        computed = time.perf_counter()
        plain = [j for j, item in enumerate(items) if not item.draft_token_ids]
        speculating = [j for j, item in enumerate(items) if item.draft_token_ids]
        if plain:
            plain_logits = logits if not speculating else logits[torch.tensor([first_rows[j] for j in plain],
                                                                              device=logits.device)]
            seqs = [items[j].seq for j in plain]
            out = sample_sequences(self.sampler, plain_logits, seqs)
            sampled = out.token_ids.tolist()  # one host-device sync per step
            output.sampled.update(zip(seqs, sampled))
            if out.logprobs is not None:  # some row asked for logprobs: one more copy to the host
                sampled_logprobs = out.logprobs.tolist()
                top_ids = out.top_token_ids.tolist() if out.top_token_ids is not None else None
                top_logprobs = out.top_logprobs.tolist() if out.top_logprobs is not None else None
                for row, seq in enumerate(seqs):
                    k = seq.params.logprobs
                    if k is not None:
                        output.logprobs[seq] = [_entry(sampled[row], sampled_logprobs[row], top_ids, top_logprobs,
                                                       row, k)]
        if speculating:
            rows = [first_rows[j] + r for j in speculating for r in range(1 + len(items[j].draft_token_ids))]
            spec_logits = logits[torch.tensor(rows, device=logits.device)]  # (sum of k + 1, vocab)
            spec_items = [items[j] for j in speculating]
            verified = verify_drafts(self.rejection_sampler, spec_logits, spec_items)
            offset = 0
            for item, kept, token in zip(spec_items, verified.accepted, verified.next_token_ids):
                seq = item.seq
                output.accepted[seq], output.sampled[seq] = kept, token
                if seq.params.logprobs is not None:
                    emitted = [*kept, token]
                    positions = spec_logits[offset : offset + len(emitted)]  # the rows that emitted them
                    output.logprobs[seq] = _logprob_entries(positions, emitted, seq.params.logprobs)
                offset += 1 + len(item.draft_token_ids)
        self.profile.sample += time.perf_counter() - computed
        return output

    def _apply_grammars(self, items: list[ScheduledSequence], first_rows: list[int], logits: torch.Tensor
                        ) -> torch.Tensor:
        """The logits (R, vocab) with each constrained item's rows masked by its grammar: the tokens allowed next,
        and for a speculating item after each of its drafts too (the engine cut them to what the grammar allows)."""
        started = time.perf_counter()
        constrained = [(item, first) for item, first in zip(items, first_rows) if item.seq.grammar is not None]
        rows = [first + r for item, first in constrained for r in range(1 + len(item.draft_token_ids))]
        bitmask = allocate_bitmask(len(rows), logits.shape[1], pin_memory=self.inputs.pinned)  # (rows, W)
        row = 0
        for item, _ in constrained:
            grammar = item.seq.grammar
            assert grammar is not None
            if item.draft_token_ids:
                grammar.fill_drafts(item.draft_token_ids, bitmask, row)
            else:
                grammar.fill(bitmask, row)
            row += 1 + len(item.draft_token_ids)
        masked = apply_bitmask(logits, bitmask, rows)
        self.profile.grammar += time.perf_counter() - started
        return masked

    def _prompt_logprobs(self, item: ScheduledSequence, hidden: torch.Tensor, output: ModelRunnerOutput) -> None:
        """Logprobs of the prompt tokens this chunk predicts (position p predicts token p + 1), in slices
        of rows so a long chunk never holds (chunk, vocab) logits at once."""
        seq, k = item.seq, item.seq.params.prompt_logprobs
        assert k is not None
        num_rows = self._prompt_rows(item)
        targets = torch.tensor(seq.prompt_token_ids[item.start + 1 : item.start + 1 + num_rows],
                               device=hidden.device)
        entries: list[Logprobs] = []
        for part in prompt_logprob_slices(num_rows):
            entries += _logprob_entries(self.model.compute_logits(hidden[part]), targets[part].tolist(), k)
        if entries:
            output.prompt_logprobs.append((seq, item.start, entries))

    @staticmethod
    def _prompt_rows(item: ScheduledSequence) -> int:
        """How many of a prefill chunk's positions predict a prompt token (the last prompt token predicts none)."""
        return max(0, min(item.start + item.num_new_tokens, item.seq.num_prompt_tokens - 1) - item.start)


def prompt_logprob_slices(num_rows: int) -> list[slice]:
    """The slices of a chunk's prompt positions whose logits are computed at once (PROMPT_LOGPROB_ROWS each): rank 0
    and the other ranks cut them alike, so their logits gathers meet."""
    return [slice(begin, min(begin + PROMPT_LOGPROB_ROWS, num_rows))
            for begin in range(0, num_rows, PROMPT_LOGPROB_ROWS)]


def _logprob_entries(logits: torch.Tensor, tokens: list[int], k: int) -> list[Logprobs]:
    """Per row of logits (T, vocab), the logprob of tokens[t] and the k likeliest, from the model's raw
    distribution, as the Sampler reports them."""
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0].tolist()
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
    top_ids_list = None if top_ids is None else top_ids.tolist()
    top_values_list = None if top_values is None else top_values.tolist()
    return [_entry(token, chosen[t], top_ids_list, top_values_list, t, k) for t, token in enumerate(tokens)]


def _entry(token: int, logprob: float, top_ids: list[list[int]] | None, top_logprobs: list[list[float]] | None,
           row: int, k: int) -> Logprobs:
    """One position's logprobs: the chosen token's first, then the row's k most likely tokens."""
    entry = {token: logprob}
    if top_ids is not None and top_logprobs is not None:
        entry.update(zip(top_ids[row][:k], top_logprobs[row][:k]))
    return entry
