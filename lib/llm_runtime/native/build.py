"""Building and loading the package's C kernels (attention's `cpu` backend, the quantized products).

PyTorch has no CPU operator for a few things this engine needs (attention over a paged pool, an 8-bit
weight table's product), so the package brings them as plain C files with OpenMP. They include no
PyTorch header, so the system C compiler builds one in about a second the first time a process needs
it; the shared library is cached under $XDG_CACHE_HOME/llm_runtime/kernels and loaded with ctypes. OpenMP
there is the same libgomp PyTorch already loaded, so the kernels' threads are PyTorch's.

The cache is keyed on what the machine code depends on (`_cache_key`): the sources, each compiler and its
version, the flags, and the instruction set they select, as the compiler resolves them here (`-march=native`
becomes a named CPU and its list of extensions, `_compiler_target`), plus, for a build for the native CPU,
the CPU's own flags (`_cpu_flags`). Not the host's name: a cache folder copied to (or shared with) a machine
whose CPU lacks an instruction the build used must build again, not load code that dies of SIGILL, and the
same CPU under another name may reuse it.

Each caller gives its flag sets, tried in order (the fastest build the compiler accepts first; `-march=native`
as device.cpu_target says, so `LLM_RUNTIME_CPU_ISA=avx2` builds what a CPU without AVX-512 would); when no
compiler is found or every flag set fails, `build_library` raises `KernelUnavailable` with the
compiler's message, and the caller falls back to PyTorch operators.

`build_torch_library` builds the one C++ file that does include PyTorch's headers (csrc/operators.cpp:
operators registered with the dispatcher, loaded with `torch.ops.load_library`), linked with C kernels
compiled beside it: about 10 s the first time, cached the same way.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from ..cache_dir import default_cache_dir

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


def _cache_key(compilers: tuple[str, ...], flags: tuple[str, ...], sources: list[Path],
               extra: tuple[str, ...] = ()) -> str:
    """The name of a build: a digest of everything its machine code depends on (the module docstring).
    `flags` is the flag set (what selects the target); `extra`, what else the build was given (-D flags, the
    torch version of a library built against torch's headers)."""
    digest = hashlib.sha256()
    for path in sources:
        digest.update(path.read_bytes())
    parts = [platform.machine(), *flags, *extra]
    for compiler in compilers:
        parts += [compiler, _compiler_version(compiler), _compiler_target(compiler, flags)]
    if any(flag.endswith("=native") for flag in flags):  # -march=, -mcpu=, -mtune=native: this CPU's code
        parts.append(_cpu_flags())
    digest.update("\0".join(parts).encode())
    return digest.hexdigest()[:16]


@functools.cache
def _compiler_version(compiler: str) -> str:
    """The compiler's `--version` text ("" if it gives none): another version may generate other code."""
    try:
        result = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return result.stdout.strip() if result.returncode == 0 else ""


# Options of the compiler proper (gcc's cc1, clang -cc1) that name the target, and those whose value follows.
_TARGET_OPTIONS = ("--param", "-target-cpu", "-target-feature", "-triple", "-tune-cpu")


@functools.cache
def _compiler_target(compiler: str, flags: tuple[str, ...]) -> str:
    """The target `flags` select, as `compiler` resolves it on this machine ("" if it will not say): its
    driver's `-###` shows the command it would run, where gcc has expanded -march=native into the CPU's name
    and every -m<extension> / -mno-<extension>, and clang into -target-cpu and -target-feature +/-<extension>.
    Only the target's options are kept: the rest names temporary files."""
    command = [compiler, *flags, "-###", "-x", "c", "-c", os.devnull, "-o", os.devnull]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    if result.returncode != 0:
        return ""
    kept: list[str] = []
    for line in result.stderr.splitlines():
        if not line.startswith(" "):  # the commands are indented; the rest is the driver talking
            continue
        try:
            words = shlex.split(line)
        except ValueError:
            continue
        for word, following in zip(words, [*words[1:], ""]):
            if word in _TARGET_OPTIONS:
                kept += [word, following]
            elif word.startswith("-m"):
                kept.append(word)
    return " ".join(kept)


@functools.cache
def _cpu_flags() -> str:
    """This CPU's flags as the kernel lists them ("flags" on x86, "Features" on Arm; "" where there is no
    /proc/cpuinfo): its instruction-set extensions among others. All of them, sorted: a flag that does not
    change the code costs at most one build more."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return ""
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            return " ".join(sorted(set(value.split())))
    return ""


def _run(command: list[str]) -> str | None:
    """None when `command` (a compiler call) succeeds, else its message."""
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as error:
        return str(error)
    if result.returncode != 0:
        return result.stderr.strip()[-500:] or f"{command[0]} exited with {result.returncode}"
    return None


def _build(target: Path, commands: Callable[[str, str], list[list[str]]]) -> str | None:
    """Build the library at `target` (atomically) by `commands(scratch_dir, output)`, run in order; None on
    success, else the failing compiler's message."""
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, scratch = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(handle)
    with tempfile.TemporaryDirectory(dir=target.parent) as objects:
        for command in commands(objects, scratch):
            error = _run(command)
            if error is not None:
                Path(scratch).unlink(missing_ok=True)
                return error
    os.replace(scratch, target)  # another process may have built the same file: either copy is right
    return None


def _compile(compiler: str, flags: tuple[str, ...], source_dir: Path, compiled: tuple[str, ...],
             target: Path) -> str | None:
    """Build the library at `target`; None on success, else the compiler's message."""
    return _build(target, lambda _, output: [[compiler, *flags, "-fPIC", "-shared", "-I", str(source_dir), "-I",
                                             str(INCLUDE_DIR), *(str(source_dir / name) for name in compiled),
                                             "-o", output]])


def _compiler(variable: str, *names: str) -> str | None:
    return os.environ.get(variable) or next(filter(None, map(shutil.which, names)), None)


def _targeted(flag_sets: tuple[tuple[str, ...], ...]) -> tuple[tuple[str, ...], ...]:
    """The flag sets with `-march=native` as the device says (device.cpu_target: this CPU, or one it plays)."""
    from ..device import cpu_target

    target = cpu_target()
    return tuple(tuple(f"-march={target}" if flag == "-march=native" else flag for flag in flags)
                 for flags in flag_sets)


def build_library(name: str, source_dir: Path, sources: tuple[str, ...], compiled: tuple[str, ...],
                  flag_sets: tuple[tuple[str, ...], ...] = FLAG_SETS) -> ctypes.CDLL:
    """The library `name` built from `compiled` (C files in `source_dir`; `sources` are every file the
    build reads there, hashed into the cache key with the shared headers), from the disk cache when built
    before. Raises KernelUnavailable when no flag set builds it."""
    compiler = _compiler("CC", "cc", "gcc", "clang")
    if compiler is None:
        raise KernelUnavailable("no C compiler found (set CC, or install gcc or clang)")
    hashed = [source_dir / file for file in sources] + sorted(INCLUDE_DIR.glob("*.h"))
    folder = default_cache_dir() / "kernels"
    errors = []
    for flags in _targeted(flag_sets):
        target = folder / f"{name}-{_cache_key((compiler,), flags, hashed)}.so"
        error = None if target.is_file() else _compile(compiler, flags, source_dir, compiled, target)
        if error is None:
            return ctypes.CDLL(str(target))
        errors.append(f"{compiler} {' '.join(flags)}: {error}")
    raise KernelUnavailable(f"the C kernel {name} did not compile:\n" + "\n".join(errors))


def build_torch_library(name: str, source: Path, c_sources: tuple[Path, ...], defines: dict[str, int],
                        flag_sets: tuple[tuple[str, ...], ...] = FLAG_SETS) -> Path:
    """The path of the library `name` (for `torch.ops.load_library`): the C++ file `source`, which includes
    PyTorch's headers and registers operators, linked with the C files `c_sources` (each compiled by the C
    compiler with its own folder and INCLUDE_DIR on the include path), with `defines` as -D flags; from the
    disk cache when built before. Raises KernelUnavailable when no flag set builds it."""
    c_compiler, cxx_compiler = _compiler("CC", "cc", "gcc", "clang"), _compiler("CXX", "c++", "g++", "clang++")
    if c_compiler is None or cxx_compiler is None:
        raise KernelUnavailable("no C and C++ compilers found (set CC and CXX, or install gcc and g++)")
    torch_dir = Path(torch.__file__).parent
    definitions = [f"-D{key}={value}" for key, value in sorted(defines.items())]
    # PyTorch's build chose the C++ standard library's ABI; a library passing it std::strings must match.
    definitions.append(f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}")
    headers = sorted({header for path in c_sources for header in path.parent.glob("*.h")}
                     | set(INCLUDE_DIR.glob("*.h")))
    folder = default_cache_dir() / "kernels"
    errors = []
    for flags in _targeted(flag_sets):
        def commands(objects: str, output: str) -> list[list[str]]:
            compiled = [[c_compiler, *flags, "-fPIC", "-c", "-I", str(path.parent), "-I", str(INCLUDE_DIR), str(path),
                         "-o", str(Path(objects) / f"{path.stem}.o")] for path in c_sources]
            link = [cxx_compiler, *flags, "-std=c++20", "-fPIC", "-shared", *definitions, "-I",
                    str(torch_dir / "include"), str(source), *(command[-1] for command in compiled),
                    "-L", str(torch_dir / "lib"), "-ltorch_cpu", "-lc10", "-o", output]
            return [*compiled, link]
        key = _cache_key((c_compiler, cxx_compiler), flags, [source, *c_sources, *headers],
                         (*definitions, torch.__version__))
        target = folder / f"{name}-{key}.so"
        error = None if target.is_file() else _build(target, commands)
        if error is None:
            return target
        errors.append(f"{cxx_compiler} {' '.join(flags)}: {error}")
    raise KernelUnavailable(f"the C++ operators {name} did not compile:\n" + "\n".join(errors))
