"""Static batching, the baseline continuous batching replaces.

Requests are taken first come first served into a batch (at most `max_batch_size` of them, and
at most `max_num_batched_tokens` prompt tokens once padded). Prompts are left-padded to the same
length, so the batch is a rectangle: an attention mask hides the padding and each row gets its own
positions. The batch then decodes in lockstep until its *last* request finishes: a row that
finished early still occupies its slot (computed, thrown away), and requests behind the batch wait
for all of it (head-of-line blocking).
"""

from __future__ import annotations

import time

import torch

from ..core.scheduler import StepRecord
from ..model import CausalLM
from ..sampling import Sampler
from ..core.sequence import Sequence, SequenceStatus, sample_sequences


class StaticBatchRunner:
    """Runs sequences to completion in fixed batches; keeps a StepRecord per step when asked."""

    def __init__(
        self,
        model: CausalLM,
        sampler: Sampler | None = None,
        *,
        max_batch_size: int = 8,
        max_num_batched_tokens: int = 8192,
        record_steps: bool = False,
    ) -> None:
        if max_batch_size < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_batch_size and max_num_batched_tokens must be >= 1")
        self.model = model
        self.sampler = sampler or Sampler(device=model.device)
        self.max_batch_size = max_batch_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.record_steps = record_steps
        self.step_records: list[StepRecord] = []

    def next_batch(self, waiting: list[Sequence]) -> list[Sequence]:
        """FCFS: the longest prefix of `waiting` under both caps (always at least one request)."""
        batch: list[Sequence] = []
        longest = 0
        for seq in waiting:
            longest_if_added = max(longest, seq.num_prompt_tokens)
            padded_tokens = longest_if_added * (len(batch) + 1)
            if batch and (len(batch) == self.max_batch_size or padded_tokens > self.max_num_batched_tokens):
                break
            batch.append(seq)
            longest = longest_if_added
        return batch

    def run(self, sequences: list[Sequence]) -> list[Sequence]:
        """Generate for every sequence, batch after batch; returns them, finished."""
        waiting = list(sequences)
        while waiting:
            batch = self.next_batch(waiting)
            waiting = waiting[len(batch):]
            self._run_batch(batch)
        return sequences

    @torch.inference_mode()
    def _run_batch(self, batch: list[Sequence]) -> None:
        device = self.model.device
        num_rows = len(batch)
        prompt_len = max(seq.num_prompt_tokens for seq in batch)
        cache = self.model.new_kv_cache(num_rows, prompt_len + max(seq.max_new_tokens for seq in batch))
        # Left padding: every prompt ends at column prompt_len - 1, so each row's next token goes
        # to the same column, and the batch stays a rectangle.
        key_mask = torch.zeros(num_rows, cache.max_seq_len, dtype=torch.bool, device=device)
        input_ids = torch.zeros(num_rows, prompt_len, dtype=torch.int64, device=device)
        now = time.perf_counter()
        for row, seq in enumerate(batch):
            pad = prompt_len - seq.num_prompt_tokens
            input_ids[row, pad:] = torch.tensor(seq.prompt_token_ids, device=device)
            key_mask[row, pad:prompt_len] = True
            seq.status = SequenceStatus.RUNNING
            seq.times.first_scheduled = now
        cache.key_mask = key_mask
        positions = (key_mask[:, :prompt_len].cumsum(dim=1) - 1).clamp(min=0)  # (B, prompt_len)

        is_prefill = True
        while True:
            start = time.perf_counter()
            hidden = self.model(input_ids, cache, positions)  # (B, T, hidden)
            active = [row for row, seq in enumerate(batch) if not seq.is_finished]
            logits = self.model.compute_logits(hidden[active, -1])  # finished rows' work is discarded
            seqs = [batch[row] for row in active]
            tokens = sample_sequences(self.sampler, logits, seqs).token_ids.tolist()
            now = time.perf_counter()
            for seq, token in zip(seqs, tokens):
                seq.num_computed_tokens = seq.num_tokens
                seq.append_token(token, now)
            if self.record_steps:
                items = [(seq.request_id, seq.index, (seq.num_prompt_tokens if is_prefill else 1) if row in active
                          else 0, is_prefill) for row, seq in enumerate(batch)]
                self.step_records.append(StepRecord(len(self.step_records), start, now - start, items))
            if all(seq.is_finished for seq in batch):
                return
            # Decode step: every row feeds one token, finished rows a dummy one (a wasted slot).
            last = [seq.output_token_ids[-1] if not seq.is_finished else 0 for seq in batch]
            input_ids = torch.tensor(last, device=device)[:, None]  # (B, 1)
            key_mask[:, cache.num_tokens] = True
            positions = positions[:, -1:] + 1  # (B, 1)
            is_prefill = False
