"""Freed host memory kept for reuse: on the CPU, what CUDA's caching allocator does on a GPU.

Every operation of an eager forward pass allocates its output. On a GPU, PyTorch's caching allocator
keeps freed blocks and hands them out again, so a step's hundreds of temporaries cost no system call.
On the CPU, PyTorch asks glibc's `malloc`, which serves a large block (above its mmap threshold, 128
KiB at first) with a fresh `mmap` and gives it back to the kernel with `munmap` when freed. The next
step's block of the same size is a fresh mapping again, and the kernel zero-fills every 4 KiB page of
it on first touch: a page fault per page. A 2048-token step's float32 activations (2048 x 576 x 4 = 4.7
MB) are 1150 pages per temporary; on this package's CI machine an RMSNorm over them took 3.5 ms fresh
and 0.23 ms in reused memory.

`keep_freed_host_memory()` tells glibc to serve blocks up to 32 MiB from its heap and not to trim
freed heap back to the kernel, so the step's memory is faulted in once and reused after. The price is
that the process keeps its peak heap (the step's temporaries, tens of MB) for its lifetime, as a GPU
engine keeps its cached blocks. It is a setting of the process's allocator, like
`torch.set_num_threads`; an engine on the CPU makes it when it is built.

A second kind of memory a CPU engine keeps: oneDNN, which runs PyTorch's bfloat16 matrix products on the
CPU, compiles a primitive per shape and caches it, and so does ideep, PyTorch's wrapper around it: up to
1,024 shapes each by default. A step's shapes follow its number of tokens, which changes all the time
under load, so a server in bfloat16 fills both caches over minutes: measured here, a product with the
bundled 4-bit model's head at 600 random row counts grew malloc's memory in use from 223 to 371 MB, and
stayed at 227 MB with both caches at 8 shapes. `bound_shape_caches` caps them for a long-lived process
(`serve` does); both read their variable once, at their first use, so it must run before any oneDNN work.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import MutableMapping

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MAX_HEAP_BLOCK = 32 << 20  # glibc's largest allowed mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
NEVER_TRIM = 2**31 - 1  # the largest value mallopt takes (an int): 2 GiB of free heap before trimming


def keep_freed_host_memory(max_block_bytes: int = MAX_HEAP_BLOCK) -> bool:
    """Serve allocations up to `max_block_bytes` from malloc's heap and keep freed heap for reuse.
    True when glibc took both settings; False elsewhere (macOS, musl: nothing changes)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    threshold = min(max_block_bytes, MAX_HEAP_BLOCK)
    ok = mallopt(M_MMAP_THRESHOLD, threshold) == 1 and mallopt(M_TRIM_THRESHOLD, NEVER_TRIM) == 1
    if not ok:
        logger.info("malloc did not take the settings that keep freed host memory")
    return ok


# oneDNN's primitive cache and ideep's cache of oneDNN primitives: the shapes each keeps (1,024 by default).
SHAPE_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_shape_caches(environ: MutableMapping[str, str], capacity: int) -> dict[str, str]:
    """Cap oneDNN's and ideep's caches of compiled primitives at `capacity` shapes each, where `environ` (the
    process's environment, given by the command line) does not set them already; returns what they are."""
    if capacity < 1:
        raise ValueError(f"a shape cache's capacity must be >= 1, got {capacity}")
    return {name: environ.setdefault(name, str(capacity)) for name in SHAPE_CACHE_VARIABLES}
