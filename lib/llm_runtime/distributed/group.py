"""The tensor-parallel process group: which rank this process is, and the two collectives a sharded model needs.

A sharded layer (sharding.py) computes a partial result on every rank; the ranks then either sum their partials
(`all_reduce`: after the row-parallel o and down projections, and the vocabulary-parallel embedding) or put their
slices side by side where the sampler runs (`gather_to_first`: the logits of the vocabulary-parallel head).
Both go through torch.distributed: gloo between CPU processes, NCCL between GPUs. The group counts the bytes it
moves, so lesson 17 can set them against the arithmetic (2 all-reduces per layer x hidden size x bytes per token).

Both collectives are PyTorch operators (`llm_runtime::tp_all_reduce_`, `llm_runtime::tp_gather_to_first`), so a
compiled forward pass (worker/compiled_forward.py) keeps each as one node of its graph, which calls back into
the group when it runs; an operator names its group by the group's `handle`, an integer, since an operator takes
no Python objects. The handles are looked up in `_LIVE_GROUPS`, this module's one piece of process-wide state
(torch.distributed keeps the same kind of registry for its own groups), which holds the groups only weakly.

`init_tensor_parallel` joins the process group at a TCP store: an explicit address (the engine's workers on one
host) or the variables torchrun sets (MASTER_ADDR, MASTER_PORT; RANK and WORLD_SIZE give rank and size when
they are not passed), which also spans machines: `torchrun --nnodes 2 --nproc-per-node 4 --master-addr node0
--master-port 29500 script.py` on each machine, and `init_tensor_parallel(device=f"cuda:{local_rank}")` in
script.py, which ends with the group's `close()` (tests/distributed/test_torchrun.py runs it on loopback).
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import itertools
import os
import socket
import time
import weakref
from collections.abc import Iterator
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
    group: dist.ProcessGroup | None = field(default=None, repr=False)
    counts: CommunicationCounts = field(default_factory=CommunicationCounts, repr=False)
    # Gloo over the same store: where the other ranks wait for rank 0's next step, however long the engine stays
    # idle (no practical timeout on their side; rank 0's sends wait no longer than a step's collective).
    control: dist.ProcessGroup | None = field(default=None, repr=False)
    handle: int = field(init=False, default=0)  # how the operators name this group (module docstring)
    # A collective's timeout while `patient()`: ranks that compile their forward pass reach its first collective
    # as far apart as their compilers take.
    _patient_timeout: datetime.timedelta | None = field(init=False, default=None, repr=False)
    # How long a step's collective may wait for the other ranks (the compute group's timeout). Each `.wait()` is
    # given it as a deadline of its own: gloo's timeout alone once left rank 0 waiting forever on a stopped rank.
    timeout: datetime.timedelta | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is not in a group of {self.size}")
        if self.size > 1 and self.group is None:
            raise ValueError(f"a group of {self.size} ranks needs a torch.distributed process group")
        self.handle = next(_HANDLES)
        _LIVE_GROUPS[self.handle] = self

    @property
    def is_first(self) -> bool:
        """Rank 0: the one that runs the scheduler and the sampler, and receives the gathered logits."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of every rank's `x` (same shape everywhere), in place; returns it."""
        if self.size > 1:
            torch.ops.llm_runtime.tp_all_reduce_(x, self.handle)
        return x

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x (..., n) side by side on rank 0: (..., size * n) there, in rank order; the other ranks
        get a copy of their own x back (they have no use for the whole)."""
        if self.size == 1:
            return x
        return torch.ops.llm_runtime.tp_gather_to_first(x, self.handle)

    @contextlib.contextmanager
    def patient(self, timeout_s: float = 3600.0) -> Iterator[None]:
        """Collectives inside wait up to `timeout_s` for the other ranks, instead of the group's step timeout."""
        self._patient_timeout = datetime.timedelta(seconds=timeout_s)
        try:
            yield
        finally:
            self._patient_timeout = None

    def _all_reduce_now(self, x: torch.Tensor) -> None:
        assert self.group is not None
        self.counts.all_reduces += 1
        self.counts.all_reduce_bytes += x.numel() * x.element_size()
        options = dist.AllreduceOptions()
        if self._patient_timeout is not None:
            options.timeout = self._patient_timeout
        self._wait(self.group, self.group.allreduce([x], options))

    def _gather_now(self, x: torch.Tensor) -> torch.Tensor:
        assert self.group is not None
        self.counts.gathers += 1
        self.counts.gather_bytes += x.numel() * x.element_size()
        x = x.contiguous()
        options = dist.GatherOptions()
        options.rootRank = 0
        if self._patient_timeout is not None:
            options.timeout = self._patient_timeout
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.is_first else []
        self._wait(self.group, self.group.gather([parts] if self.is_first else [], [x], options))
        return torch.cat(parts, dim=-1) if self.is_first else x.clone()

    def broadcast_from_first(self, x: torch.Tensor, control: bool = False) -> torch.Tensor:
        """Rank 0's x on every rank (the same shape and dtype everywhere), in place; returns it. `control`: over the
        control group (a CPU tensor; the other ranks wait there as long as rank 0 takes, rank 0 no longer than a
        step's collective)."""
        if self.size > 1:
            group = self.control if control else self.group
            assert group is not None
            options = dist.BroadcastOptions()
            options.rootRank = 0
            if self._patient_timeout is not None:
                options.timeout = self._patient_timeout
            work = group.broadcast([x], options)
            if control and not self.is_first:
                work.wait()
            else:
                self._wait(group, work)
        return x

    def _wait(self, group: dist.ProcessGroup, work: dist.Work) -> None:
        """Wait for a collective until the deadline (`patient()`'s, else the step's); past it, raise. Gloo only:
        an NCCL work's `wait` with a deadline would block the host until the GPU finished (NCCL's own watchdog
        enforces the group's timeout), where a plain one only orders the streams."""
        deadline = self._patient_timeout or self.timeout
        if deadline is None or not isinstance(group, dist.ProcessGroupGloo):
            work.wait()
        elif not work.wait(deadline):  # gloo raises past the deadline; a backend that returns False, likewise
            raise RuntimeError(f"a collective waited over {deadline.total_seconds():g} s for the other ranks")

    def close(self, timeout_s: float = 30.0) -> None:
        """Leave the group (the end of a script, or an engine's workers stopped): wait at most `timeout_s` until
        every rank is here, then shut both groups down, their threads and sockets with them. A rank whose process
        exits with its group still open can die in gloo's teardown while another rank still talks to it
        ("terminate called without an active exception"); a rank that never comes (gone, or hung) makes this one
        tear its groups down without waiting (`abort`) once the deadline passes. Calling it twice is harmless."""
        if self.size == 1 or self.control is None:
            return
        options = dist.BroadcastOptions()
        options.rootRank = 0
        options.timeout = datetime.timedelta(seconds=timeout_s)  # the wait's own deadline, not the group's
        try:
            work = self.control.broadcast([torch.zeros(1)], options)  # every rank has finished its collectives
            if not work.wait(options.timeout):
                raise RuntimeError(f"the other ranks did not leave within {timeout_s:g} s")
            for group in (self.group, self.control):
                if group is not None:
                    group.shutdown()
        except Exception:  # noqa: BLE001 - a peer gone or late: nothing more to wait for
            self.abort()
        self.group = self.control = None

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
        self.group = self.control = None


@contextlib.contextmanager
def _environment(name: str, value: str) -> Iterator[None]:
    """`name` set to `value` (unless the user set it) while the block runs, and as it was afterwards: a variable that
    a library reads once, when an object is made, without this process's environment keeping it."""
    before = os.environ.get(name)
    if before is None:
        os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)


def init_tensor_parallel(rank: int | None = None, size: int | None = None, device: torch.device | str = "cpu",
                         host: str | None = None, port: int | None = None, timeout_s: float = 60.0,
                         external_store: bool | None = None) -> TensorParallelGroup:
    """Join (at rank 0: open) a process group of `size` ranks and return this rank's TensorParallelGroup: gloo
    on the CPU, NCCL on CUDA (one GPU per rank). The ranks meet at a TCP store on `host`:`port`, rank 0's;
    without them, at MASTER_ADDR:MASTER_PORT, and without `rank` and `size`, RANK and WORLD_SIZE: what torchrun
    sets in every process it starts, on one machine or several. `external_store`: the store already runs
    elsewhere (the caller's, `open_store`; torchrun's agent when None and its variable says so), and every rank
    joins it as a client."""
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
    agent_store = (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" if external_store is None
                   else external_store)
    # The rendezvous waits for ranks still starting (a rank starting imports torch: seconds on a busy host),
    # whatever a step's collectives may wait.
    rendezvous = max(timeout, datetime.timedelta(seconds=120))
    store = dist.TCPStore(host, port, world_size=size, is_master=rank == 0 and not agent_store, timeout=rendezvous)
    if external_store:  # (a store rank 0 opens waits for every rank itself; one opened elsewhere does not)
        _all_joined(store, size, rendezvous.total_seconds())
    compute_store, control_store = dist.PrefixStore("compute", store), dist.PrefixStore("control", store)
    if device.type == "cuda":
        # The deadline of an NCCL collective: its host wait only orders the streams (a wait with a deadline would
        # block the host until the GPU is done), so the group's watchdog enforces `timeout`, and in this mode (read
        # when the group is made) a collective past it aborts the communicator and raises at the step's next
        # synchronization, instead of ending the process (NCCL's default), so a server can answer 503.
        torch.cuda.set_device(device)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        with _environment("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2"):
            group: dist.ProcessGroup = dist.ProcessGroupNCCL(compute_store, rank, size, options)
        connect = getattr(group, "eager_connect_single_device", None)
        if connect is not None:  # build the communicator now, while every rank is at the rendezvous
            connect(device)
    else:
        group = _gloo(compute_store, rank, size, timeout, host)
    # The control group waits between steps: the other ranks as long as rank 0 takes (a year), rank 0 no longer than
    # a step's collective. (The timeout is each rank's own: a send still waiting on a rank that hung would hold up
    # tearing the group down for as long as it may wait.)
    control = _gloo(control_store, rank, size, timeout if rank == 0 else datetime.timedelta(days=365), host)
    return TensorParallelGroup(rank, size, group, control=control, timeout=timeout)


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _gloo(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta, host: str) -> dist.ProcessGroup:
    """A gloo group; with every rank on this host (a loopback rendezvous), its sockets bound to loopback too (gloo's
    default device listens on the address the host's name resolves to, which other machines reach)."""
    if not _is_loopback(host):
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    options._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, size, options)


def _all_joined(store: dist.Store, size: int, timeout_s: float) -> None:
    """Wait until `size` ranks have come to `store` (each adds one): the groups are made only once every rank is
    there, so their own connection deadline (a step's, seconds) does not also cover a slow rank's start."""
    store.add("llm_runtime/joined", 1)
    deadline = time.monotonic() + timeout_s
    while store.add("llm_runtime/joined", 0) < size:
        if time.monotonic() > deadline:
            raise RuntimeError(f"not every one of {size} ranks came to the rendezvous within {timeout_s:g} s")
        time.sleep(0.01)


def open_store(size: int, host: str = "127.0.0.1") -> dist.TCPStore:
    """A rendezvous store for `size` ranks, listening on `host` only, on a port the kernel picks (`.port`), in this
    process: ranks then join it as clients (`external_store=True`). Picking a free port first and binding it later
    would race with anything else that binds meanwhile; and a store given only a host name listens on every
    interface, so the socket is bound here and handed over (the store owns it, and closes it)."""
    listening = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        listening.bind((host, 0))
        listening.listen(size * 4)
        port = listening.getsockname()[1]
    except BaseException:
        listening.close()
        raise
    return dist.TCPStore(host, port, world_size=size, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=120), master_listen_fd=listening.detach(),
                         use_libuv=False)


_HANDLES = itertools.count(1)
_LIVE_GROUPS: weakref.WeakValueDictionary[int, TensorParallelGroup] = weakref.WeakValueDictionary()


@torch.library.custom_op("llm_runtime::tp_all_reduce_", mutates_args=("x",))
def _all_reduce_op(x: torch.Tensor, handle: int) -> None:
    """x summed over the ranks of the group `handle` names, in place."""
    _LIVE_GROUPS[handle]._all_reduce_now(x)


@_all_reduce_op.register_fake
def _(x: torch.Tensor, handle: int) -> None:
    return None


@torch.library.custom_op("llm_runtime::tp_gather_to_first", mutates_args=())
def _gather_op(x: torch.Tensor, handle: int) -> torch.Tensor:
    """Every rank's x side by side on rank 0 (..., size * n); elsewhere a copy of x."""
    return _LIVE_GROUPS[handle]._gather_now(x)


@_gather_op.register_fake
def _(x: torch.Tensor, handle: int) -> torch.Tensor:
    group = _LIVE_GROUPS[handle]
    if group.is_first:
        return x.new_empty((*x.shape[:-1], group.size * x.shape[-1]))
    return torch.empty_like(x)
