"""The errors a caller can act on, typed, so every layer (engine, async engine, HTTP) maps them the same way."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine refuses before anything runs; `param` names the field at fault (HTTP 400)."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param


class EngineBusyError(RuntimeError):
    """Too many requests are waiting: try again later (HTTP 503)."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an error outside any one request; nothing more can run (HTTP 503)."""
