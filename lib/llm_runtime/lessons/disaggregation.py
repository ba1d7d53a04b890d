"""Disaggregated prefill and decode by hand (lesson 18): servers as processes on chosen cores, a client that times
every streamed token, a server's counters, and the arithmetic of a prompt's shipped KV bytes.

    with ServerProcess.serve(["--enforce-eager"], cores=[0], threads=1) as server:   # a server on core 0
        timings = stream_requests(server.url, bodies, arrivals)                     # TTFT, ITL per request
        counters(server.url)["prefix_cache_hits_total"]
    shipped_kv_bytes(prompt_len=2000, block_size=16, num_layers=30, num_kv_heads=3, head_dim=64, bytes_per_value=4)

A notebook's kernel runs its own event loop, so `stream_requests` runs its asyncio client on a thread of its own.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from ..bench.metrics import RequestTiming
from ..distributed.launch import free_port


_LIVE: set["ServerProcess"] = set()  # started and not yet stopped or killed: killed when the interpreter exits


@atexit.register
def _kill_the_rest() -> None:
    for server in list(_LIVE):
        server.kill()


@dataclass(eq=False)
class ServerProcess:
    """`python -m llm_runtime serve` or `router` as a process of its own, pinned to `cores` with `threads` threads
    (where the OS lets a process choose its cores: Linux), killed when the notebook's kernel exits."""

    command: list[str]
    url: str
    process: subprocess.Popen
    log: Path  # its stderr, which uvicorn writes a line to per request (a pipe nobody reads would fill and block)

    @classmethod
    def start(cls, kind: str, arguments: Sequence[str] = (), *, cores: Sequence[int] | None = None,
              threads: int | None = None, wait: bool = True, timeout_s: float = 180.0) -> "ServerProcess":
        """Start `python -m llm_runtime <kind> <arguments> --port P`; with `wait`, until its /health answers 200
        (start several with wait=False, then `wait_ready` each: they load at the same time)."""
        if kind not in ("serve", "router"):
            raise ValueError(f"kind must be 'serve' or 'router', got {kind!r}")
        port = free_port()
        command = [sys.executable, "-m", "llm_runtime", kind, *map(str, arguments), "--port", str(port)]
        environment = dict(os.environ)
        if threads is not None:  # PyTorch's intra-op pool takes its size from here when the process starts
            environment["OMP_NUM_THREADS"] = environment["MKL_NUM_THREADS"] = str(threads)
        descriptor, name = tempfile.mkstemp(prefix=f"llm_runtime-{kind}-", suffix=".log")
        with os.fdopen(descriptor, "w") as stderr:
            process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, env=environment)
        if cores is not None and hasattr(os, "sched_setaffinity"):
            # Set from here, on the child, before it imports anything that starts threads (its threads inherit it):
            # a preexec_fn would run between fork and exec, unsafe in a process with threads (a notebook kernel).
            with contextlib.suppress(ProcessLookupError):  # it exited already: wait_ready says why
                os.sched_setaffinity(process.pid, set(cores) & os.sched_getaffinity(0))
        server = cls(command, f"http://127.0.0.1:{port}", process, Path(name))
        _LIVE.add(server)
        if wait:
            server.wait_ready(timeout_s)
        return server

    def wait_ready(self, timeout_s: float = 180.0) -> "ServerProcess":
        """Until /health answers 200; RuntimeError (with the end of its log) if it exits or takes too long."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                message = f"{self.kind} exited with code {self.process.returncode}: {self.log_tail()}"
                self._forget()
                raise RuntimeError(message)
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                message = f"{self.kind} did not answer /health within {timeout_s:.0f} s: {self.log_tail()}"
                self.kill()
                raise RuntimeError(message)
            time.sleep(0.2)

    @classmethod
    def serve(cls, arguments: Sequence[str] = (), **options: Any) -> "ServerProcess":
        return cls.start("serve", arguments, **options)

    @classmethod
    def router(cls, arguments: Sequence[str] = (), **options: Any) -> "ServerProcess":
        return cls.start("router", arguments, **options)

    @property
    def kind(self) -> str:
        """"serve" or "router"."""
        return self.command[3]

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_tail(self, lines: int = 20) -> str:
        """The end of its stderr (its log is deleted when it stops)."""
        if not self.log.exists():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def kill(self) -> None:
        """SIGKILL, without warning (as a crash would end it)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()
        self._forget()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._forget()

    def _forget(self) -> None:
        _LIVE.discard(self)
        self.log.unlink(missing_ok=True)

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def counters(url: str) -> dict[str, float]:
    """A server's unlabelled /metrics samples, by name without the `llm_runtime_` prefix."""
    values = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("llm_runtime_") and "{" not in line:
            name, value = line.split()[:2]
            values[name.removeprefix("llm_runtime_")] = float(value)
    return values


@dataclass
class TimedRequest:
    """One streamed request as a client saw it: its text, status and, if it produced tokens, its timing."""

    text: str
    status: int
    timing: RequestTiming | None
    error: str | None = None
    chunks: list[float] = field(default_factory=list)  # perf_counter time of every chunk that carried text


async def _send_one(client: httpx.AsyncClient, url: str, path: str, body: dict[str, Any], delay_s: float,
                      origin: float) -> TimedRequest:
    await asyncio.sleep(max(0.0, origin + delay_s - time.perf_counter()))
    start = time.perf_counter()
    if body.get("stream") is False:  # one answer, timed as a whole
        answer = await client.post(f"{url}{path}", json=body)
        if answer.status_code != 200:
            return TimedRequest("", answer.status_code, None, answer.text)
        choice = answer.json()["choices"][0]
        return TimedRequest(choice["message"]["content"] if "message" in choice else choice["text"], 200, None)
    texts, times, prompt_tokens = [], [], 0
    async with client.stream("POST", f"{url}{path}", json={**body, "stream": True,
                                                           "stream_options": {"include_usage": True}}) as answer:
        if answer.status_code != 200:
            return TimedRequest("", answer.status_code, None, (await answer.aread()).decode(errors="replace"))
        async for line in answer.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return TimedRequest("".join(texts), 200, None, event["error"]["message"])
            if event.get("usage"):
                prompt_tokens = event["usage"]["prompt_tokens"]
            for choice in event.get("choices", []):  # one chunk per token (no speculation), as vLLM's bench counts
                delta = choice.get("delta")
                if delta is not None and delta.get("role"):
                    continue  # a chat stream's first chunk names the role and carries no token
                texts.append((delta.get("content") if delta is not None else choice.get("text")) or "")
                times.append(time.perf_counter())
    timing = RequestTiming(start, tuple(times), prompt_tokens) if times else None
    return TimedRequest("".join(texts), 200, timing, None, times)


def stream_requests(url: str, bodies: Sequence[dict[str, Any]], delays_s: Sequence[float] | None = None,
                    path: str = "/v1/completions", timeout_s: float = 600.0) -> list[TimedRequest]:
    """Send each body `delays_s[i]` seconds after the first, all concurrently, streamed unless the body says
    `"stream": false`; each request's text and (streamed) the time of each of its tokens. Runs its event loop on a
    thread, so it works inside a notebook too."""
    delays = list(delays_s) if delays_s is not None else [0.0] * len(bodies)
    if len(delays) != len(bodies):
        raise ValueError(f"{len(bodies)} bodies but {len(delays)} delays")

    async def run() -> list[TimedRequest]:
        limits = httpx.Limits(max_connections=len(bodies) + 1)
        async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
            origin = time.perf_counter()
            return list(await asyncio.gather(*(_send_one(client, url, path, body, delay, origin)
                                               for body, delay in zip(bodies, delays))))

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, run()).result()


def shipped_kv_bytes(prompt_len: int, block_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                     bytes_per_value: float) -> int:
    """The bytes of keys and values a producer ships for a prompt of `prompt_len` tokens: the whole blocks before
    its last token (the consumer computes the last token itself, to sample from its logits), every layer, a key
    and a value of head_dim per KV head per token. (On the wire an int8 pool adds nothing per block: its scales
    are the consumer's own, checked by a digest.)"""
    if prompt_len < 1 or block_size < 1:
        raise ValueError("prompt_len and block_size must be >= 1")
    tokens = (prompt_len - 1) // block_size * block_size
    return int(tokens * 2 * num_layers * num_kv_heads * head_dim * bytes_per_value)
