"""The package's layout: the folders DESIGN.md draws, the public API in one import, and the serving
core independent of what only the lessons use."""

from __future__ import annotations

import ast
from pathlib import Path

import llm_runtime

PACKAGE = Path(llm_runtime.__file__).parent
FOLDERS = ("model", "attention", "sampling", "core", "engine", "executor", "worker", "spec_decode", "serving", "bench",
           "lessons", "native", "distributed", "kv_transfer", "structured_output")


def test_the_folders_of_the_target_layout() -> None:
    assert all((PACKAGE / folder / "__init__.py").exists() for folder in FOLDERS)
    loose = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert loose == ["__init__.py", "__main__.py", "cache_dir.py", "config.py", "device.py", "errors.py"]


def test_every_public_name_comes_from_the_top() -> None:
    for name in llm_runtime.__all__:
        assert getattr(llm_runtime, name) is not None
    from llm_runtime.lessons import RaggedKVBatch, StaticBatchRunner

    assert StaticBatchRunner is llm_runtime.StaticBatchRunner and RaggedKVBatch.__module__.startswith(
        "llm_runtime.lessons")


def test_the_serving_core_does_not_depend_on_lesson_helpers() -> None:
    for folder in ("model", "attention", "sampling", "core", "engine", "executor", "worker", "serving", "distributed"):
        for path in (PACKAGE / folder).glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom):
                    module = node.module or ""
                    assert "lessons" not in module, f"{path.name} imports {module}"
    from llm_runtime import Sequence

    assert not hasattr(Sequence("r", [1], llm_runtime.SamplingParams(), max_new_tokens=1), "kv_cache")


def test_every_module_has_a_docstring() -> None:
    for path in PACKAGE.rglob("*.py"):
        assert ast.get_docstring(ast.parse(path.read_text())), f"{path.relative_to(PACKAGE)} has no docstring"


def test_test_files_have_unique_names() -> None:
    # pytest's default import mode imports test modules by basename, so two `test_config.py` in different
    # folders stop the whole collection ("import file mismatch"), as one CI run did.
    tests = Path(__file__).parent
    names = [path.name for path in tests.rglob("test_*.py")]
    assert sorted({name for name in names if names.count(name) > 1}) == []


def test_the_test_files_the_package_names_exist() -> None:
    """A docstring that sends a reader to tests/... for the proof sends them to a file that is there."""
    import re

    tests = PACKAGE.parents[1] / "tests"
    named = {match for path in PACKAGE.rglob("*.py") for match in re.findall(r"tests/[\w/]+\.py", path.read_text())}
    assert named and [name for name in sorted(named) if not (tests.parent / name).exists()] == []
