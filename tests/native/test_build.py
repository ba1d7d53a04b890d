"""The kernel build cache (native/build.py) is keyed on what the compiled code depends on: the sources, the
compiler and its version, the flags and the instruction set they resolve to on this CPU; never on the host's
name. A cache copied to a machine with another CPU builds again instead of loading code that dies of SIGILL."""

from __future__ import annotations

import platform
import shutil
from pathlib import Path

import pytest

from llm_runtime.device import cpu_target
from llm_runtime.native import build

COMPILER = build._compiler("CC", "cc", "gcc", "clang")
pytestmark = pytest.mark.skipif(COMPILER is None, reason="no C compiler here")
NATIVE = ("-O1", "-march=native")


def _built(tmp_path: Path, flags: tuple[str, ...] = NATIVE) -> set[str]:
    """The library files in the cache after building a one-function library with `flags`."""
    source = tmp_path / "src"
    source.mkdir(exist_ok=True)
    (source / "one.c").write_text("int one(void) { return 1; }\n")
    library = build.build_library("one", source, ("one.c",), ("one.c",), (flags,))
    assert library.one() == 1
    return {path.name for path in (tmp_path / "cache" / "llm_runtime" / "kernels").glob("one-*.so")}


@pytest.fixture
def cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path


def test_another_host_name_with_the_same_cpu_reuses_the_build(monkeypatch: pytest.MonkeyPatch, cache: Path) -> None:
    monkeypatch.setattr(platform, "node", lambda: "host-a")
    first = _built(cache)
    monkeypatch.setattr(platform, "node", lambda: "host-b")  # the same machine under another name
    assert _built(cache) == first and len(first) == 1


@pytest.mark.skipif(cpu_target() != "native", reason="the C kernels are built for a played CPU "
                                                   "(LLM_RUNTIME_CPU_ISA), not this one's -march=native")
def test_another_cpu_builds_again(monkeypatch: pytest.MonkeyPatch, cache: Path) -> None:
    monkeypatch.setattr(build, "_cpu_flags", lambda: "fpu sse sse2 avx avx2 fma")
    (laptop,) = _built(cache)
    monkeypatch.setattr(build, "_cpu_flags", lambda: "fpu sse sse2 avx avx2 fma avx512f avx512bw avx512vl")
    server = _built(cache) - {laptop}
    assert len(server) == 1  # not the laptop's file: code for the other CPU could hold instructions this one lacks


def test_the_cpu_matters_only_to_builds_for_the_native_cpu(monkeypatch: pytest.MonkeyPatch, cache: Path) -> None:
    portable = ("-O1",)
    monkeypatch.setattr(build, "_cpu_flags", lambda: "fpu sse sse2")
    first = _built(cache, portable)
    monkeypatch.setattr(build, "_cpu_flags", lambda: "fpu sse sse2 avx512f")
    assert _built(cache, portable) == first  # the compiler's default target, the same on both


def test_another_compiler_version_builds_again(monkeypatch: pytest.MonkeyPatch, cache: Path) -> None:
    (old,) = _built(cache)
    monkeypatch.setattr(build, "_compiler_version", lambda compiler: "cc (Imaginary) 99.0")
    assert len(_built(cache) - {old}) == 1


def test_the_compiler_resolves_native_to_this_cpus_instruction_set() -> None:
    """What -march=native means here, as the compiler itself reports it: a named target with its extensions,
    each of which this CPU has (checked for the x86 extensions the kernels use, where /proc/cpuinfo says)."""
    if shutil.which(COMPILER) is None and not Path(COMPILER).is_file():
        pytest.skip(f"{COMPILER} not found")
    target = build._compiler_target(COMPILER, NATIVE)
    assert target and "native" not in target.replace("-march=native", "")
    flags = set(build._cpu_flags().split())
    if "sse2" in flags:  # x86: gcc lists -m<extension> or -mno-<extension>, clang -target-feature +/-<extension>
        for extension in ("avx2", "fma", "avx512f"):
            enabled = f"-m{extension}" in target.split() or f"+{extension}" in target.split()
            assert enabled == (extension in flags), extension
    assert build._compiler_target(COMPILER, ("-O1",)) != target  # the default target is not this CPU's


def test_playing_a_cpu_without_avx512_builds_for_it(monkeypatch: pytest.MonkeyPatch, cache: Path) -> None:
    """LLM_RUNTIME_CPU_ISA=avx2 builds the kernels as a CPU without AVX-512 would (-march=x86-64-v3), into a file
    of their own: the native step then reports itself unavailable, with its reason."""
    monkeypatch.setenv("LLM_RUNTIME_CPU_ISA", "avx2")
    assert cpu_target() == "x86-64-v3" and build._targeted(((("-O3", "-march=native"),)))[0][1] == "-march=x86-64-v3"
    monkeypatch.setenv("LLM_RUNTIME_CPU_ISA", "sparc")
    with pytest.raises(ValueError, match="LLM_RUNTIME_CPU_ISA must be one of native, avx2"):
        cpu_target()
