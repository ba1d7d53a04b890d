"""An exercise's function never shadows a name the lesson's own cells use.

Exercise 16.2 once asked the reader to write `rows_invariant`, which section 3 had imported from the package: after
the exercise cell ran, re-running section 3 called the reader's draft (or its NotImplementedError). So a function
an exercise defines is not a name the lesson's code before the exercises imports or defines.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def lesson_and_exercises(path: Path) -> tuple[list[str], list[str]]:
    """The code cells before the '## Exercises' heading, and those after it."""
    before: list[str] = []
    after: list[str] = []
    in_exercises = False
    for cell in json.loads(path.read_text())["cells"]:
        source = "".join(cell["source"])
        if cell["cell_type"] == "markdown" and re.search(r"^## Exercises", source, re.MULTILINE):
            in_exercises = True
        elif cell["cell_type"] == "code":
            (after if in_exercises else before).append(source)
    assert in_exercises, f"{path.name} has no '## Exercises' heading"
    return before, after


def parsed(source: str) -> ast.Module:
    return ast.parse("\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!"))))


def bound_names(source: str) -> set[str]:
    """Names a cell binds at its top level by import or def."""
    names: set[str] = set()
    for node in parsed(source).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {alias.asname or alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
    return names


def exercise_functions(source: str) -> set[str]:
    return {node.name for node in parsed(source).body if isinstance(node, ast.FunctionDef)}


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name[:2])
def test_exercises_define_no_name_the_lesson_uses(notebook: Path) -> None:
    before, after = lesson_and_exercises(notebook)
    used = set().union(*map(bound_names, before)) if before else set()
    written = set().union(*map(exercise_functions, after)) if after else set()
    assert not used & written, (f"{notebook.name}: exercises write {sorted(used & written)}, which the lesson "
                                "imports or defines before them; import the package's under its module's name")


def test_the_check_sees_a_shadowed_import() -> None:
    lesson = ["from llm_runtime.lessons.invariance import blocked_sum, rows_invariant\n"]
    exercise = ["def rows_invariant(fn, x, chunk_sizes):\n    raise NotImplementedError\n"]
    assert set().union(*map(bound_names, lesson)) & set().union(*map(exercise_functions, exercise)) == {"rows_invariant"}
