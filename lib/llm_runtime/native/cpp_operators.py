"""Two of this package's operators registered from C++ (csrc/operators.cpp), for the compiled forward pass.

A compiled decode step (engine/compiled_forward.py) is one graph, but each of this package's operators in
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
like the C kernels, native/build.py) and loads it; the compiled forward pass calls it before it traces, and
the layers pick the C++ operator while being traced (`cpp_operator`). Where it cannot be built (no C++
compiler, or the C kernels themselves are unavailable), everything runs as before, through the Python
operators, and the reason is logged. Eager code never uses these: it calls the Python functions directly.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

from .build import FLAG_SETS, KernelUnavailable, build_torch_library

logger = logging.getLogger(__name__)
NAMESPACE = "llm_runtime_native"
SOURCE = Path(__file__).parent / "csrc" / "operators.cpp"
NAMES = ("int4_matmul", "cpu_paged_attention")  # each the twin of llm_runtime::<name>, same schema
# name -> the loaded C++ operator. A process holds a library once it is loaded, so this is the process's too.
_LOADED: dict[str, torch._ops.OpOverload] = {}


def cpp_operator(name: str) -> torch._ops.OpOverload | None:
    """The C++ operator `llm_runtime_native::name` when `load_cpp_operators` has loaded it, else None (the
    caller keeps `llm_runtime::name`, the Python one)."""
    return _LOADED.get(name)


@functools.cache
def load_cpp_operators() -> str | None:
    """Build (the first time on this machine) and load the C++ operators; None when they are loaded, else why
    not. Called once per process; later calls return the first answer."""
    from ..attention import cpu_kernels  # here, not at the top: both modules import this package
    from ..model import quantized_kernels, quantized_linear

    reason = cpu_kernels.kernel_unavailable_reason() or quantized_kernels.kernels_unavailable_reason()
    if reason is not None:
        return reason
    sources = (*(cpu_kernels.SOURCE_DIR / name for name in cpu_kernels.COMPILED),
               *(quantized_kernels.SOURCE_DIR / name for name in quantized_kernels.SOURCES))
    try:
        path = build_torch_library("operators", SOURCE, sources, {"DENSE_ROWS": quantized_linear.DENSE_ROWS},
                                   FLAG_SETS)
        torch.ops.load_library(str(path))
    except (KernelUnavailable, OSError) as error:
        logger.info("the compiled forward pass calls the Python operators: %s", error)
        return str(error)
    fakes = {"int4_matmul": quantized_linear.int4_matmul_fake,
             "cpu_paged_attention": cpu_kernels.cpu_paged_attention_fake}
    for name in NAMES:
        torch.library.register_fake(f"{NAMESPACE}::{name}")(fakes[name])
        _LOADED[name] = getattr(getattr(torch.ops, NAMESPACE), name).default
    return None
