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
a compiled graph runs the whole forward pass as one (`compiled_forward.py`, lesson 12).

The runner reads and writes the engine's pool; `kv_budget.py` decides how big it is.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields

import torch

from ..attention.backend import AttentionBackend, PagedAttentionStep
from ..attention.kv_cache import PagedKVCache
from ..attention.torch_gather import TorchGatherBackend
from ..model import CausalLM
from ..sampling import Sampler
from .compiled_forward import CompiledForward
from .cuda_graphs import DecodeGraphs
from .input_batch import InputBuffers
from .outputs import Logprobs
from .scheduler import ScheduledBatch, ScheduledSequence
from .sequence import Sequence, sample_sequences

_PROMPT_LOGPROB_ROWS = 256  # prompt positions turned into logits at once (each row is vocab-sized)


@dataclass
class StepProfile:
    """Seconds spent in each phase of the engine's steps, summed over steps (the runner fills the
    middle three, the engine the first and the last). On CUDA, kernels run asynchronously: their
    time lands in `sample`, where the one device-to-host copy of the step waits for them."""

    num_steps: int = 0
    schedule: float = 0.0  # Scheduler.schedule: admission, blocks, preemption
    prepare: float = 0.0  # model inputs: token ids, positions, slot mapping, block tables
    forward: float = 0.0  # the model and the logits
    sample: float = 0.0  # the sampler and the copy of sampled tokens to the host
    postprocess: float = 0.0  # appending tokens, stop rules, freeing blocks, outputs
    # Part of `forward`: the attention layers (storing K/V and attending), timed around each layer's call
    # (lesson 11). On CUDA it only sees the kernel launches.
    attention: float = 0.0

    def fractions(self) -> dict[str, float]:
        """Each phase's share of step time (the five phases sum to 1), and attention's share of it."""
        phases = [f.name for f in fields(self) if f.name not in ("num_steps", "attention")]
        total = sum(getattr(self, name) for name in phases) or 1.0
        return {**{name: getattr(self, name) / total for name in phases}, "attention": self.attention / total}


@dataclass
class ModelRunnerOutput:
    """What one step computed: a token (and logprobs, if asked) for each sequence that sampled, and
    the logprobs of prompt tokens for prefill chunks whose request asked for them."""

    sampled: dict[Sequence, int] = field(default_factory=dict)
    logprobs: dict[Sequence, Logprobs] = field(default_factory=dict)
    # (sequence, chunk start, logprobs of prompt tokens start + 1, start + 2, ...)
    prompt_logprobs: list[tuple[Sequence, int, list[Logprobs]]] = field(default_factory=list)


class ModelRunner:
    """Turns a ScheduledBatch into model inputs, runs the forward pass over the paged pool and samples."""

    def __init__(self, model: CausalLM, sampler: Sampler, kv_cache: PagedKVCache,
                 profile: StepProfile | None = None, attention_backend: AttentionBackend | None = None) -> None:
        self.model = model
        self.sampler = sampler
        self.kv_cache = kv_cache
        self.attention_backend = attention_backend if attention_backend is not None else TorchGatherBackend()
        self.profile = profile if profile is not None else StepProfile()
        self.inputs = InputBuffers(model.device, kv_cache.block_size)
        self.graphs: DecodeGraphs | None = None  # set by the engine when it captures decode steps
        self.compiled: CompiledForward | None = None  # set by the engine when it compiles the forward pass

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
        kv = PagedAttentionStep(self.kv_cache, self.attention_backend, model_input.metadata, self.profile)
        prepared = time.perf_counter()
        self.profile.prepare += prepared - started
        sampling = model_input.sampling_items
        wants_prompt_logprobs = any(item.is_prefill and item.seq.params.prompt_logprobs is not None
                                    for item in batch.items)  # they need every position's hidden state
        if self.compiled is not None and not wants_prompt_logprobs:
            logits = self.compiled.run(model_input, kv)  # (R, vocab), or None: this step's attention cannot
            if logits is not None:
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

    def _sample(self, batch: ScheduledBatch, sampling: tuple[int, ...], logits: torch.Tensor,
                output: ModelRunnerOutput) -> ModelRunnerOutput:
        """Sample one token for each of the items `sampling` names, from their logits rows (R, vocab)."""
        computed = time.perf_counter()
        seqs = [batch.items[i].seq for i in sampling]
        out = sample_sequences(self.sampler, logits, seqs)
        sampled = out.token_ids.tolist()  # one host-device sync per step
        self.profile.sample += time.perf_counter() - computed
        output.sampled = dict(zip(seqs, sampled))
        if out.logprobs is not None:  # some row asked for logprobs: one more copy to the host
            sampled_logprobs = out.logprobs.tolist()
            top_ids = out.top_token_ids.tolist() if out.top_token_ids is not None else None
            top_logprobs = out.top_logprobs.tolist() if out.top_logprobs is not None else None
            for row, seq in enumerate(seqs):
                k = seq.params.logprobs
                if k is not None:
                    output.logprobs[seq] = _entry(sampled[row], sampled_logprobs[row], top_ids, top_logprobs, row, k)
        return output

    def _prompt_logprobs(self, item: ScheduledSequence, hidden: torch.Tensor, output: ModelRunnerOutput) -> None:
        """Logprobs of the prompt tokens this chunk predicts (position p predicts token p + 1), in slices
        of rows so a long chunk never holds (chunk, vocab) logits at once."""
        seq, k = item.seq, item.seq.params.prompt_logprobs
        assert k is not None
        num_rows = min(item.start + item.num_new_tokens, seq.num_prompt_tokens - 1) - item.start
        targets = torch.tensor(seq.prompt_token_ids[item.start + 1 : item.start + 1 + num_rows],
                               device=hidden.device)
        entries: list[Logprobs] = []
        for begin in range(0, num_rows, _PROMPT_LOGPROB_ROWS):
            end = min(begin + _PROMPT_LOGPROB_ROWS, num_rows)
            logprobs = self.model.compute_logits(hidden[begin:end]).float().log_softmax(dim=-1)  # (rows, vocab)
            chosen = logprobs.gather(1, targets[begin:end, None])[:, 0].tolist()
            top_values, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
            top_ids_list = None if top_ids is None else top_ids.tolist()  # one copy to the host per slice
            top_values_list = None if top_values is None else top_values.tolist()
            entries += [_entry(token, chosen[row], top_ids_list, top_values_list, row, k)
                        for row, token in enumerate(targets[begin:end].tolist())]
        if entries:
            output.prompt_logprobs.append((seq, item.start, entries))


def _entry(token: int, logprob: float, top_ids: list[list[int]] | None, top_logprobs: list[list[float]] | None,
           row: int, k: int) -> Logprobs:
    """One position's logprobs: the chosen token's first, then the row's k most likely tokens."""
    entry = {token: logprob}
    if top_ids is not None and top_logprobs is not None:
        entry.update(zip(top_ids[row][:k], top_logprobs[row][:k]))
    return entry
