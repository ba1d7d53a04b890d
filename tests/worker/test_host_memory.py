"""Freed host memory kept for reuse: glibc takes the settings; elsewhere nothing changes and nothing fails."""

from __future__ import annotations

import ctypes.util
import platform

import pytest

from llm_runtime.worker.host_memory import keep_freed_host_memory


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_glibc_takes_the_settings_and_taking_them_twice_is_harmless() -> None:
    assert ctypes.util.find_library("c")
    assert keep_freed_host_memory() is True
    assert keep_freed_host_memory() is True


def test_without_a_c_library_nothing_happens(monkeypatch) -> None:
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: "/nonexistent/libc.so")
    assert keep_freed_host_memory() is False


def test_bounding_the_shape_caches_keeps_what_the_environment_says() -> None:
    from llm_runtime.worker.host_memory import SHAPE_CACHE_VARIABLES, bound_shape_caches

    environ = {"LRU_CACHE_CAPACITY": "5"}
    assert bound_shape_caches(environ, 64) == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LRU_CACHE_CAPACITY": "5"}
    assert set(environ) == set(SHAPE_CACHE_VARIABLES)
    with pytest.raises(ValueError, match="capacity"):
        bound_shape_caches({}, 0)


_GROWTH = """
import ctypes, ctypes.util, os, random, sys, torch
from llm_runtime.worker.host_memory import bound_shape_caches, keep_freed_host_memory
if sys.argv[1] == "bounded":
    bound_shape_caches(os.environ, 8)
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                              "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(ctypes.util.find_library("c")); libc.mallinfo2.restype = MallInfo2
keep_freed_host_memory()
weight = torch.randn(2048, 576, dtype=torch.bfloat16)
rng = random.Random(0)
x = torch.randn(300, 576, dtype=torch.bfloat16)
x[:5] @ weight.t()
before = libc.mallinfo2().uordblks
for _ in range(300):
    x[: rng.randint(5, 300)] @ weight.t()
print((libc.mallinfo2().uordblks - before) / 2**20)
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallinfo2")
def test_products_of_ever_new_shapes_keep_no_more_memory_once_the_caches_are_bounded() -> None:
    """A bfloat16 product at 300 random row counts, in a fresh process: with oneDNN's and ideep's caches at their
    default 1,024 shapes malloc's memory in use grows with every new shape; bounded at 8, it stays put."""
    import os
    import subprocess
    import sys

    from llm_runtime.worker.host_memory import SHAPE_CACHE_VARIABLES

    def growth(mode: str) -> float:
        result = subprocess.run([sys.executable, "-c", _GROWTH, mode], capture_output=True, text=True, timeout=300,
                                env={k: v for k, v in os.environ.items() if k not in SHAPE_CACHE_VARIABLES})
        assert result.returncode == 0, result.stderr
        return float(result.stdout.split()[-1])

    bounded = growth("bounded")
    assert bounded < 8, f"{bounded:.1f} MB kept with both caches at 8 shapes"
    unbounded = growth("default")
    if unbounded < 16:
        pytest.skip(f"this CPU's bfloat16 products keep little per shape ({unbounded:.1f} MB): nothing to bound")
