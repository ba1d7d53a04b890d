"""Two of this package's operators registered from C++ (csrc/operators.cpp), for the compiled forward pass.

A compiled decode step (worker/compiled_forward.py) is one graph, but each of this package's operators in
it is a Python function (operators.py): the graph calls into the dispatcher, the dispatcher back into the
interpreter, which checks its arguments and calls the C kernels through ctypes. For the bundled model in
its native 4-bit form that is 120 int4 products and 30 layers' attention a step. `torch.profiler` over 20
such steps on the 2-core CI machine: a layer's attention took 42 us a call as a Python operator and 16.5 us
from C++ (the C kernels themselves about 12 at that context); an int4 product spent 6.5 us in the Python
operator around PyTorch's kernel and 1.2 us in the C++ one. Together: 1.6 ms of a 12 to 15 ms step.

The C++ file registers the same two operators, `int4_matmul` and `cpu_paged_attention`, under the namespace
`llm_runtime_native`, with the same schemas, checks and C kernels (compiled into the same library), so a
call from the graph goes from the dispatcher straight into C++. `load_cpp_operators` builds the library
the first time (about 10 s: the one file of the package that includes PyTorch's headers; cached on disk
like the C kernels, native/build.py) and loads it (`register_cpp_operators`). The compiled forward pass calls it
before it traces (worker/compiled_forward.py, which knows the kernels' sources: this package imports neither
the attention kernels nor the quantized layers), and the layers pick the C++ operator while being traced
(`cpp_operator`). Where it cannot be built (no C++ compiler, or the C kernels themselves are unavailable),
everything runs as before, through the Python operators, and the reason is logged. Eager code never uses these:
it calls the Python functions directly.
"""

from __future__ import annotations

from pathlib import Path

import torch

NAMESPACE = "llm_runtime_native"
SOURCE = Path(__file__).parent / "csrc" / "operators.cpp"
NAMES = ("int4_matmul", "cpu_paged_attention")  # each the twin of llm_runtime::<name>, same schema
# name -> the loaded C++ operator. A process holds a library once it is loaded, so this is the process's too.
_LOADED: dict[str, torch._ops.OpOverload] = {}


def cpp_operator(name: str) -> torch._ops.OpOverload | None:
    """The C++ operator `llm_runtime_native::name` when `load_cpp_operators` has loaded it, else None (the
    caller keeps `llm_runtime::name`, the Python one)."""
    return _LOADED.get(name)


def register_cpp_operators(library: Path, fakes: dict[str, object]) -> None:
    """Load the built `library` and register each operator's shape function (`fakes`, by name) for tracing."""
    torch.ops.load_library(str(library))
    for name in NAMES:
        torch.library.register_fake(f"{NAMESPACE}::{name}")(fakes[name])
        _LOADED[name] = getattr(getattr(torch.ops, NAMESPACE), name).default
