"""The tensor-parallel process group: which rank this process is, and the two collectives a sharded model needs.

A sharded layer (sharding.py) computes a partial result on every rank; the ranks then either sum their partials
(`all_reduce`: after the row-parallel o and down projections, and the vocabulary-parallel embedding) or put their
slices side by side where the sampler runs (`gather_to_first`: the logits of the vocabulary-parallel head).
Both go through torch.distributed: gloo between CPU processes, NCCL between GPUs. The group counts the bytes it
moves, so lesson 17 can set them against the arithmetic (2 all-reduces per layer x hidden size x bytes per token).

`init_tensor_parallel` joins the process group at a TCP store: an explicit address (the engine's workers on one
host) or the variables torchrun sets (MASTER_ADDR, MASTER_PORT; RANK and WORLD_SIZE give rank and size when
they are not passed), which also spans machines: `torchrun --nnodes 2 --nproc-per-node 4 --master-addr node0
--master-port 29500 script.py` on each machine, and `init_tensor_parallel(device=f"cuda:{local_rank}")` in
script.py (tests/distributed/test_torchrun.py runs it on loopback).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class CommunicationCounts:
    """Collectives a rank took part in since the last reset, and the bytes of the tensors it handed them."""

    all_reduces: int = 0
    all_reduce_bytes: int = 0
    gathers: int = 0
    gather_bytes: int = 0

    def reset(self) -> None:
        self.all_reduces = self.all_reduce_bytes = self.gathers = self.gather_bytes = 0


@dataclass(eq=False)
class TensorParallelGroup:
    """Rank `rank` of `size` ranks in `group` (None for a single rank: every collective is then a no-op).

    The group is this engine's own c10d process group, not torch.distributed's default one: two engines (a TP 1
    and a TP 3 one in a lesson, the tests' many) live side by side in one process. So the collectives call the
    group's own methods, which take ranks within the group."""

    rank: int
    size: int
    group: dist.ProcessGroup | None = None
    counts: CommunicationCounts = field(default_factory=CommunicationCounts)
    # Gloo over the same store, with no practical timeout: where the other ranks wait for rank 0's next step,
    # however long the engine stays idle (the compute group's timeout catches a hung rank mid-step).
    control: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is not in a group of {self.size}")
        if self.size > 1 and self.group is None:
            raise ValueError(f"a group of {self.size} ranks needs a torch.distributed process group")

    @property
    def is_first(self) -> bool:
        """Rank 0: the one that runs the scheduler and the sampler, and receives the gathered logits."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of every rank's `x` (same shape everywhere), in place; returns it."""
        if self.size == 1:
            return x
        self.counts.all_reduces += 1
        self.counts.all_reduce_bytes += x.numel() * x.element_size()
        assert self.group is not None
        self.group.allreduce([x]).wait()
        return x

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x (..., n) side by side on rank 0: (..., size * n) there, in rank order; the other ranks
        get their own x back (they have no use for the whole)."""
        if self.size == 1:
            return x
        self.counts.gathers += 1
        self.counts.gather_bytes += x.numel() * x.element_size()
        assert self.group is not None
        x = x.contiguous()
        options = dist.GatherOptions()
        options.rootRank = 0
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.is_first else []
        self.group.gather([parts] if self.is_first else [], [x], options).wait()
        return torch.cat(parts, dim=-1) if self.is_first else x

    def broadcast_from_first(self, x: torch.Tensor, control: bool = False) -> torch.Tensor:
        """Rank 0's x on every rank (the same shape and dtype everywhere), in place; returns it. `control`: over the
        control group (a CPU tensor; waits as long as rank 0 takes)."""
        if self.size > 1:
            group = self.control if control else self.group
            assert group is not None
            options = dist.BroadcastOptions()
            options.rootRank = 0
            group.broadcast([x], options).wait()
        return x

    def abort(self) -> None:
        """Tear the groups down without waiting for the other ranks (after a failure); best effort."""
        for group in (self.group, self.control):
            for name in ("abort", "shutdown"):
                method = getattr(group, name, None)
                if method is not None:
                    try:
                        method()
                        break
                    except Exception:  # a backend without it, or one already broken
                        continue


def init_tensor_parallel(rank: int | None = None, size: int | None = None, device: torch.device | str = "cpu",
                         host: str | None = None, port: int | None = None, timeout_s: float = 60.0
                         ) -> TensorParallelGroup:
    """Join (at rank 0: open) a process group of `size` ranks and return this rank's TensorParallelGroup: gloo
    on the CPU, NCCL on CUDA (one GPU per rank). The ranks meet at a TCP store on `host`:`port`, rank 0's;
    without them, at MASTER_ADDR:MASTER_PORT, and without `rank` and `size`, RANK and WORLD_SIZE: what torchrun
    sets in every process it starts, on one machine or several."""
    if rank is None or size is None:
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise ValueError("pass rank and size, or set RANK and WORLD_SIZE (torchrun sets them)")
        rank = int(os.environ["RANK"]) if rank is None else rank
        size = int(os.environ["WORLD_SIZE"]) if size is None else size
    device = torch.device(device)
    if size == 1:
        return TensorParallelGroup(0, 1)
    host = host or os.environ.get("MASTER_ADDR")
    port = port or (int(os.environ["MASTER_PORT"]) if os.environ.get("MASTER_PORT") else None)
    if host is None or port is None:
        raise ValueError("a process group needs its rendezvous: pass host and port, or set MASTER_ADDR and "
                         "MASTER_PORT")
    timeout = datetime.timedelta(seconds=timeout_s)
    # Under torchrun the store already runs in its agent, at MASTER_PORT: every rank joins it as a client.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(host, port, world_size=size, is_master=rank == 0 and not agent_store, timeout=timeout)
    compute_store, control_store = dist.PrefixStore("compute", store), dist.PrefixStore("control", store)
    if device.type == "cuda":
        # A failed collective aborts the communicator and raises, instead of ending the process (NCCL's default),
        # so a server can answer 503.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        torch.cuda.set_device(device)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group: dist.ProcessGroup = dist.ProcessGroupNCCL(compute_store, rank, size, options)
        connect = getattr(group, "eager_connect_single_device", None)
        if connect is not None:  # build the communicator now, while every rank is at the rendezvous
            connect(device)
    else:
        group = dist.ProcessGroupGloo(compute_store, rank, size, timeout)
    control = dist.ProcessGroupGloo(control_store, rank, size, datetime.timedelta(days=365))
    return TensorParallelGroup(rank, size, group, control=control)
