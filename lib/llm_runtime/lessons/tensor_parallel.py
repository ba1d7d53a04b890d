"""Tensor parallelism by hand (lesson 17): a product split by columns then rows, which KV heads a rank keeps,
a ring all-reduce simulated step by step, and a timed step of a sharded model on every rank.

    parallel_product(x, a, b, size)          # each rank's partial x @ a[:, cols] @ b[rows, :]; they sum to x @ a @ b
    kv_heads_for_rank(15, 5, size=3, rank=1) # the KV heads rank 1's query heads read
    ring_all_reduce(parts)                   # every rank's sum, and how many values each rank sent
    run_on_ranks(time_sharded_step, 3, None, "float32", 8, 20)   # per rank: a step's timeline and its costs
    run_on_ranks(all_reduce_latency, 2, (8, 576), 200)          # one all-reduce with nothing else to do

`time_sharded_step` and `all_reduce_latency` run on the ranks `run_on_ranks` starts (the ranks receive
them pickled, by name, so they live here, not in a notebook cell).
"""

from __future__ import annotations

import resource
import statistics
import time
from dataclasses import dataclass, field

import torch

from ..distributed.group import TensorParallelGroup
from ..distributed.sharding import heads_of_rank


def parallel_product(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, size: int) -> list[torch.Tensor]:
    """Rank r's partial of x @ a @ b (x (M, K), a (K, N), b (N, P); size divides N): x @ a's column block r,
    then that (M, N / size) slice times b's row block r. The partials sum to the whole product; nothing between
    the two products needs the other ranks (an elementwise function of x @ a, such as SiLU, could run there)."""
    if a.shape[1] % size:
        raise ValueError(f"{size} ranks do not divide the {a.shape[1]} columns of a")
    width = a.shape[1] // size
    return [(x @ a[:, r * width : (r + 1) * width]) @ b[r * width : (r + 1) * width, :] for r in range(size)]


def kv_heads_for_rank(num_heads: int, num_kv_heads: int, size: int, rank: int) -> list[int]:
    """The KV heads rank `rank` of `size` holds: the ones its query heads read (query head q reads KV head
    q // (num_heads / num_kv_heads)); with fewer KV heads than ranks, a KV head is replicated."""
    return list(heads_of_rank(num_heads, num_kv_heads, rank, size)[1])


def ring_all_reduce(parts: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
    """A ring all-reduce of `parts` (one 1-D tensor per rank, equal lengths that the rank count divides), step
    by step: every rank's copy of the sum, and the number of values each rank sent.

    Each tensor is cut in `n` chunks. Reduce-scatter: in step s (0 .. n-2) rank r sends its running sum of chunk
    (r - s) mod n to rank r + 1, which adds it to its own; after n - 1 steps rank r holds the whole sum of chunk
    (r + 1) mod n. All-gather: in n - 1 more steps each rank passes on the finished chunk it last received. So each
    rank sends 2 (n - 1) chunks, 2 (n - 1) / n of the tensor, however many ranks there are."""
    n = len(parts)
    if n == 0 or any(p.dim() != 1 or p.numel() != parts[0].numel() for p in parts) or parts[0].numel() % n:
        raise ValueError("one 1-D tensor per rank, all of one length that the number of ranks divides")
    chunks = [list(p.clone().chunk(n)) for p in parts]  # chunks[rank][c]
    sent = [0] * n
    for step in range(n - 1):  # reduce-scatter
        outgoing = [(r, (r - step) % n, chunks[r][(r - step) % n].clone()) for r in range(n)]
        for r, c, values in outgoing:
            chunks[(r + 1) % n][c] += values
            sent[r] += values.numel()
    for step in range(n - 1):  # all-gather: rank r starts with chunk r + 1, finished
        outgoing = [(r, (r + 1 - step) % n, chunks[r][(r + 1 - step) % n].clone()) for r in range(n)]
        for r, c, values in outgoing:
            chunks[(r + 1) % n][c] = values
            sent[r] += values.numel()
    return [torch.cat(c) for c in chunks], sent


@dataclass
class StepTimes:
    """One rank's timed steps of a sharded model: `events` are one step's (kind, start, end), "all-reduce" or
    "gather", in `time.perf_counter` seconds (one clock for every process on a Linux host); the step itself runs
    from `start` to `end`, with the collectives it took part in and their bytes. Every rank reports the same step
    (the median of the repeats by their durations summed over the ranks), so the ranks' timelines line up."""

    rank: int
    size: int
    threads: int
    start: float
    end: float
    events: list[tuple[str, float, float]] = field(default_factory=list)
    step_s: float = 0.0
    collective_s: float = 0.0
    all_reduces: int = 0
    all_reduce_bytes: int = 0

    @property
    def compute_s(self) -> float:
        """The median step's time outside collectives: this rank's own arithmetic."""
        return self.step_s - self.collective_s


def _sync(tp: TensorParallelGroup) -> None:
    """Every rank waits here for the others (an all-reduce of one number, left out of the counts)."""
    if tp.group is not None:
        tp.group.allreduce([torch.zeros(1)]).wait()


def time_sharded_step(tp: TensorParallelGroup, source: str | None, dtype: str, rows: int, repeats: int
                      ) -> StepTimes:
    """On each rank: load its shard of `source` (None: the bundled model), then time `repeats` steps of `rows`
    sequences one new token each (the model's forward pass and the logits; no KV context, which at short
    lengths is a small part of a step), every step starting together after a sync. Recording each collective's
    start and end (the group's methods wrapped on this rank's instance) costs a clock read each."""
    from ..model.loader import load_model_weights

    model = load_model_weights(source, device="cpu", dtype=dtype, tensor_parallel=tp)
    ids = torch.randint(0, model.config.vocab_size, (rows, 1), generator=torch.Generator().manual_seed(17))
    events: list[tuple[str, float, float]] = []

    def recorded(kind: str, collective):
        def call(x: torch.Tensor) -> torch.Tensor:
            began = time.perf_counter()
            out = collective(x)
            events.append((kind, began, time.perf_counter()))
            return out
        return call

    tp.all_reduce = recorded("all-reduce", tp.all_reduce)  # type: ignore[method-assign]
    tp.gather_to_first = recorded("gather", tp.gather_to_first)  # type: ignore[method-assign]
    steps = []
    with torch.inference_mode():
        for repeat in range(repeats + 3):  # 3 to warm up
            _sync(tp)
            events.clear()
            tp.counts.reset()
            began = time.perf_counter()
            model.compute_logits(model(ids)[:, -1])  # (rows, 1, hidden) -> (rows, vocab) on rank 0
            ended = time.perf_counter()
            if repeat >= 3:
                steps.append((ended - began, began, ended, list(events), tp.counts.all_reduces,
                              tp.counts.all_reduce_bytes))
    # One step for every rank to report, so that a timeline draws the same step on each: the median of the steps'
    # durations summed over the ranks (an all-reduce left out of the counts, like the syncs).
    durations = torch.tensor([step[0] for step in steps], dtype=torch.float64)  # (repeats,)
    if tp.group is not None:
        tp.group.allreduce([durations]).wait()
    chosen = int(durations.argsort()[len(steps) // 2])
    step_s, began, ended, step_events, reduces, reduce_bytes = steps[chosen]
    collective_s = sum(e - s for _, s, e in step_events)
    return StepTimes(tp.rank, tp.size, torch.get_num_threads(), began, ended, step_events, step_s, collective_s,
                     reduces, reduce_bytes)


@dataclass(frozen=True)
class Latency:
    """One rank's all-reduces with nothing between them: the median time of one, the share of the wall time the
    process spent on a CPU meanwhile (gloo's threads poll while they wait), and the times the operating system
    took the CPU away from it (involuntary context switches) during them."""

    rank: int
    size: int
    median_s: float
    cpu_share: float
    preempted: int


# What the ranks send back is loaded as data only (run_on_ranks: weights_only=True); these are the classes it may hold.
torch.serialization.add_safe_globals([StepTimes, Latency])


def all_reduce_latency(tp: TensorParallelGroup, shape: tuple[int, ...], repeats: int, rounds: int = 3) -> Latency:
    """Time `rounds` rounds of `repeats` all-reduces of a float32 tensor of `shape`, back to back, on every rank:
    the lowest round's median (a burst of other work on the host spoils a round, not the figure), and that
    round's CPU share and preemptions."""
    if tp.group is None:
        raise ValueError("an all-reduce needs at least 2 ranks")
    x = torch.zeros(shape)
    for _ in range(5):  # the first ones set up the connections
        tp.group.allreduce([x]).wait()
    best: Latency | None = None
    for _ in range(rounds):
        _sync(tp)
        times = []
        switches = resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(repeats):
            began = time.perf_counter()
            tp.group.allreduce([x]).wait()
            times.append(time.perf_counter() - began)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        switches = resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw - switches
        result = Latency(tp.rank, tp.size, statistics.median(times), cpu / wall, switches)
        if best is None or result.median_s < best.median_s:
            best = result
    assert best is not None
    return best
