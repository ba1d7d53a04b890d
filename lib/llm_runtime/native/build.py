"""Building and loading the package's C kernels (attention's `cpu` backend, the quantized products).

PyTorch has no CPU operator for a few things this engine needs (attention over a paged pool, an 8-bit
weight table's product), so the package brings them as plain C files with OpenMP. They include no
PyTorch header, so the system C compiler builds one in about a second the first time a process needs
it; the shared library is cached under $XDG_CACHE_HOME/llm_runtime/kernels, keyed by the sources, the
compiler flags and the machine, and loaded with ctypes. OpenMP there is the same libgomp PyTorch already
loaded, so the kernels' threads are PyTorch's.

Each caller gives its flag sets, tried in order (the fastest build the compiler accepts first); when no
compiler is found or every flag set fails, `build_library` raises `KernelUnavailable` with the
compiler's message, and the caller falls back to PyTorch operators.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from ..model.bundled import default_cache_dir

INCLUDE_DIR = Path(__file__).parent  # headers every kernel may include (number_formats.h)
# -march=native lets the compiler use the machine's widest vectors (AVX-512 here); -fopenmp uses the
# libgomp PyTorch already loaded, so both share threads.
FLAG_SETS = (
    ("-O3", "-march=native", "-fopenmp"),
    ("-O3", "-fopenmp"),
    ("-O3",),
)


class KernelUnavailable(RuntimeError):
    """A C kernel cannot be built or loaded here (no compiler, or it rejected every flag set)."""


def _cache_key(compiler: str, flags: tuple[str, ...], sources: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in sources:
        digest.update(path.read_bytes())
    # -march=native builds for this CPU; the machine's identity keeps another machine's build apart.
    digest.update(" ".join((compiler, *flags, platform.machine(), platform.node(), torch.__version__)).encode())
    return digest.hexdigest()[:16]


def _compile(compiler: str, flags: tuple[str, ...], source_dir: Path, compiled: tuple[str, ...],
             target: Path) -> str | None:
    """Build the library at `target` (atomically); None on success, else the compiler's message."""
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, scratch = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(handle)
    command = [compiler, *flags, "-fPIC", "-shared", "-I", str(source_dir), "-I", str(INCLUDE_DIR),
               *(str(source_dir / name) for name in compiled), "-o", scratch]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as error:
        Path(scratch).unlink(missing_ok=True)
        return str(error)
    if result.returncode != 0:
        Path(scratch).unlink(missing_ok=True)
        return result.stderr.strip()[-500:] or f"{compiler} exited with {result.returncode}"
    os.replace(scratch, target)  # another process may have built the same file: either copy is right
    return None


def build_library(name: str, source_dir: Path, sources: tuple[str, ...], compiled: tuple[str, ...],
                  flag_sets: tuple[tuple[str, ...], ...] = FLAG_SETS) -> ctypes.CDLL:
    """The library `name` built from `compiled` (C files in `source_dir`; `sources` are every file the
    build reads there, hashed into the cache key with the shared headers), from the disk cache when built
    before. Raises KernelUnavailable when no flag set builds it."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        raise KernelUnavailable("no C compiler found (set CC, or install gcc or clang)")
    hashed = [source_dir / file for file in sources] + sorted(INCLUDE_DIR.glob("*.h"))
    folder = default_cache_dir() / "kernels"
    errors = []
    for flags in flag_sets:
        target = folder / f"{name}-{_cache_key(compiler, flags, hashed)}.so"
        error = None if target.is_file() else _compile(compiler, flags, source_dir, compiled, target)
        if error is None:
            return ctypes.CDLL(str(target))
        errors.append(f"{compiler} {' '.join(flags)}: {error}")
    raise KernelUnavailable(f"the C kernel {name} did not compile:\n" + "\n".join(errors))
