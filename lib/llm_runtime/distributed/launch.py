"""Run a function on every rank of a new tensor-parallel group: one process per rank, on this host.

`run_on_ranks(fn, size, *args)` starts `size` processes (`rank_context`: on CUDA spawned, a fresh interpreter, as
CUDA requires; on the CPU forked from a fork server), joins them in one process group over loopback, calls `fn(tp,
*args)` in each with its `TensorParallelGroup`, and returns what every rank returned, in rank order. A rank that
raises fails the call with its traceback; one that dies or hangs fails it at `timeout_s`; no process outlives the
call. The tests and lesson 17 use it to run sharded models; `fn` must be importable (a module-level function): it
travels to the ranks pickled, by name.

A rank sends its value back as bytes (`torch.save`, loaded with `weights_only=True`: data, never code), and tensors
in it come back on the CPU. Put on the queue as they are, tensors would travel as shared-memory file descriptors
that the caller fetches from the rank's process when it unpickles them; a rank that had already exited by then (it
returns, then ends) failed the call with `FileNotFoundError`, as CI saw once on 2 busy cores. The ranks meet at a
store this process opens on a port the kernel picks (no free port looked up first, for someone else to take).
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing
import multiprocessing.connection
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


# What a rank forked from the fork server finds imported: the interpreter's own torch and transformers (3 of the 3.6 s
# a fresh rank spent importing on the 2-core CI machine). Not this package: the server takes the interpreter's default
# `sys.path`, not the caller's, so it could find another copy; each rank imports the package from the caller's path.
RANK_PRELOAD = ("torch", "transformers")


def rank_context(device: str) -> Any:
    """The multiprocessing context ranks start in. CUDA: spawn, a fresh interpreter per rank (a forked CUDA
    context is unusable). The CPU: a fork server where the platform has one (one per process, started with the
    first rank, `RANK_PRELOAD` imported), each rank a fork of it: an engine at 3 ranks started in 2.6 s instead of
    5.5. The server is a fresh interpreter that has computed nothing, so no thread or lock of the caller's is
    forked. Its environment is the caller's when it started: each rank takes the caller's current one
    (`rank_environment`, `adopt_environment`), except what torch read at import (OMP_*, ATEN_CPU_CAPABILITY)."""
    if torch.device(device).type == "cuda" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(list(RANK_PRELOAD))  # read once, when the server starts
    return context


def rank_environment() -> dict[str, str]:
    """The caller's environment, for a rank to adopt (a forked rank would otherwise have the fork server's)."""
    return dict(os.environ)


def adopt_environment(environment: dict[str, str]) -> None:
    """In a rank: the environment its engine had when it started the rank (`LLM_RUNTIME_*`, caches, ...)."""
    os.environ.clear()
    os.environ.update(environment)


def watch_parent(engine_pid: int, interval_s: float = 0.5) -> None:
    """End this process (a rank) as soon as the engine's process that started it, `engine_pid`, ends, even by
    SIGKILL, reaped or not. multiprocessing gives every child, spawned or forked from the fork server, the read
    end of a pipe whose write end only that engine's process holds: it reads as closed the moment that process
    is gone (`parent_process().sentinel`), which neither a reused pid nor a zombie fools. A thread waits on it.
    A rank started some other way polls for a new parent. PR_SET_PDEATHSIG is no substitute: it fires when the
    spawning *thread* exits, and an engine built on a thread pool's thread would lose its ranks when that thread
    retires."""
    parent = multiprocessing.parent_process()
    if parent is not None:
        if not parent.is_alive():  # the engine died before this process got here
            os._exit(1)

        def watch() -> None:
            multiprocessing.connection.wait([parent.sentinel])  # returns when the pipe closes
            os._exit(1)
    else:
        if os.getppid() != engine_pid:
            os._exit(1)

        def watch() -> None:
            while True:
                time.sleep(interval_s)
                if os.getppid() != engine_pid:
                    os._exit(1)

    threading.Thread(target=watch, name="llm_runtime-parent-watch", daemon=True).start()


def _rank_main(rank: int, size: int, port: int, device: str, fn: Callable[..., Any], args: tuple,
               results: Any, environment: dict[str, str]) -> None:
    adopt_environment(environment)
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
    processes = [context.Process(target=_rank_main, args=(rank, size, store.port, device, fn, args, results,
                                                           rank_environment()),
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
