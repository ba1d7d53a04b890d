"""Freed host memory kept for reuse: glibc takes the settings; elsewhere nothing changes and nothing fails."""

from __future__ import annotations

import ctypes.util
import platform

import pytest

from llm_runtime.engine.host_memory import keep_freed_host_memory


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_glibc_takes_the_settings_and_taking_them_twice_is_harmless() -> None:
    assert ctypes.util.find_library("c")
    assert keep_freed_host_memory() is True
    assert keep_freed_host_memory() is True


def test_without_a_c_library_nothing_happens(monkeypatch) -> None:
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: "/nonexistent/libc.so")
    assert keep_freed_host_memory() is False
