"""This package's PyTorch operators: Python functions the compiled forward pass keeps as one node each.

`torch.compile` cannot trace into a ctypes call or choose a kernel by a row count it only knows at run
time, so such code becomes an operator of the `llm_runtime` namespace (worker/compiled_forward.py). There
are two ways to register one. `torch.library.custom_op` wraps every call in Python kernels for several
dispatch keys (autograd, the in-place bookkeeping, the device) with safety checks in each; `Library.define`
and `impl` register the function for the device key alone, the rest falling through in C++. A decode step
of the bundled model calls about 150 of these operators (the int4 products, each layer's attention, the
head), and on the 2-core CI machine the lighter registration made an int4 product about 10 us cheaper a
call inside a compiled graph (75 against 65 us at 576 x 960): over a millisecond a step, out of 14.

`define_operator` is the lighter way with `custom_op`'s conveniences: the schema comes from the function's
type hints (`torch.library.infer_schema`), and the fake version for tracing is registered with
`torch.library.register_fake` as usual. The operators are for inference: none has a backward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

NAMESPACE = "llm_runtime"
# The namespace's registrations live as long as this object (one per process, as every operator library is).
_LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")


def define_operator(name: str, fn: Callable, *, mutates_args: Iterable[str] = (),
                    dispatch_keys: Iterable[str] = ("CPU",)) -> torch._ops.OpOverload:
    """Register `fn` as the operator `llm_runtime::name` for each dispatch key ("CPU", "CUDA"; "MkldnnCPU" for
    an argument in oneDNN's layout); returns it, callable as `fn` is. `mutates_args`: the tensor arguments `fn`
    writes into (they must be declared, as for `custom_op`)."""
    _LIBRARY.define(name + torch.library.infer_schema(fn, mutates_args=tuple(mutates_args)))
    for key in dispatch_keys:
        _LIBRARY.impl(name, fn, key)
    return getattr(getattr(torch.ops, NAMESPACE), name).default
