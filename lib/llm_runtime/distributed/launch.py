"""Run a function on every rank of a new tensor-parallel group: one process per rank, on this host.

`run_on_ranks(fn, size, *args)` starts `size` processes (`rank_context`: on CUDA spawned, a fresh interpreter, as
CUDA requires; on the CPU forked from a fork server), joins them in one process group over loopback, calls `fn(tp,
*args)` in each with its `TensorParallelGroup`, and returns what every rank returned, in rank order. A rank that
raises fails the call with its traceback; one that dies or hangs fails it at `timeout_s`; no process outlives the
call. The tests and lesson 17 use it to run sharded models; `fn` must be importable (a module-level function), as
spawn pickles it by name.

A rank sends its value back as bytes (`torch.save`, loaded with `weights_only=True`: data, never code), and tensors
in it come back on the CPU. Put on the queue as they are, tensors would travel as shared-memory file descriptors
that the caller fetches from the rank's process when it unpickles them; a rank that had already exited by then (it
returns, then ends) failed the call with `FileNotFoundError`, as CI saw once on 2 busy cores. The ranks meet at a
store this process opens on a port the kernel picks (no free port looked up first, for someone else to take).
"""

from __future__ import annotations

import contextlib
import io
import os
import queue
import socket
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any, Callable

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port nothing listens on now, on loopback. Something else may bind it before the caller does: the
    package's own rendezvous binds port 0 instead (group.open_store); tests use this for their servers."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def threads_per_rank(size: int) -> int:
    """The CPU threads each of `size` ranks on this host should compute with: the cores shared out."""
    return max(1, (os.cpu_count() or 1) // size)


@contextlib.contextmanager
def torch_threads(count: int | None) -> Iterator[None]:
    """PyTorch's CPU threads set to `count` while the block runs (None: left alone), and put back after. The count
    is the process's, new threads' default included: set for good, it would slow whatever else the process runs
    (an engine's rank 0 shares the cores with its workers only while they compute together). 0.2 us a call."""
    if count is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# What a rank forked from the fork server finds imported: torch and the package's rank code (3.6 s of imports on
# the 2-core CI machine, paid once per process instead of once per rank and engine).
RANK_PRELOAD = ("__main__", "llm_runtime.distributed.workers", "llm_runtime.engine.engine")


def rank_context(device: str) -> Any:
    """The multiprocessing context ranks start in. CUDA: spawn, a fresh interpreter per rank (a forked CUDA
    context is unusable). The CPU: a fork server where the platform has one, started once per process with torch
    and this package imported (`RANK_PRELOAD`), each rank a fork of it: a rank starts in a fraction of a second
    instead of importing torch anew (an engine at 2 ranks started 4 s faster). The server itself is a fresh,
    single-threaded interpreter, so nothing of the caller's threads or state is forked. It takes the
    environment and `sys.path` of the moment it starts: a variable set later does not reach later ranks."""
    if device == "cuda" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(list(RANK_PRELOAD))  # read when the server starts, the first rank's start
    return context


def watch_parent(engine_pid: int, interval_s: float = 0.5) -> None:
    """End this process (a rank) as soon as the process that started it, `engine_pid`, is gone: dead, even by
    SIGKILL. A rank forked from the fork server (`rank_context`) is that server's child, and the server ends when
    the engine does; a spawned rank is the engine's own child. Either way the kernel then hands the rank to
    another parent, which a thread polls for, along with the engine itself. PR_SET_PDEATHSIG is no substitute,
    as it fires when the spawning *thread* exits, and an engine built on a thread pool's thread would lose its
    ranks when that thread retires."""
    parent_pid = os.getppid()

    def gone() -> bool:
        if os.getppid() != parent_pid:
            return True
        try:
            os.kill(engine_pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # alive, someone else's: a pid reused by another user
            return False
        return False

    if gone():  # the engine died before this process got here
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            if gone():
                os._exit(1)

    threading.Thread(target=watch, name="llm_runtime-parent-watch", daemon=True).start()


def _rank_main(rank: int, size: int, port: int, device: str, fn: Callable[..., Any], args: tuple,
               results: Any) -> None:
    from .group import init_tensor_parallel

    torch.set_num_threads(threads_per_rank(size))  # (this process is one rank: its thread count is its own)
    try:
        rank_device = f"cuda:{rank}" if device == "cuda" else device
        tp = init_tensor_parallel(rank, size, rank_device, "127.0.0.1", port, external_store=True)
        payload = io.BytesIO()
        torch.save(fn(tp, *args), payload)  # bytes: nothing for the caller to fetch from this process later
        results.put((rank, True, payload.getvalue()))
    except BaseException:  # reported to the caller, who raises it
        results.put((rank, False, traceback.format_exc()))


def run_on_ranks(fn: Callable[..., Any], size: int, *args: Any, device: str = "cpu", timeout_s: float = 300.0
                 ) -> list[Any]:
    """`fn(tp, *args)` on each of `size` new ranks (gloo on "cpu", NCCL with one GPU each on "cuda"); the
    values they return, in rank order, tensors on the CPU (module docstring). They are loaded with
    `weights_only=True`: tensors, numbers, strings, containers, and the classes registered with
    `torch.serialization.add_safe_globals` (lessons/tensor_parallel.py registers its result types)."""
    from .group import open_store

    context = rank_context(device)
    results = context.Queue()
    store = open_store(size)  # the rendezvous, on a port the kernel picked, for as long as the ranks run
    processes = [context.Process(target=_rank_main, args=(rank, size, store.port, device, fn, args, results),
                                 daemon=True) for rank in range(size)]
    for process in processes:
        process.start()
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(values) < size:
            try:
                rank, ok, value = results.get(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                dead = [r for r, p in enumerate(processes) if p.exitcode not in (None, 0) and r not in values]
                if dead:
                    raise RuntimeError(f"rank {dead[0]} died (exit code {processes[dead[0]].exitcode}) "
                                       f"before it returned") from None
                if time.monotonic() >= deadline:
                    missing = sorted(set(range(size)) - set(values))
                    raise TimeoutError(f"ranks {missing} did not return within {timeout_s:.0f} s") from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            values[rank] = torch.load(io.BytesIO(value), map_location="cpu", weights_only=True)
    finally:
        for process in processes:
            process.join(timeout=5 if len(values) == size else 0.1)
            if process.is_alive():
                process.kill()
                process.join()
    return [values[rank] for rank in range(size)]
