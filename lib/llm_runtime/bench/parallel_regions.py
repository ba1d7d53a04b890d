"""What a parallel region and a barrier cost on this machine (lesson 19): the step as many regions or as one.

An operator-by-operator step runs each C kernel as its own OpenMP parallel region: the pool's threads are woken,
share out the kernel's items, and the caller waits for the slowest before the next operator. The native step
(worker/native_step.py) enters one region per step and separates its stages with the barrier that ends each
`omp for`. `csrc/parallel_regions.c` times both on empty stages, so what it measures is the synchronisation alone:
`measure_sync_costs()` gives seconds per region and per barrier at torch's thread count, from which lesson 19
predicts part of the gap between the compiled and the native step before it measures them.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from ..native import KernelUnavailable, build_library

SOURCE_DIR = Path(__file__).parent / "csrc"
SOURCES = ("parallel_regions.c",)
# -O1 keeps the empty items' loop as written (-O3 may hoist or vectorise it); the cost measured is OpenMP's.
FLAG_SETS = (("-O1", "-fopenmp"),)


@dataclass(frozen=True)
class SyncCosts:
    """Seconds per stage of synchronisation, at `threads` threads."""

    threads: int
    region_s: float  # a `#pragma omp parallel for` started and ended (a kernel of the operator path)
    barrier_s: float  # an `omp for`'s closing barrier inside a running region (a stage of the native step)


@functools.cache
def load_library() -> ctypes.CDLL:
    """The two timing loops (built on first call, then cached on disk and in this process)."""
    library = build_library("parallel_regions", SOURCE_DIR, SOURCES, SOURCES, FLAG_SETS)
    for name in ("stages_as_regions", "stages_in_one_region"):
        function = getattr(library, name)
        function.restype = ctypes.c_double
        function.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
    return library


def stage_seconds(one_region: bool, stages: int = 2000, items: int | None = None, work: int = 0,
                  repeats: int = 7) -> float:
    """Seconds per stage for `stages` stages of `items` items (default: one per thread) of `work` multiply-adds
    each, run as one region with a barrier per stage (`one_region`) or as a region per stage; best of
    `repeats`, after a warm-up."""
    if stages < 1 or repeats < 1 or work < 0:
        raise ValueError("stages and repeats must be at least 1, work at least 0")
    library = load_library()
    run = library.stages_in_one_region if one_region else library.stages_as_regions
    items = torch.get_num_threads() if items is None else items
    run(stages, items, work)  # warm-up: the team of threads exists before anything is timed
    return min(run(stages, items, work) for _ in range(repeats)) / stages


def measure_sync_costs(stages: int = 2000, repeats: int = 7) -> SyncCosts:
    """A region's and a barrier's cost here, on empty stages (one item per thread), at torch's thread count."""
    return SyncCosts(torch.get_num_threads(), stage_seconds(False, stages, repeats=repeats),
                     stage_seconds(True, stages, repeats=repeats))


def sync_costs_unavailable_reason() -> str | None:
    """None when the timing loops build here; otherwise why not (no C compiler)."""
    try:
        load_library()
    except KernelUnavailable as error:
        return str(error)
    return None
