"""hypothesis drives the `Scheduler` and its `BlockManager` with everything at once: speculation (drafts of any
length, any prefix of them kept), forks (n > 1), preemption, prefix hits, stop-string finishes and aborts.

No model runs: a simulated pool stands for the KV cache, each slot holding the prefix whose keys it stores
(a token's key depends on every token before it). After every step:

- no shared block is written (copy-on-write happened first), and every sequence reads, at each position it
  attends to, its own prefix: nobody wrote into its blocks, and every cached block it reuses holds its tokens;
- no finished or waiting sequence is scheduled, the step holds at most `max_num_batched_tokens` tokens;
- a step that verifies drafts gave every running sequence its own token first, and every running sequence
  runs again within a bounded number of steps;
- the scheduler's and the block manager's books balance (`check_invariants`);

and at the end no block is held and every request finished exactly as it should.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llm_runtime import EngineConfig, SamplingParams, Scheduler, Sequence, SequenceStatus
from llm_runtime.core.block_manager import BlockManager

VOCAB = 6  # few tokens: prompts share prefixes, and guesses are often right


class SimulatedPool:
    """Slot -> the prefix (tuple of tokens) whose key it holds; block copies and writes as the model runner does."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.slots: dict[int, tuple[int, ...]] = {}

    def copy(self, source: int, destination: int) -> None:
        for offset in range(self.block_size):
            key = source * self.block_size + offset
            if key in self.slots:
                self.slots[destination * self.block_size + offset] = self.slots[key]
            else:
                self.slots.pop(destination * self.block_size + offset, None)

    def slot(self, table: list[int], position: int) -> int:
        return table[position // self.block_size] * self.block_size + position % self.block_size


def _requests(rng: random.Random, count: int, longest: int) -> list[tuple[list[int], int, int]]:
    """(prompt, n, max_tokens) per request: prompts from two shared stems, so that prefixes repeat."""
    stems = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, longest))] for _ in range(2)]
    requests = []
    for _ in range(count):
        prompt = (rng.choice(stems) + [rng.randrange(VOCAB) for _ in range(rng.randint(0, 4))])[:longest] or [0]
        requests.append((prompt, rng.choice([1, 1, 2, 3]), rng.randint(1, 10)))
    return requests


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**32 - 1), block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(10, 40),
       max_num_seqs=st.integers(2, 6), extra_budget=st.integers(0, 12), num_requests=st.integers(1, 8),
       max_drafts=st.integers(0, 5))
def test_the_scheduler_keeps_its_promises_under_everything_at_once(seed, block_size, num_blocks, max_num_seqs,
                                                                   extra_budget, num_requests, max_drafts) -> None:
    rng = random.Random(seed)
    budget = max_num_seqs + extra_budget
    config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, block_size=block_size)
    blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=True)
    scheduler = Scheduler(config, blocks)
    capacity = num_blocks * block_size
    longest = max(1, min(24, capacity // 2))
    requests = {}
    for i, (prompt, n, max_tokens) in enumerate(_requests(rng, num_requests, longest)):
        max_tokens = max(1, min(max_tokens, capacity // 2 - len(prompt)))
        params = SamplingParams(n=min(n, max_num_seqs), max_tokens=max_tokens, ignore_eos=True)
        sequences = [Sequence(str(i), list(prompt), params, max_new_tokens=max_tokens, index=j) for j in range(params.n)]
        requests[str(i)] = sequences
        scheduler.add(sequences[0], sequences[1:])
    pool = SimulatedPool(block_size)
    aborted: set[str] = set()
    stopped: set[Sequence] = set()
    idle: dict[Sequence, int] = {}  # running sequences: steps in a row they were not scheduled
    patience = max_num_seqs * (longest + 12) + 4
    for step in range(5000):
        if not scheduler.has_unfinished():
            break
        if rng.random() < 0.04:  # a client hangs up
            request_id = rng.choice(sorted(requests))
            scheduler.abort(request_id)
            aborted.add(request_id)
        for seq in scheduler.running:  # the proposer: guesses for the decoding sequences
            if max_drafts and seq.num_uncomputed_tokens == 1 and seq not in scheduler.forks:
                seq.draft_token_ids = [rng.randrange(VOCAB) for _ in range(rng.randint(0, max_drafts))]

        before = set(scheduler.running)
        batch = scheduler.schedule()
        running = set(scheduler.running)
        assert batch.num_tokens <= budget
        assert len({item.seq for item in batch.items}) == len(batch.items)
        if any(item.draft_token_ids for item in batch.items):
            scheduled = {item.seq for item in batch.items}
            assert before & running <= scheduled, "drafts ran while a running sequence had no token"
        for item in batch.items:
            assert item.seq.status is SequenceStatus.RUNNING and item.seq in running
        for seq in running:
            idle[seq] = 0 if seq in {item.seq for item in batch.items} else idle.get(seq, 0) + 1
            assert idle[seq] <= patience, f"{seq} has not run for {idle[seq]} steps"

        for source, destination in batch.block_copies:  # the runner copies before anything writes
            pool.copy(source, destination)
        for item in batch.items:
            seq, table = item.seq, item.block_table
            assert table == blocks.block_tables[seq]
            tokens = seq.token_ids(0, item.start) + item.token_ids()  # its prefix, then this step's tokens
            for position in range(item.start, item.start + item.num_new_tokens):
                assert blocks.allocator.ref_counts[table[position // block_size]] == 1, \
                    f"{seq} writes position {position} into a block someone else holds"
                pool.slots[pool.slot(table, position)] = tuple(tokens[: position + 1])
        for item in batch.items:  # attention: every key a sequence reads is its own prefix's
            tokens = item.seq.token_ids(0, item.start) + item.token_ids()
            for position in range(item.start + item.num_new_tokens):
                assert pool.slots.get(pool.slot(item.block_table, position)) == tuple(tokens[: position + 1]), \
                    f"{item.seq} reads another prefix's key at position {position}"

        sampled, accepted = {}, {}
        for item in batch.items:  # the model: a token for each sequence that samples, a prefix of its drafts kept
            if item.samples:
                sampled[item.seq] = rng.randrange(VOCAB)
                if item.draft_token_ids:
                    accepted[item.seq] = item.draft_token_ids[: rng.randint(0, len(item.draft_token_ids))]
        scheduler.postprocess(batch, sampled, float(step), accepted)
        # A stop string, found by the output processor in a sequence's new text (so only one with output).
        finishing = [seq for seq in scheduler.running if seq.num_output_tokens and rng.random() < 0.03]
        for seq in finishing:
            seq.finish(SequenceStatus.FINISHED_STOPPED, float(step))
            stopped.add(seq)
        scheduler.finish(finishing)
        scheduler.check_invariants()
        assert all(seq.num_output_tokens <= seq.max_new_tokens for seqs in requests.values() for seq in seqs)
    else:
        raise AssertionError("the scheduler never finished its requests")

    assert blocks.num_free_blocks == num_blocks and not any(blocks.allocator.ref_counts) and not blocks.block_tables
    for request_id, sequences in requests.items():
        for seq in sequences:
            if seq.status is SequenceStatus.FINISHED_ABORTED:
                assert request_id in aborted
            elif seq.status is SequenceStatus.FINISHED_STOPPED:
                assert seq in stopped
            else:
                assert seq.status is SequenceStatus.FINISHED_LENGTH and seq.num_output_tokens == seq.max_new_tokens
