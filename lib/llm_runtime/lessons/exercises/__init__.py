"""Exercise checkers for the lessons: the reader writes a small function, a checker runs it against the package.

One module per lesson (`lesson01` ... `lesson19`), each with two or three `check_<name>(fn)` functions.
A checker calls the package's own implementation and the reader's function on the same seeded,
small, random inputs (on the CPU, in well under two seconds) and returns a `Verdict`: passed, failed
with the first input where the two differ (expected against got), or not attempted yet (the stub
still raises `NotImplementedError`). Checkers never raise on a wrong or missing answer.

    from llm_runtime.lessons.exercises import lesson02
    lesson02.check_top_p_filter(top_p_filter)

Reference solutions live in the repository's tests (`tests/lessons/solutions.py`), not here.
"""

from .check import Case, Verdict, run_cases

LESSONS = tuple(f"lesson{number:02d}" for number in range(1, 20))

__all__ = ["LESSONS", "Case", "Verdict", "run_cases"]
