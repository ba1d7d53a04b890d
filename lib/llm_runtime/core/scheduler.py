"""The scheduler: which sequences run in the next step, how many tokens each, and where their KV goes.

Iteration-level (continuous) scheduling, first come first served, with memory as the limit:
1. every running sequence gets its next tokens: one for a decode, the rest of its prompt (or as
   much as the token budget allows) for a prefill that was split. If the KV pool has no block
   for them, the newest running sequence is *preempted*: its blocks are freed, it goes back to
   the front of the queue, and it is recomputed (prompt and output so far) when it returns;
   Speculative decoding: then, in the same order, each decoding sequence's guesses from the token budget
   and the free blocks left (none in a step that had to preempt), so guesses never starve a sequence;
2. waiting sequences are admitted in arrival order while there is room: fewer than `max_num_seqs`
   running, tokens left in `max_num_batched_tokens`, and free blocks for the whole prompt
   (admission control). Leading blocks already in the prefix cache are reused, not recomputed.
   A prompt larger than the token budget left is split (chunked prefill) and continues next step.
After the step, `postprocess` appends the sampled tokens, names the blocks that became full
(prefix caching), and frees the blocks of finished sequences at once; `finish` does the same for
sequences the output processor ended (a stop string) or a failed step took down.

Parallel sampling (n > 1): only the first sequence of a request computes the prompt, up to its
last token; then the others fork it, sharing every block, and each computes the last prompt token
itself. A shared block is copied when a sequence writes into it (copy-on-write).

Speculative decoding (lesson 14): a decoding sequence whose proposer guessed its next tokens
(`Sequence.draft_token_ids`) runs them after its last token, k + 1 tokens in one chunk, as many as the
token budget and its remaining `max_tokens` allow. `postprocess` counts as computed only the drafts the
rejection sampler kept, so the rejected ones' slots are written again next step, a whole block of them
goes back to the pool, and no block holding a rejected draft is ever named in the prefix cache.
Data flows one way: schedule -> run -> postprocess.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from ..config import EngineConfig
from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSequence:
    """One sequence's share of a step: tokens [start, start + num_new_tokens) of prompt + output.

    `block_table` lists the sequence's KV blocks in order (token t is in block_table[t // block_size]).
    """

    seq: Sequence
    start: int
    num_new_tokens: int  # its own tokens, then the drafts (the drafts' count included)
    block_table: list[int] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write before it runs
    draft_token_ids: list[int] = field(default_factory=list)  # proposed tokens verified after its last one

    @property
    def samples(self) -> bool:
        """Whether this step produces a token for it (false for a prefill chunk short of the end)."""
        return self.start + self.num_new_tokens - len(self.draft_token_ids) == self.seq.num_tokens

    def token_ids(self) -> list[int]:
        """The tokens this step runs for it: its own from `start` on, then the drafts."""
        return self.seq.token_ids(self.start, self.start + self.num_new_tokens - len(self.draft_token_ids)) + \
            self.draft_token_ids

    @property
    def is_prefill(self) -> bool:
        return self.start < self.seq.num_prompt_tokens


@dataclass
class ScheduledBatch:
    """The work of one step: a ragged batch of prefill chunks and decode tokens."""

    items: list[ScheduledSequence] = field(default_factory=list)

    @property
    def block_copies(self) -> list[tuple[int, int]]:
        """(source, destination) blocks to copy before the step runs (copy-on-write)."""
        return [copy for item in self.items for copy in item.block_copies]

    @property
    def request_ids(self) -> list[str]:
        """The requests in this step, each once, in batch order."""
        return list(dict.fromkeys(item.seq.request_id for item in self.items))

    def split_by_request(self) -> list["ScheduledBatch"]:
        """One batch per request (a failed step is retried this way, to find the request at fault)."""
        return [ScheduledBatch([item for item in self.items if item.seq.request_id == request_id])
                for request_id in self.request_ids]

    @property
    def num_tokens(self) -> int:
        return sum(item.num_new_tokens for item in self.items)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(item.num_new_tokens for item in self.items if item.is_prefill)

    @property
    def num_decode_tokens(self) -> int:
        return self.num_tokens - self.num_prefill_tokens

    def __len__(self) -> int:
        return len(self.items)


@dataclass
class StepRecord:
    """What one step did: which sequences ran, how many tokens each, and how long it took."""

    index: int
    start: float
    duration: float
    # (request_id, completion index, tokens this step, whether a prefill chunk)
    items: list[tuple[str, int, int, bool]] = field(default_factory=list)
    # Speculation (lesson 14): per item, the drafts it verified and how many of them it kept; empty without any.
    drafts: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[tuple[str, int]] = field(default_factory=list)  # (request_id, index) of the sequences it preempted


class Scheduler:
    """FCFS continuous batching under a sequence cap, a per-step token budget and a KV block pool.

    Invariants (`check_invariants` asserts them): a sequence is in exactly one of `waiting` (not
    started, or preempted), `running` (in flight, holding blocks) and `forks` (a sibling waiting
    for its parent's prompt) until it finishes; only running sequences hold blocks; running
    sequences plus the forks their parents will make never exceed `max_num_seqs`; a step never
    holds more than `max_num_batched_tokens` tokens.
    """

    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.forks: dict[Sequence, list[Sequence]] = {}  # parent -> siblings that will fork from it
        self.num_preemptions = 0
        self.last_preempted: list[Sequence] = []  # the sequences the latest `schedule()` preempted
        self.num_prefix_queried_tokens = 0  # tokens looked up in the prefix cache at admission
        self.num_prefix_hit_tokens = 0  # of those, tokens found there (not recomputed)

    def add(self, seq: Sequence, siblings: list[Sequence] | None = None) -> None:
        """Queue a sequence; `siblings` (the other n - 1 completions) fork from it after its prompt."""
        if siblings and 1 + len(siblings) > self.config.max_num_seqs:
            raise ValueError(f"n = {1 + len(siblings)} completions cannot run at once under "
                             f"max_num_seqs = {self.config.max_num_seqs}")
        self.waiting.append(seq)
        if siblings:
            self.forks[seq] = list(siblings)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def num_waiting_requests(self) -> int:
        """Requests none of whose sequences runs: queued, or preempted whole (a request counts once, whatever its n)."""
        running = {seq.request_id for seq in self.running}
        return len({seq.request_id for seq in self.waiting} - running)

    def num_reserved_seqs(self) -> int:
        """Slots taken: running sequences, plus the siblings their running parents will fork."""
        return len(self.running) + sum(len(children) for parent, children in self.forks.items()
                                       if parent.status is SequenceStatus.RUNNING)

    def _tokens_to_run(self, seq: Sequence) -> int:
        """Tokens the sequence still has to compute before it can sample (or, with forks pending, fork)."""
        return seq.num_uncomputed_tokens - (1 if seq in self.forks else 0)

    def schedule(self) -> ScheduledBatch:
        """Pick this step's sequences and token counts, and give them KV blocks (preempting if needed)."""
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        blocks = self.block_manager
        preempted = False
        self.last_preempted = []
        i = 0
        while i < len(self.running) and budget > 0:  # running first: decodes are never starved by new prompts
            seq = self.running[i]
            num_new = min(self._tokens_to_run(seq), budget)
            end = seq.num_computed_tokens + num_new
            while not blocks.can_append(seq, end, num_new):
                victim = self.running[-1]  # the newest running sequence gives its memory back
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is SequenceStatus.WAITING:  # it preempted itself: nothing newer was left
                break
            copies = blocks.append_slots(seq, end, num_new)
            batch.items.append(ScheduledSequence(seq, seq.num_computed_tokens, num_new, list(blocks.block_tables[seq]),
                                                 copies))
            budget -= num_new
            i += 1
        # Speculation: drafts only from the budget every running sequence's own tokens left, in the same order, and
        # not in a step that had to preempt (the memory goes to the preempted sequences first).
        for item in batch.items if not preempted else ():
            budget -= self._add_drafts(item, budget)
        now = time.perf_counter()
        while self.waiting and budget > 0 and not preempted:  # no admissions while memory is short
            seq = self.waiting[0]
            if self.num_reserved_seqs() + 1 + len(self.forks.get(seq, ())) > self.config.max_num_seqs:
                break
            tokens = seq.token_ids(0, seq.num_tokens)  # a preempted sequence recomputes its output too
            use_cache = seq.params.prompt_logprobs is None  # prompt logprobs need every prompt token run
            if not blocks.can_allocate(tokens, use_cache):
                break  # admission control: wait until its blocks fit
            to_run = self._tokens_to_run(seq) - blocks.num_cached_tokens(tokens, use_cache)
            num_new = min(to_run, budget)
            if num_new < to_run and not self.config.enable_chunked_prefill:
                break  # the whole prompt must fit in one step; wait for a step with room
            self.waiting.popleft()
            cached = blocks.allocate(seq, tokens, use_cache)
            self.num_prefix_queried_tokens += len(tokens)
            self.num_prefix_hit_tokens += cached
            seq.num_computed_tokens = cached
            seq.status = SequenceStatus.RUNNING
            if seq.times.first_scheduled is None:
                seq.times.first_scheduled = now
            self.running.append(seq)
            if num_new == 0:  # everything before the last prompt token was cached: fork now, run next step
                self._fork(seq)
                continue
            batch.items.append(ScheduledSequence(seq, cached, num_new, list(blocks.block_tables[seq])))
            budget -= num_new
        return batch

    def _add_drafts(self, item: ScheduledSequence, budget: int) -> int:
        """Give a decoding sequence's step the proposals it verifies after its own token: within `budget`, short of
        its max_tokens (it emits one token more than it keeps), and only into free blocks (guesses never take
        memory that would preempt a sequence). Returns how many it took."""
        seq, blocks = item.seq, self.block_manager
        if not seq.draft_token_ids or seq.num_uncomputed_tokens != 1 or item.num_new_tokens != 1:
            return 0
        drafts = seq.draft_token_ids[: max(0, min(budget, seq.max_new_tokens - seq.num_output_tokens - 1))]
        end = item.start + 1
        while drafts and not blocks.can_append(seq, end + len(drafts), 1 + len(drafts)):
            drafts = drafts[:-1]
        if not drafts:
            return 0
        # The write now spans 1 + k tokens: a block shared since a fork anywhere in it is copied too.
        item.block_copies += blocks.append_slots(seq, end + len(drafts), 1 + len(drafts))
        item.block_table = list(blocks.block_tables[seq])
        item.num_new_tokens += len(drafts)
        item.draft_token_ids = drafts
        return len(drafts)

    def _preempt(self, seq: Sequence) -> None:
        """Preemption by recompute: free the newest running sequence's blocks and queue it first."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.draft_token_ids, seq.draft_probs = [], None
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        self.last_preempted.append(seq)

    def _fork(self, parent: Sequence) -> None:
        """The parent's prompt is computed up to its last token: its siblings share its blocks from here."""
        for child in self.forks.pop(parent):
            self.block_manager.fork(parent, child)
            child.num_computed_tokens = parent.num_computed_tokens
            child.status = SequenceStatus.RUNNING
            child.times.first_scheduled = parent.times.first_scheduled
            self.running.append(child)

    def postprocess(self, batch: ScheduledBatch, sampled: dict[Sequence, int], now: float,
                    accepted: dict[Sequence, list[int]] | None = None) -> list[Sequence]:
        """Record the step's results (`sampled`: the token of each sequence that sampled one; `accepted`: the
        drafts a speculating sequence keeps, before that token); return the sequences that finished by a
        token rule (blocks freed, removed from running)."""
        finished = []
        for item in batch.items:
            seq = item.seq
            seq.draft_token_ids, seq.draft_probs = [], None  # proposals are for one step
            if seq.is_finished:  # aborted while the step ran, or failed in it
                continue
            kept = accepted.get(seq, []) if accepted and item.draft_token_ids else []
            rejected = len(item.draft_token_ids) - len(kept)
            seq.num_computed_tokens += item.num_new_tokens - rejected  # the rejected drafts' slots are free again
            for token in [*kept, sampled[seq]] if seq in sampled else kept:
                seq.append_token(token, now)
                if seq.is_finished:  # a stop rule fired on a kept draft: what came after it is dropped
                    seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens)
                    break
            self._name_full_blocks(seq)  # after the kept drafts joined its tokens: they are computed
            if rejected and not seq.is_finished:
                self.block_manager.trim(seq, seq.num_tokens)  # whole blocks of rejected drafts go back
            if seq in self.forks and self._tokens_to_run(seq) == 0:
                self._fork(seq)
            if seq.is_finished:
                finished.append(seq)
        self.finish(finished)
        return finished

    def finish(self, sequences: list[Sequence]) -> None:
        """Sequences that finished (by any rule) leave: their blocks are freed and their slots taken back."""
        for seq in sequences:
            if self.block_manager.has_blocks(seq):
                self.block_manager.free(seq)
        if sequences:
            self.running = [seq for seq in self.running if not seq.is_finished]

    def _name_full_blocks(self, seq: Sequence) -> None:
        """Prefix caching: name the blocks this step filled, so later requests can find them."""
        blocks = self.block_manager
        if blocks.enable_prefix_caching and \
                (blocks.num_named_blocks(seq) + 1) * blocks.block_size <= seq.num_computed_tokens:
            blocks.mark_computed(seq, seq.token_ids(0, seq.num_computed_tokens), seq.num_computed_tokens)

    def abort(self, request_id: str, status: SequenceStatus = SequenceStatus.FINISHED_ABORTED) -> list[Sequence]:
        """Finish every sequence of `request_id` with `status` (aborted, or failed) and free its blocks."""
        now = time.perf_counter()
        ended = [seq for seq in (*self.waiting, *self.running) if seq.request_id == request_id]
        for parent in [p for p in self.forks if p.request_id == request_id]:
            ended += self.forks.pop(parent)
        for seq in ended:
            if not seq.is_finished:  # one the output processor already ended keeps its reason
                seq.finish(status, now)
        self.waiting = deque(seq for seq in self.waiting if seq.request_id != request_id)
        self.finish(ended)
        return ended

    def check_invariants(self) -> None:
        """Raise AssertionError unless every invariant in the class docstring holds, and the block books balance."""
        waiting, running = list(self.waiting), list(self.running)
        children = [child for siblings in self.forks.values() for child in siblings]
        everyone = waiting + running + children
        assert len(set(everyone)) == len(everyone), "a sequence is in two places"
        assert all(seq.status is SequenceStatus.WAITING for seq in waiting + children)
        assert all(seq.status is SequenceStatus.RUNNING for seq in running)
        assert all(parent in running or parent in waiting for parent in self.forks), "a fork parent left"
        assert self.num_reserved_seqs() <= self.config.max_num_seqs, \
            f"{self.num_reserved_seqs()} sequences hold slots; max_num_seqs is {self.config.max_num_seqs}"
        blocks = self.block_manager
        assert all(blocks.has_blocks(seq) for seq in running), "a running sequence has no blocks"
        assert not any(blocks.has_blocks(seq) for seq in waiting + children), "a waiting sequence holds blocks"
        assert len(blocks.block_tables) == len(running), "blocks held by a sequence that is not running"
        for seq in running:
            table = blocks.block_tables[seq]
            assert len(table) * blocks.block_size >= seq.num_computed_tokens, "computed tokens with no slot"
        blocks.check_invariants()
