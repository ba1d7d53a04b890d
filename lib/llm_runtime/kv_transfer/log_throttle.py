"""Warnings that a peer can cause at any rate, logged at most once every few seconds.

A hostile or broken producer can send thousands of refused messages a second; a line for each would turn its flood
into a flood of logs (disk, and the time to write them). `LogThrottle` logs the first warning, then at most one
every `every_s`, saying how many it left out since the last; counters (the receiver's `num_refused`, the agent's
`refused_transfers`) still count every one."""

from __future__ import annotations

import logging
import threading
import time


class LogThrottle:
    """`warning(...)` as logging's, at most once every `every_s` seconds (thread-safe)."""

    def __init__(self, logger: logging.Logger, every_s: float = 10.0) -> None:
        self.logger, self.every_s = logger, every_s
        self._logged_at = -every_s  # time.monotonic() of the last warning logged
        self._left_out = 0  # warnings since then that were not logged
        self._lock = threading.Lock()

    def warning(self, message: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._logged_at < self.every_s:
                self._left_out += 1
                return
            left_out, self._left_out, self._logged_at = self._left_out, 0, now
        if left_out:
            message += f" ({left_out} more like it since the last one logged)"
        self.logger.warning(message, *args)
