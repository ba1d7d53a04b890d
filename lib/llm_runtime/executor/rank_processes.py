"""The engine's other ranks (lesson 17): processes that each run a `Worker` over a shard of the model and its KV
pool, and compute every step rank 0 sends them (the tensor-parallel executor drives them: tensor_parallel.py).

`ShardWorkers.start` starts ranks 1 .. size - 1 (launch.rank_context: spawned on CUDA, forked from a fork server
with torch imported on the CPU), opens the process group as rank 0
(the caller: the engine's process, which keeps the scheduler, the block manager and the sampler) and returns
once every rank has joined. Each worker loads its own shard (only its slices are read from the files), waits for
rank 0's set-up (`configure`: the plan, worker/plan.py, and the pool's size, decided on rank 0 from its own shard),
prepares its shard by the same `Worker` code as rank 0, then loops: receive a step (worker/step_channel.py), run
the same forward pass over its pool (`Worker.execute_remote`), taking part in the logits gathers, until told to
stop.

Faults: a worker that raises reports it and exits; a worker that dies breaks the group's sockets, so rank 0's next
collective fails at once, and a hung one fails it after the group's timeout; `check` says which worker died. A
worker whose engine's process ends (even by SIGKILL, reaped or not) ends at once (launch.watch_parent), so none is
left behind, and one whose engine lives stays however the thread that started it ends. Workers import the main
module again (spawn's rule, and the fork server's children follow it): a script that starts an engine with
tensor_parallel_size > 1 keeps that under `if __name__ == "__main__":` (as with vLLM).

Life cycle: the ranks meet at a store rank 0 opens on a port the kernel picks; the settings travel as JSON, never
pickle (the store and the groups' sockets are unauthenticated, even on loopback); `close` stops the workers, and
every rank then shuts its groups down (their threads and sockets: an engine leaves none behind, even while an old
reference to it lives), or tears them down without waiting for a rank that is gone. On the CPU rank 0 computes with
its share of the cores only while the ranks compute together (`num_threads`, applied by the engine around its
steps), never by changing the process's thread count for everything else it runs.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from ..distributed.group import TensorParallelGroup, init_tensor_parallel, open_store
from ..distributed.launch import adopt_environment, rank_context, rank_environment, threads_per_rank, watch_parent
from ..worker.plan import ModelPlan


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to load its shard: the model's name (None: the bundled one) and how it is loaded."""

    source: str | None
    device: str  # "cpu", or "cuda" (rank r on GPU r)
    dtype: str
    quantization: str | None = None
    group_size: int | None = None
    timeout_s: float = 30.0  # a collective of a step that waits longer fails (a hung rank)


@dataclass(frozen=True)
class RankSetup:
    """What rank 0 decides for every rank once its own shard is loaded: the plan, the pool's size, the longest
    context, and for an int8 pool the token ids its scales are measured over."""

    plan: ModelPlan
    num_blocks: int
    max_model_len: int
    kv_calibration: tuple[int, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        return {"plan": self.plan.to_json(), "num_blocks": self.num_blocks, "max_model_len": self.max_model_len,
                "kv_calibration": None if self.kv_calibration is None else list(self.kv_calibration)}

    @classmethod
    def from_json(cls, value: object) -> "RankSetup":
        """The set-up rank 0 sent (a JSON object of exactly these fields); RuntimeError for anything else."""
        names = {field.name for field in dataclasses.fields(cls)}
        if not isinstance(value, dict) or set(value) != names:
            raise RuntimeError(f"a worker expected its set-up first, got {value!r}")
        calibration = value["kv_calibration"]
        counts = (value["num_blocks"], value["max_model_len"])
        if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in counts):
            raise RuntimeError(f"a worker's pool size and context must be positive integers, got {counts}")
        if calibration is not None and not (isinstance(calibration, list)
                                            and all(isinstance(t, int) and not isinstance(t, bool) for t in calibration)):
            raise RuntimeError("a worker's calibration must be a list of token ids")
        return cls(ModelPlan.from_json(value["plan"]), value["num_blocks"], value["max_model_len"],
                   None if calibration is None else tuple(calibration))


def _worker_main(rank: int, size: int, port: int, spec: WorkerSpec, errors: Connection, parent_pid: int,
                 environment: dict[str, str]) -> None:
    watch_parent(parent_pid)
    adopt_environment(environment)  # the engine's, not the fork server's (launch.rank_context)
    torch.set_num_threads(threads_per_rank(size))  # (this process is one rank: its thread count is its own)
    try:
        device = f"cuda:{rank}" if spec.device == "cuda" else spec.device
        tp = init_tensor_parallel(rank, size, device, "127.0.0.1", port, timeout_s=spec.timeout_s,
                                  external_store=True)
        ShardWorker(tp, spec, device).run()
        tp.close()  # stopped politely: leave with rank 0, which shuts its groups down too
    except BaseException:  # reported to rank 0, which raises it when the group fails
        errors.send(traceback.format_exc())


class ShardWorker:
    """One worker rank's life (module docstring): its shard loaded, then a `Worker` set up as rank 0 says and run
    over the steps rank 0 sends."""

    def __init__(self, tp: TensorParallelGroup, spec: WorkerSpec, device: str) -> None:
        from ..model.loader import load_model_weights
        from ..worker.step_channel import StepChannel

        self.tp = tp
        self.model = load_model_weights(spec.source, device=device, dtype=spec.dtype, quantization=spec.quantization,
                                        group_size=spec.group_size, tensor_parallel=tp)
        self.channel = StepChannel(tp, "cpu" if torch.device(device).type == "cpu" else device)

    def run(self) -> None:
        from ..worker.step_channel import StepMessage
        from ..worker.worker import Worker

        setup = RankSetup.from_json(self.channel.receive())
        worker = Worker(self.model, setup.plan)
        worker.load_model()
        worker.initialize_cache(setup.num_blocks, None if setup.kv_calibration is None else list(setup.kv_calibration))
        worker.init_runner()
        # As rank 0 does it, at the same point: a warm-up's collectives meet, whenever the ranks' compilers finish.
        worker.compile_or_warm_up(setup.max_model_len, 1, patience=self.tp.patient())
        while (message := self.channel.receive()) is not None:
            assert isinstance(message, StepMessage)
            worker.execute_remote(message)
        worker.shutdown()


@dataclass(frozen=True)
class ExitedWorker:
    """A worker process after `ShardWorkers.close` reaped it: what is left to know of it."""

    name: str
    pid: int
    exitcode: int | None

    def is_alive(self) -> bool:
        return False


class ShardWorkers:
    """Rank 0's handle on ranks 1 .. size - 1 (module docstring)."""

    def __init__(self, tp: TensorParallelGroup, processes: list[Any], errors: list[Connection], device: str,
                 store: Any = None) -> None:
        from ..worker.step_channel import StepChannel

        self.tp = tp
        self.processes = processes
        self.errors = errors  # one pipe's reading end per worker: a failing worker sends its traceback there
        self.store = store  # the rendezvous rank 0 opened: it lives as long as the group
        on_gpu = torch.device(device).type == "cuda"
        if on_gpu:
            torch.cuda.set_device(0)  # rank 0's GPU, on the thread that will run the steps
        self.channel = StepChannel(tp, "cuda:0" if on_gpu else "cpu")
        self.closed = False
        self.failed = False  # set by the engine after a failed step: the ranks are out of step
        # On the CPU the ranks share this host's cores: rank 0 takes its share too while they compute together
        # (with all its threads it measured 344 ms a step of the bundled model at 3 ranks on 2 cores, with one
        # 203 ms). The engine applies it around its steps (launch.torch_threads), not to the whole process.
        self.num_threads = threads_per_rank(tp.size) if not on_gpu else None

    @classmethod
    def start(cls, spec: WorkerSpec, size: int) -> "ShardWorkers":
        """Start the workers and join them in a new process group as rank 0 (blocks until all joined)."""
        if size < 2:
            raise ValueError(f"workers are for tensor_parallel_size >= 2, not {size}")
        if spec.device == "cuda" and torch.cuda.device_count() < size:
            raise ValueError(f"tensor_parallel_size={size} needs {size} GPUs (rank r on cuda:r); "
                             f"{torch.cuda.device_count()} are visible")
        context = rank_context(spec.device)
        pipes = [context.Pipe(duplex=False) for _ in range(1, size)]  # (reading end, writing end) per worker
        errors = [reader for reader, _ in pipes]
        store = open_store(size)  # on a port the kernel picked: no other process can take it meanwhile
        processes = [context.Process(target=_worker_main, args=(rank, size, store.port, spec, writer, os.getpid(),
                                                                rank_environment()),
                                     daemon=True, name=f"llm_runtime-tp-rank{rank}")
                     for rank, (_, writer) in enumerate(pipes, start=1)]
        for process, (_, writer) in zip(processes, pipes):
            process.start()
            writer.close()  # the worker holds its own copy
        device = "cuda:0" if spec.device == "cuda" else spec.device
        joined: list[TensorParallelGroup] = []
        failed: list[BaseException] = []

        def join() -> None:
            try:
                joined.append(init_tensor_parallel(0, size, device, "127.0.0.1", store.port, timeout_s=spec.timeout_s,
                                                   external_store=True))
            except BaseException as error:
                failed.append(error)

        joining = threading.Thread(target=join, daemon=True)
        joining.start()
        try:
            while joining.is_alive():  # the rendezvous blocks: watch the workers meanwhile
                joining.join(timeout=0.2)
                dead = [p for p in processes if not p.is_alive()]
                if dead and joining.is_alive():
                    handle = cls.__new__(cls)
                    handle.processes, handle.errors = processes, errors
                    raise RuntimeError(handle.check() or f"{dead[0].name} exited before the group formed")
            if failed:
                raise failed[0]
        except BaseException:
            for process in processes:
                process.kill()
                process.join()
                process.close()
            for reader in errors:
                reader.close()
            raise
        return cls(joined[0], processes, errors, spec.device, store)

    def configure(self, setup: RankSetup) -> None:
        """Every worker's plan and pool (once, after rank 0 sized its own)."""
        with self.tp.patient():  # a worker still loading its shard receives it when it is done
            self.channel.send_json(setup.to_json())

    def check(self, grace_s: float = 0.0) -> str | None:
        """None while every worker lives; else what happened to the first that did not. `grace_s`: how long to keep
        looking (after a collective failed, the rank that broke it is dead, but a rank forked from a fork server is
        reported dead by that server, a moment after its sockets closed)."""
        deadline = time.monotonic() + grace_s
        while True:
            for rank, process in enumerate(self.processes, start=1):
                if not process.is_alive():
                    reported = self._reported(rank)
                    return (f"tensor-parallel worker {process.name} exited (code {process.exitcode})"
                            + (f":\nrank {rank}: {reported}" if reported else ""))
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    def _reported(self, rank: int) -> str:
        """The traceback worker `rank` sent before it ended, if it sent one."""
        reader = self.errors[rank - 1]
        try:
            return str(reader.recv()) if reader.poll() else ""
        except (EOFError, OSError):  # it ended without a word, or its pipe is closed already
            return ""

    def close(self) -> None:
        """Stop the workers (politely where the group still works), shut the groups down and reap the workers;
        none is left running, and no thread or socket of the groups either."""
        if self.closed:
            return
        self.closed = True
        if self.check() is None and not self.failed:
            try:
                self.channel.send_stop()
                self.tp.close(timeout_s=10.0)  # the workers leave too; past the deadline it tears down alone
            except Exception:  # a broken group: the workers are killed below
                self.failed = True
        if self.failed or self.check() is not None:
            self.tp.abort()  # nothing may wait on ranks that are gone or out of step
        for process in self.processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()
        # What is left to know of them, and their handles' pipes closed (an engine kept after its shutdown holds
        # no file of its workers).
        reaped = [ExitedWorker(p.name, p.pid, p.exitcode) for p in self.processes]
        for process in self.processes:
            process.close()
        self.processes = reaped
        for reader in self.errors:
            reader.close()
        self.store = None


def start_shard_workers(source: str | Path | None, size: int, *, device: str | torch.device = "auto",
                        dtype: str | torch.dtype = "auto", quantization: str | None = None,
                        group_size: int | None = None, timeout_s: float = 30.0) -> ShardWorkers:
    """Ranks 1 .. size - 1 for a model `load_model(source, ...)` loads (rank 0 then loads its own shard with
    `tensor_parallel=workers.tp`). Refuses, before starting anything, a model whose shape does not split."""
    from ..device import resolve_device, resolve_dtype
    from ..model.loader import read_model_config, resolve_model_folder
    from ..distributed.sharding import tensor_parallel_unsupported_reason

    resolved = resolve_device(device)
    if resolved.type == "cuda" and resolved.index not in (None, 0):
        raise ValueError(f"tensor parallelism puts rank r on cuda:r, so rank 0 on cuda:0, not {resolved}")
    reason = tensor_parallel_unsupported_reason(read_model_config(resolve_model_folder(source)), size)
    if reason is not None:
        raise ValueError(reason)
    dtype_name = str(resolve_dtype(dtype, resolved) if quantization is None or dtype != "auto" else torch.bfloat16)
    spec = WorkerSpec(None if source is None else str(source), resolved.type, dtype_name.removeprefix("torch."),
                      quantization, group_size, timeout_s)
    return ShardWorkers.start(spec, size)
