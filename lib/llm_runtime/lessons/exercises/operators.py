"""What a reader's function computes, operator by operator: for checkers that enforce *how* a task is done.

Some exercises ask for a way of computing, not only a result: attention read block by block (11.2), a
step's slots from whole tensors with no loop per token (12.1), three projections from one multiply (12.2).
`record_operators` runs the function under a `TorchDispatchMode`, which sees every ATen operator after
PyTorch's composite operators have been broken up (`F.linear` arrives as `t` and `mm`, `@` as `mm`), and
returns what each call read and wrote. A checker then counts or inspects the calls.
"""

from __future__ import annotations

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

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 (PyTorch's protocol)
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outputs = tuple((t.numel(), _storage(t)) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        self.calls.append(OperatorCall(func.overloadpacket.__name__, frozenset(map(_storage, tensors)), outputs,
                                       frozenset(t.dtype for t in tensors)))
        return out


def record_operators(fn: Callable[..., Any], *args: Any) -> tuple[Any, list[OperatorCall]]:
    """Call fn(*args); return its result and every ATen call it made, in order."""
    recorder = _Recorder()
    with recorder:
        result = fn(*args)
    return result, recorder.calls


def count_matmuls(calls: list[OperatorCall]) -> int:
    """How many matrix multiplies the calls made."""
    return sum(call.name in MATMULS for call in calls)


def largest_read(calls: list[OperatorCall], sources: list[torch.Tensor]) -> tuple[str, int] | None:
    """The call that copied the most elements out of `sources` (views of them do not count: they copy
    nothing), as (operator name, elements written); None when nothing was copied out of them."""
    storages = {_storage(t) for t in sources}
    best: tuple[str, int] | None = None
    for call in calls:
        if not call.input_storages & storages:
            continue
        for numel, storage in call.outputs:
            if storage not in storages and (best is None or numel > best[1]):
                best = (call.name, numel)
    return best
