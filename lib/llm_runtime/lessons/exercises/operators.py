"""What a reader's function computes, operator by operator: for checkers that enforce *how* a task is done.

Some exercises ask for a way of computing, not only a result: attention read block by block (11.2), a
step's slots from whole tensors with no loop per token (12.1), three projections from one multiply (12.2).
`record_operators` runs the function under a `TorchDispatchMode`, which sees every ATen operator after
PyTorch's composite operators have been broken up (`F.linear` arrives as `t` and `mm`, `@` as `mm`), and
returns what each call read and wrote. A checker then counts or inspects the calls. What a reader computes in
plain Python, the operators do not see: `python_lines` counts the lines of the reader's own code that Python ran
(a loop over tokens grows it with the tokens, however few tensor operations it ends in).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

MATMULS = frozenset({"mm", "addmm", "bmm", "baddbmm", "mv", "addmv", "dot", "vdot", "_weight_int4pack_mm"})


@dataclass(frozen=True)
class OperatorCall:
    """One ATen call: its name (without the namespace and overload), the storages and dtypes of its tensor inputs,
    and for each tensor output its element count and storage (a view shares its input's storage)."""

    name: str
    input_storages: frozenset[int]
    outputs: tuple[tuple[int, int], ...]  # (numel, storage pointer)
    input_dtypes: frozenset[torch.dtype] = frozenset()


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[OperatorCall] = []
        self._alive: list[Any] = []  # every output kept until the recording ends: no storage address is reused

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 (PyTorch's protocol)
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outputs = tuple((t.numel(), _storage(t)) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        self._alive.append(out)
        self.calls.append(OperatorCall(func.overloadpacket.__name__, frozenset(map(_storage, tensors)), outputs,
                                       frozenset(t.dtype for t in tensors)))
        return out


def record_operators(fn: Callable[..., Any], *args: Any) -> tuple[Any, list[OperatorCall]]:
    """Call fn(*args); return its result and every ATen call it made, in order."""
    recorder = _Recorder()
    with recorder:
        result = fn(*args)
    return result, recorder.calls


def largest_read(calls: list[OperatorCall], sources: list[torch.Tensor]) -> tuple[str, int] | None:
    """The call that wrote the most elements made from `sources`, directly or through earlier calls' outputs (a
    block cloned out of a pool, then concatenated with the others, counts at the concatenation), as (operator
    name, elements written); None when nothing was made from them. Views write nothing and do not count."""
    made_from = {_storage(t) for t in sources}
    best: tuple[str, int] | None = None
    for call in calls:
        if not call.input_storages & made_from:
            continue
        for numel, storage in call.outputs:
            if storage in made_from:
                continue  # a view of what is already counted
            made_from.add(storage)
            if best is None or numel > best[1]:
                best = (call.name, numel)
    return best


def python_lines(fn: Callable[..., Any], *args: Any) -> int:
    """How many lines of `fn`'s own source file Python ran while calling fn(*args) (its helpers and comprehensions
    from that file included, the package's and PyTorch's code not): a loop runs its lines once per pass."""
    code = getattr(fn, "__code__", None)
    if code is None:  # a callable object, a partial: its lines are not told apart from the library's
        fn(*args)
        return 0
    source_file, lines = code.co_filename, 0

    def count(frame: Any, event: str, arg: Any) -> Any:  # noqa: ARG001 (sys.settrace's protocol)
        nonlocal lines
        lines += event == "line"
        return count

    def enter(frame: Any, event: str, arg: Any) -> Any:  # noqa: ARG001
        return count if frame.f_code.co_filename == source_file else None

    previous = sys.gettrace()
    sys.settrace(enter)
    try:
        fn(*args)
    finally:
        sys.settrace(previous)
    return lines
