"""`EngineCore`: the scheduler, the KV blocks' books, speculation and grammars as scheduled work, and one step.

    core = EngineCore(config, executor, tokenizer)
    core.add(sequences)
    step = core.step()          # propose, constrain drafts, schedule, execute, record: a CoreStep, or None
    core.finish_step(step, finished, failed, processed_at)   # what the output processor ended, and the books

The core decides and the executor runs: it knows the executor's interface (`execute`, `step_failed`,
`compute_threads`), never how the model was prepared or where the ranks live. A step that fails is run again one
request at a time, unless the executor says it cannot be (a device fault, a sharded forward pass): then the core
is dead, and says why on every later call (EngineDeadError).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from ..config import EngineConfig
from ..core.block_manager import BlockManager
from ..core.scheduler import ScheduledBatch, Scheduler, StepRecord
from ..core.sequence import Sequence, SequenceStatus
from ..errors import EngineDeadError, is_device_fault
from ..executor import Executor
from ..model.tokenizer import Tokenizer
from ..spec_decode.draft_model import DraftModelProposer
from ..spec_decode.stats import SpeculationStats
from ..worker.model_runner import ModelRunnerOutput

logger = logging.getLogger(__name__)


@dataclass
class CoreStep:
    """One step the core ran: its batch, what the executor computed, and when (perf_counter seconds)."""

    batch: ScheduledBatch
    result: ModelRunnerOutput
    started: float  # before the scheduling
    computed: float  # after the forward pass, the sampling and the scheduler's postprocess


class EngineCore:
    """The scheduler and the block manager over the executor's pool, the proposer, and one step (module docstring)."""

    def __init__(self, config: EngineConfig, executor: Executor, tokenizer: Tokenizer | None) -> None:
        self.config = config
        self.executor = executor
        self.tokenizer = tokenizer  # the grammars' forced tokens are found in text (jump-forward)
        self.block_manager = BlockManager(executor.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager)
        self.proposer = executor.proposer
        self.profile = executor.profile  # where step time goes (lesson 09, bench): the runner fills its parts
        spec = config.speculative_config
        self.spec_stats = SpeculationStats(spec.num_speculative_tokens) if spec is not None else None
        self.num_failed_requests = 0
        self.num_forced_tokens = self.num_accepted_forced_tokens = 0
        self._forced: set[Sequence] = set()  # this step's sequences whose drafts are the tokens their grammar forces
        self._unspeculated: set[Sequence] = set()  # sequences whose proposals failed: they decode one token a step
        self.dead_reason: BaseException | None = None  # what killed the core (a device fault, a failed rank)
        self.step_records: list[StepRecord] = []  # every step's, with `record_steps`
        self.last_step: StepRecord | None = None  # the latest step's, always (the server's live feed reads it)
        self.num_steps = 0
        self.num_idle_steps = 0  # consecutive steps that scheduled nothing while requests were left

    # ------------------------------------------------------------------ requests
    def add(self, sequences: list[Sequence]) -> None:
        """A request's sequences (the first, and the siblings it forks into after its prompt)."""
        self.scheduler.add(sequences[0], sequences[1:])

    def abort(self, request_id: str, status: SequenceStatus = SequenceStatus.FINISHED_ABORTED) -> None:
        self.scheduler.abort(request_id, status)
        if self.proposer is not None:
            self.proposer.keep_only(set(self.scheduler.running))

    def fail(self, request_id: str) -> None:
        """Finish every sequence of a request with an error, wherever it is (running, waiting, a fork to make), and
        free its blocks."""
        self.scheduler.abort(request_id, SequenceStatus.FINISHED_ERROR)
        self.num_failed_requests += 1

    def check_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(f"the engine's device failed; create a new engine: {self.dead_reason!r}")

    # ------------------------------------------------------------------ the step
    def step(self, has_unfinished: bool) -> CoreStep | None:
        """(Propose,) constrain drafts, schedule, execute, postprocess the scheduler's books. None when nothing
        could be scheduled. Raises EngineDeadError once the device or a rank failed."""
        self.check_alive()
        self.last_step = None  # (a step that schedules nothing leaves none)
        start = time.perf_counter()
        if self.proposer is not None:
            self._propose()
            proposed = time.perf_counter()
            self.profile.propose += proposed - start
            start = proposed
        if any(seq.grammar is not None for seq in self.scheduler.running):
            self._constrain_drafts()
            constrained = time.perf_counter()
            self.profile.grammar += constrained - start
            start = constrained
        batch = self.scheduler.schedule()
        self.num_idle_steps = 0 if batch.items or not has_unfinished else self.num_idle_steps + 1
        if not batch.items:
            return None
        scheduled = time.perf_counter()
        self.profile.schedule += scheduled - start
        with self.executor.compute_threads():
            result = self._run(batch)
        computed = time.perf_counter()
        self._record_speculation(batch, result)
        self.scheduler.postprocess(batch, result.sampled, computed, result.accepted)
        return CoreStep(batch, result, start, computed)

    def finish_step(self, step: CoreStep, finished: list[Sequence], failed: list[str]) -> None:
        """After the output processor: sequences a stop string ended free their blocks now, requests whose output
        failed leave, a draft model's blocks go back with the sequences that left, and the step is recorded."""
        self.scheduler.finish(finished)
        for request_id in failed:  # every sequence of the request leaves, a waiting sibling's too
            self.fail(request_id)
        if self.proposer is not None:
            self.proposer.keep_only(set(self.scheduler.running))
        self._record(step.batch, step.result, step.started, step.computed)
        self.num_steps += 1
        self.profile.postprocess += time.perf_counter() - step.computed
        self.profile.num_steps += 1

    def _die(self, error: BaseException) -> None:
        """The device (or a rank) failed: the core refuses every step from now on (EngineDeadError); what was live
        stays as it was until the engine shuts down."""
        logger.error("the device failed (%s: %s); the engine is dead", type(error).__name__, error)
        self.dead_reason = error
        raise EngineDeadError(f"the engine's device failed; create a new engine: {error!r}") from error

    def _run(self, batch: ScheduledBatch) -> ModelRunnerOutput:
        """Run the step; if it fails, run it again one request at a time and fail only the requests whose part fails
        again. Rerunning is safe: nothing was recorded for the failed step, its KV writes go to the same slots again,
        copy-on-write copies are idempotent, and a seeded request's noise is a function of its seed and output
        length, so its retry draws the same noise. A failure the executor says cannot be retried (a fault of the
        device itself, a sharded step that failed before its sampling) kills the core."""
        try:
            return self.executor.execute(batch)
        except Exception as error:
            fatal = self.executor.step_failed(error)
            if fatal is not None:
                self._die(fatal)
            logger.exception("a step of %d requests failed; retrying them one at a time", len(batch.request_ids))
        result = ModelRunnerOutput()
        for part in batch.split_by_request():
            request_id = part.items[0].seq.request_id
            try:
                partial = self.executor.execute(part)
            except Exception as error:
                fatal = self.executor.step_failed(error)
                if fatal is not None:
                    self._die(fatal)
                logger.exception("request %s failed; finishing it with an error", request_id)
                self.fail(request_id)
                continue
            result.sampled.update(partial.sampled)
            result.accepted.update(partial.accepted)
            result.logprobs.update(partial.logprobs)
            result.prompt_logprobs += partial.prompt_logprobs
        return result

    # ------------------------------------------------------------------ speculation and grammars
    def _propose(self) -> None:
        """Guesses for every running sequence whose next step is a decode; the proposer drops what it kept for
        sequences that left (finished, or preempted: they start again). If proposing fails, it is tried again
        one sequence at a time, and a sequence whose proposal fails again decodes without guesses from now on:
        speculation is an optimisation, and the target alone still gives its tokens exactly."""
        scheduler, proposer = self.scheduler, self.proposer
        assert proposer is not None
        self._unspeculated &= set(scheduler.running)
        proposer.keep_only(set(scheduler.running) - self._unspeculated)
        decoding = [seq for seq in scheduler.running if seq.num_uncomputed_tokens == 1 and seq not in scheduler.forks
                    and seq not in self._unspeculated]
        try:
            proposer.propose(decoding)
            return
        except Exception as error:
            if is_device_fault(error):
                self._die(error)
            logger.exception("proposing for %d sequences failed; retrying them one at a time", len(decoding))
        for seq in decoding:
            try:
                proposer.propose([seq])
            except Exception as error:
                if is_device_fault(error):
                    self._die(error)
                logger.exception("proposing for %r failed; it decodes without speculation from now on", seq)
                seq.draft_token_ids, seq.draft_probs = [], None
                self._unspeculated.add(seq)
        proposer.keep_only(set(scheduler.running) - self._unspeculated)

    def _constrain_drafts(self) -> None:
        """Drafts of constrained sequences about to decode (lesson 15): a proposer's are cut to the longest prefix
        their grammar allows (a refused draft could never be kept, and its mask could not be filled); where none
        remain, the tokens the grammar forces from here (jump-forward, up to `max_forced_tokens`) become the drafts.
        Forced drafts are sure guesses, verified as any other: the model keeps those it would have produced, so the
        output is what it would be without them, in fewer steps."""
        self._forced.clear()
        limit, scheduler = self.config.max_forced_tokens, self.scheduler
        for seq in scheduler.running:
            grammar = seq.grammar
            if grammar is None or seq.num_uncomputed_tokens != 1 or seq in scheduler.forks:
                continue
            if seq.draft_token_ids:
                kept = grammar.valid_prefix(seq.draft_token_ids)
                if len(kept) < len(seq.draft_token_ids):
                    seq.draft_token_ids = kept
                    seq.draft_probs = None if seq.draft_probs is None or not kept else seq.draft_probs[: len(kept)]
            if not seq.draft_token_ids and limit and self.tokenizer is not None:
                forced = grammar.forced_tokens(self.tokenizer, min(limit, seq.max_new_tokens - seq.num_output_tokens - 1))
                if forced:
                    seq.draft_token_ids, seq.draft_probs = forced, None
                    self._forced.add(seq)

    def _record_speculation(self, batch: ScheduledBatch, result: ModelRunnerOutput) -> None:
        for item in batch.items:
            if not item.draft_token_ids or item.seq not in result.accepted:
                continue
            if item.seq in self._forced:  # the grammar's drafts, not the proposer's
                self.num_forced_tokens += len(item.draft_token_ids)
                self.num_accepted_forced_tokens += len(result.accepted[item.seq])
            elif self.spec_stats is not None:
                self.spec_stats.record(len(item.draft_token_ids), len(result.accepted[item.seq]))

    # ------------------------------------------------------------------ books
    def check_invariants(self, live: set[Sequence]) -> None:
        """Assert the scheduler's and the block manager's books against the `live` sequences of the requests the
        engine holds, and that unfinished work makes progress."""
        self.scheduler.check_invariants()
        scheduled = set(self.scheduler.running) | set(self.scheduler.waiting) | {
            child for children in self.scheduler.forks.values() for child in children}
        assert live == scheduled, "a live request's sequence is missing from the scheduler, or the reverse"
        if isinstance(self.proposer, DraftModelProposer):  # the draft's pool: only running sequences hold blocks
            draft_blocks = self.proposer.block_manager
            assert set(draft_blocks.block_tables) <= set(self.scheduler.running), "a draft block outlived its sequence"
            draft_blocks.check_invariants()
        # Only a fork made at admission leaves one step with nothing to run; two in a row means stuck.
        assert self.num_idle_steps < 2, "requests are waiting but no step can run them"

    def _record(self, batch: ScheduledBatch, result: ModelRunnerOutput, start: float, end: float) -> None:
        items = [(it.seq.request_id, it.seq.index, it.num_new_tokens, it.is_prefill) for it in batch.items]
        drafts = [(len(it.draft_token_ids), len(result.accepted.get(it.seq, ()))) for it in batch.items] \
            if any(it.draft_token_ids for it in batch.items) else []
        preempted = [(seq.request_id, seq.index) for seq in self.scheduler.last_preempted]
        self.last_step = StepRecord(self.num_steps, start, end - start, items, drafts, preempted)
        if self.config.record_steps:
            self.step_records.append(self.last_step)
