"""The exercise checkers: each accepts its reference solution, rejects plausible wrong answers naming the
input that shows the mistake, calls a stub "not attempted" and never raises. (How long a checker takes is not
asserted: timings on a shared CI machine are noise, and the guide keeps them out of unit tests.)"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable

import pytest

from llm_runtime.lessons.exercises import LESSONS, Verdict
from solutions import SOLUTIONS, WRONG

CHECKER_PREFIX = "check_"


def _checkers() -> dict[str, Callable[[object], Verdict]]:
    """Every `check_*` function defined in every lesson module, as "lessonNN.name" -> checker."""
    found = {}
    for lesson in LESSONS:
        module = importlib.import_module(f"llm_runtime.lessons.exercises.{lesson}")
        for name, function in inspect.getmembers(module, inspect.isfunction):
            if name.startswith(CHECKER_PREFIX) and function.__module__ == module.__name__:
                found[f"{lesson}.{name[len(CHECKER_PREFIX):]}"] = function
    return found


CHECKERS = _checkers()
WRONG_ANSWERS = [(key, wrong) for key, answers in WRONG.items() for wrong in answers]


def test_every_checker_has_a_solution_and_a_wrong_answer() -> None:
    assert set(CHECKERS) == set(SOLUTIONS), "checkers and reference solutions must match one to one"
    assert set(CHECKERS) == set(WRONG)
    assert all(WRONG[key] for key in CHECKERS), "every checker must be shown to reject at least one wrong answer"
    for lesson in LESSONS:
        count = sum(key.startswith(lesson + ".") for key in CHECKERS)
        assert 2 <= count <= 3, f"{lesson} has {count} exercises; each lesson has two or three"


def test_no_solution_shadows_another() -> None:
    # Two functions of one name in solutions.py: the dicts would hold the later one for both exercises.
    names = [fn.__name__ for answers in (list(SOLUTIONS.values()), *WRONG.values()) for fn in answers]
    assert sorted({n for n in names if names.count(n) > 1}) == []


def test_every_lesson_module_lists_its_exercises() -> None:
    for key, checker in CHECKERS.items():
        lesson, name = key.split(".")
        module = importlib.import_module(f"llm_runtime.lessons.exercises.{lesson}")
        assert f"`{name}(" in module.__doc__, f"{lesson}'s docstring does not list {name}"
        assert checker.__doc__ and checker.__doc__.startswith(f"`{name}("), \
            f"check_{name}'s docstring must open with the signature the reader writes"


@pytest.mark.parametrize("key", sorted(CHECKERS))
def test_the_solution_passes(key: str) -> None:
    verdict = CHECKERS[key](SOLUTIONS[key])
    assert isinstance(verdict, Verdict)
    assert verdict.passed and verdict.attempted and bool(verdict), verdict.message
    assert "All " in verdict.message and "agree with" in verdict.message


@pytest.mark.parametrize("key, wrong", WRONG_ANSWERS, ids=[wrong.__name__ for _, wrong in WRONG_ANSWERS])
def test_a_wrong_answer_is_rejected_with_its_input(key: str, wrong: Callable) -> None:
    verdict = CHECKERS[key](wrong)
    assert not verdict and verdict.attempted, f"{wrong.__name__} passed"
    assert "on input" in verdict.message and ("expected" in verdict.message or "raised" in verdict.message
                                              or "It calls" in verdict.message)
    name = key.split(".")[1]
    assert f"{name}(" in verdict.message, "the message shows the call that failed"
    parameters = list(inspect.signature(SOLUTIONS[key]).parameters)
    assert all(f"{parameter}=" in verdict.message for parameter in parameters), "every argument is shown"


@pytest.mark.parametrize("key", sorted(CHECKERS))
def test_a_stub_is_not_attempted_and_nothing_raises(key: str) -> None:
    def stub(*args: object) -> object:
        raise NotImplementedError  # your code here

    verdict = CHECKERS[key](stub)
    assert not verdict.passed and not verdict.attempted
    assert "run this cell again" in verdict.message
    assert "not attempted yet" in verdict._repr_markdown_()


@pytest.mark.parametrize("key", sorted(CHECKERS))
def test_other_failures_are_reported_not_raised(key: str) -> None:
    def crashes(*args: object) -> object:
        raise ZeroDivisionError("boom")

    verdict = CHECKERS[key](crashes)
    assert not verdict and verdict.attempted
    assert "ZeroDivisionError: boom" in verdict.message and "on input" in verdict.message
    assert not CHECKERS[key](lambda: None), "a function of the wrong arity fails, it does not raise"
    assert not CHECKERS[key](None).passed, "passing something that is not a function fails, it does not raise"
    assert not CHECKERS[key](lambda *args: object()).passed, "an answer of the wrong type fails, it does not raise"


def test_a_verdict_renders_its_three_states() -> None:
    passed = Verdict("top_p_filter", True, True, "All 3 cases agree with `apply_top_p`.")
    failed = Verdict("top_p_filter", False, True, "It differs.\non input:\n  top_p_filter(...)")
    todo = Verdict("top_p_filter", False, False, "Write it, then run this cell again.")
    assert bool(passed) and not failed and not todo
    assert passed._repr_markdown_().startswith("✅") and "passed" in str(passed)
    assert failed._repr_markdown_().startswith("❌") and "```text\non input:" in failed._repr_markdown_()
    assert "not attempted yet" in todo._repr_markdown_() and "not attempted yet" in repr(todo)


def test_an_answer_that_calls_the_package_fails_and_every_checker_watches_for_it(monkeypatch) -> None:
    """`def top_p_filter(...): return apply_top_p(...)` is the package's answer, not the reader's: it fails. And every
    checker's reference names code the watch can see (a name that resolves to nothing would let any call through)."""
    import torch

    from llm_runtime.lessons.exercises import check
    from llm_runtime.lessons.exercises.lesson02 import check_top_p_filter
    from llm_runtime.lessons.exercises.lesson17 import check_ring_all_reduce
    from llm_runtime.lessons import tensor_parallel
    from llm_runtime.sampling import apply_top_p

    def top_p_filter(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        return apply_top_p(logits, top_p)

    verdict = check_top_p_filter(top_p_filter)
    assert not verdict and verdict.attempted and "It calls `llm_runtime.sampling.apply_top_p`" in verdict.message
    verdict = check_ring_all_reduce(lambda parts: tensor_parallel.ring_all_reduce(parts))
    assert not verdict and "It calls" in verdict.message

    resolved = {}
    reference_code = check.reference_code
    monkeypatch.setattr(check, "reference_code", lambda ref: resolved.setdefault(ref, reference_code(ref)))
    for key, checker in CHECKERS.items():
        checker(SOLUTIONS[key])
    assert len(resolved) >= len(CHECKERS) - 5  # a few checkers share a reference
    # Two references describe rather than name a function a reader could call: the three products 12.2 fuses,
    # and 13.3's per-token int8, computed inside its checker.
    assert {ref for ref, codes in resolved.items() if not codes} == {
        "three F.linear calls", "llm_runtime.lessons.exercises.lesson13 (per token)"}
