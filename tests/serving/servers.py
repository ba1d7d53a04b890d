"""Start an app under uvicorn on a free loopback port, in a thread, for as long as a test needs it."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running(app) -> Iterator[str]:
    """Serve `app` on 127.0.0.1; yields its base URL; stops the server (and the engine loop) on exit."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True, name="uvicorn")
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        assert time.time() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        assert not thread.is_alive(), "the server did not stop"


def wait_idle(engine, timeout: float = 30) -> None:
    """Until the engine has no request left (aborts are applied between steps)."""
    deadline = time.time() + timeout
    while engine.has_unfinished_requests() or engine.scheduler.has_unfinished():
        assert time.time() < deadline, "requests still running"
        time.sleep(0.05)
