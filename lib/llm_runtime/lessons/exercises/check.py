"""What every exercise checker shares: run the reader's function on cases, compare with the package, say how it went.

A checker builds its cases (small, seeded, on the CPU), computes each expected answer by calling the
package's own code, then calls the reader's function on a copy of the same inputs. The first case
where the two differ becomes the `Verdict`'s message: the input, what the package gives, what the
reader's function gave, and where they differ.

An answer may not call the package code it is checked against (`reference`): the checker watches the reader's
function run (`sys.setprofile`, which sees every Python call) and fails an answer that reached that code, so
`def top_p_filter(...): return apply_top_p(...)` does not pass for writing top-p.

A checker never raises on a missing or wrong answer, so a notebook whose exercises are still stubs
runs from top to bottom (and under nbval): a stub that raises `NotImplementedError` is "not
attempted yet", any other exception is a failed attempt, reported with the input that caused it.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import math
import sys
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import CodeType
from typing import Any

import torch

_MAX_SHOWN_CHARS = 1000  # an input or a value longer than this is cut in messages


@dataclass(frozen=True)
class Verdict:
    """The outcome of one exercise: truthy only when it passed."""

    exercise: str
    passed: bool
    attempted: bool
    message: str

    def __bool__(self) -> bool:
        return self.passed

    @property
    def status(self) -> str:
        if not self.attempted:
            return "not attempted yet"
        return "passed" if self.passed else "failed"

    def _headline_and_details(self) -> tuple[str, str]:
        headline, _, details = self.message.partition("\n")
        return headline, details.strip("\n")

    def _repr_markdown_(self) -> str:
        headline, details = self._headline_and_details()
        mark = {"passed": "✅", "failed": "❌", "not attempted yet": "✏️"}[self.status]
        text = f"{mark} **`{self.exercise}`**: {self.status}. {headline}"
        if details:
            text += f"\n\n```text\n{details}\n```"
        return text

    def __str__(self) -> str:
        headline, details = self._headline_and_details()
        return f"{self.exercise}: {self.status}. {headline}" + (f"\n{details}" if details else "")

    def __repr__(self) -> str:
        return str(self)


@dataclass
class Case:
    """One input to try: the arguments in the order of the reader's signature, and the package's answer."""

    args: dict[str, Any]
    expected: Any
    note: str = ""  # why this case matters, shown when it fails ("a stop string split across two pieces")


Compare = Callable[[Any, Any], "str | None"]  # (expected, got) -> None when they agree, else what differs


def reference_code(reference: str) -> frozenset[CodeType]:
    """The code of the package function or class that `reference` names ("llm_runtime.sampling.apply_top_p", maybe
    followed by words): a function's own, a class's methods and properties. Empty where the name does not resolve."""
    parts = reference.split()[0].split(".") if reference.strip() else []
    target: object = None
    for cut in range(len(parts), 0, -1):  # the longest importable module, then attributes
        try:
            target = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attribute in parts[cut:]:
                target = getattr(target, attribute)
        except AttributeError:
            return frozenset()
        break
    if target is None:
        return frozenset()
    members = vars(target).values() if inspect.isclass(target) else [target]
    codes = set()
    for member in members:
        for function in (getattr(member, "__func__", member), getattr(member, "fget", None)):
            function = inspect.unwrap(function) if callable(function) else None
            if isinstance(getattr(function, "__code__", None), CodeType):
                codes.add(function.__code__)
    return frozenset(codes)


class CallWatch:
    """While active, notes whether Python code in `codes`, or of a file under one of `folders`, ran (a profile
    function: it sees every Python call, whatever name the caller gave the function)."""

    def __init__(self, codes: frozenset[CodeType] = frozenset(), folders: tuple[str, ...] = ()) -> None:
        self.codes, self.folders, self.reached = codes, folders, False
        self._previous: Any = None

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call" and (frame.f_code in self.codes or frame.f_code.co_filename.startswith(self.folders)):
            self.reached = True

    def __enter__(self) -> CallWatch:
        if self.codes or self.folders:
            self._previous = sys.getprofile()
            sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.codes or self.folders:
            sys.setprofile(self._previous)


def run_cases(exercise: str, candidate: object, cases: Iterable[Case] | Callable[[], Iterable[Case]],
              compare: Compare, reference: str,
              method: Callable[[Any], Verdict | None] | None = None) -> Verdict:
    """Call `candidate` on every case and compare with the expected answers; the first difference fails it.

    `cases` may be a function that builds them, so that a fault in building them (a checker's own bug)
    is reported in the verdict instead of raised. `reference` names the package code the answers come from.
    `method`, for a task that says how to compute (operators.py), runs once every case agrees: its verdict
    (None: the way is the task's) fails an answer that is right but computed otherwise.
    """
    if not callable(candidate):
        return Verdict(exercise, False, True, f"Expected a function, got {type(candidate).__name__}: pass "
                                              f"`{exercise}` itself, not what it returns.")
    forbidden = reference_code(reference)
    try:
        cases = list(cases() if callable(cases) else cases)
    except Exception:  # the package changed under the checker: say so, do not break the notebook
        return Verdict(exercise, False, True, "The checker could not build its cases (a bug in the checker, "
                                               "not in your code):\n" + traceback.format_exc(limit=3))
    for number, case in enumerate(cases, start=1):
        args = copy.deepcopy(list(case.args.values()))  # the reader may modify its inputs
        watch = CallWatch(forbidden)
        try:
            with watch:
                got = candidate(*args)
        except NotImplementedError:
            return Verdict(exercise, False, False, f"Write `{exercise}` in the cell above, then run this cell again.")
        except Exception as error:  # the reader's bug: report it with the input that caused it
            return Verdict(exercise, False, True, f"It raised {type(error).__name__} on case {number} of "
                                                  f"{len(cases)}.\n" + describe_input(exercise, case)
                           + f"\n{type(error).__name__}: {error}")
        if watch.reached:
            return Verdict(exercise, False, True, f"It calls `{reference.split()[0]}`, the package's own answer, "
                                                  f"which this exercise asks you to write (case {number} of "
                                                  f"{len(cases)}).\n" + describe_input(exercise, case))
        try:
            difference = compare(case.expected, got)
        except Exception as error:  # e.g. a tensor where a list was expected, of a shape that cannot compare
            difference = f"could not compare the answers ({type(error).__name__}: {error})"
        if difference is not None:
            return Verdict(exercise, False, True, f"It differs from the package on case {number} of {len(cases)}.\n"
                           + describe_input(exercise, case) + f"\nexpected: {show(case.expected)}\n"
                           f"got:      {show(got)}" + (f"\n{difference}" if difference else ""))
    wrong_method = method(candidate) if method is not None else None
    if wrong_method is not None:
        return wrong_method
    return Verdict(exercise, True, True, f"All {len(cases)} cases agree with `{reference}`.")


def method_verdict(exercise: str, case: Case, headline: str, expected: str, got: str) -> Verdict:
    """The verdict on an answer that is right but computed otherwise than the task says (operators.py)."""
    return Verdict(exercise, False, True, f"{headline}\n" + describe_input(exercise, case)
                   + f"\nexpected: {expected}\ngot:      {got}")


def describe_input(exercise: str, case: Case) -> str:
    """The call that failed, one argument per line."""
    lines = [f"on input{f' ({case.note})' if case.note else ''}:", f"  {exercise}("]
    lines += [f"      {name}={show(value)}," for name, value in case.args.items()]
    return "\n".join(lines) + "\n  )"


# ------------------------------------------------------------------------------------------ showing values
def _number(x: float) -> str:
    if isinstance(x, float) and math.isinf(x):
        return "-inf" if x < 0 else "inf"
    return f"{x:.6g}" if isinstance(x, float) else repr(x)


def _nested(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_nested(v) for v in value) + "]"
    return _number(value)


def show(value: Any) -> str:
    """A short readable form: tensors as nested lists with their shape, floats to 6 digits, long text cut."""
    if isinstance(value, torch.Tensor):
        shape = "x".join(map(str, value.shape)) or "scalar"
        text = f"tensor {shape} {str(value.dtype).replace('torch.', '')} {_nested(value.detach().cpu().tolist())}"
    elif isinstance(value, float):
        text = _number(value)
    elif isinstance(value, (list, tuple)) and all(isinstance(v, float) for v in value):
        inner = ", ".join(_number(v) for v in value)
        text = f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
    else:
        text = repr(value)
    return text if len(text) <= _MAX_SHOWN_CHARS else text[: _MAX_SHOWN_CHARS - 5] + " ...)"


# ------------------------------------------------------------------------------------------ comparisons
def same_value(expected: Any, got: Any) -> str | None:
    """Exact equality, lists and tuples alike (a tuple answer may come back as a list)."""
    def normal(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return normal(x.tolist())
        if isinstance(x, (list, tuple)):
            return [normal(v) for v in x]
        return x

    if normal(expected) == normal(got):
        return None
    if isinstance(expected, (list, tuple)) and isinstance(got, (list, tuple)):
        if len(expected) != len(got):
            return f"expected {len(expected)} items, got {len(got)}"
        first = next(i for i, (a, b) in enumerate(zip(expected, got)) if normal(a) != normal(b))
        return f"the first difference is at index {first}: expected {show(expected[first])}, got {show(got[first])}"
    return ""  # expected and got, shown above, say it all


def close_numbers(rel_tol: float = 1e-9, abs_tol: float = 1e-12) -> Compare:
    """Numbers (or flat lists/tuples of numbers, None allowed) equal to rounding."""
    def compare(expected: Any, got: Any) -> str | None:
        if isinstance(expected, (list, tuple)):
            if not isinstance(got, (list, tuple)):
                return f"expected a {type(expected).__name__} of {len(expected)}, got {type(got).__name__}"
            if len(expected) != len(got):
                return f"expected {len(expected)} items, got {len(got)}"
            for i, (a, b) in enumerate(zip(expected, got)):
                difference = compare(a, b)
                if difference is not None:
                    return f"at index {i}: {difference}"
            return None
        if expected is None or got is None:
            return None if expected is got else f"expected {show(expected)}, got {show(got)}"
        if isinstance(got, bool) or not isinstance(got, (int, float)):
            return f"expected a number, got {type(got).__name__}"
        if math.isclose(expected, got, rel_tol=rel_tol, abs_tol=abs_tol):
            return None
        return f"expected {show(expected)}, got {show(got)}"

    def top_level(expected: Any, got: Any) -> str | None:
        difference = compare(expected, got)
        if difference is not None and not isinstance(expected, (list, tuple)) and difference.startswith("expected "):
            return ""  # the values, shown above, say it all
        return difference

    return top_level


def close_tensors(rtol: float = 1e-4, atol: float = 1e-6) -> Compare:
    """Tensors of the same shape whose infinities sit in the same places and whose other entries are close."""
    def compare(expected: torch.Tensor, got: Any) -> str | None:
        if not isinstance(got, torch.Tensor):
            return f"expected a tensor, got {type(got).__name__}"
        if tuple(got.shape) != tuple(expected.shape):
            return f"expected shape {tuple(expected.shape)}, got {tuple(got.shape)}"
        expected, got = expected.detach().double().cpu(), got.detach().double().cpu()
        infinite = torch.isinf(expected) | torch.isinf(got)
        wrong = ~torch.where(infinite, expected == got, torch.isclose(expected, got, rtol=rtol, atol=atol))
        if not wrong.any():
            return None
        index = tuple(int(i) for i in wrong.nonzero()[0])
        return (f"first difference at index {list(index)}: expected {_number(expected[index].item())}, got "
                f"{_number(got[index].item())} ({int(wrong.sum())} of {wrong.numel()} entries differ)")

    return compare


def kept_tokens(expected: torch.Tensor, got: Any) -> str | None:
    """Filters: the same tokens kept (finite) in every row, and the kept logits unchanged."""
    if not isinstance(got, torch.Tensor):
        return f"expected a tensor, got {type(got).__name__}"
    if tuple(got.shape) != tuple(expected.shape):
        return f"expected shape {tuple(expected.shape)}, got {tuple(got.shape)}"
    for row, (e, g) in enumerate(zip(expected.detach().cpu(), got.detach().cpu())):
        kept_e = torch.isfinite(e).nonzero().flatten().tolist()
        kept_g = torch.isfinite(g).nonzero().flatten().tolist()
        if kept_e != kept_g:
            missing, extra = sorted(set(kept_e) - set(kept_g)), sorted(set(kept_g) - set(kept_e))
            return (f"row {row}: the package keeps tokens {kept_e}, yours keeps {kept_g}"
                    + (f"; missing {missing}" if missing else "") + (f"; extra {extra}" if extra else ""))
        if not torch.allclose(e[kept_e].double(), g[kept_g].double(), rtol=1e-5, atol=1e-6):
            return f"row {row}: the same tokens are kept, but their logits changed (a filter only removes tokens)"
        if not bool((g[~torch.isfinite(g)] < 0).all()):
            return f"row {row}: removed tokens must be -inf"
    return None
