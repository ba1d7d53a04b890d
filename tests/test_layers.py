"""The architecture is checked, not described: import-linter's contracts in pyproject.toml (each layer imports only
the layers below it; no cycles between the modules of a package), and no module of the package past 450 lines."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lib" / "llm_runtime"
MAX_LINES = 450


def _lint(python_path: Path) -> subprocess.CompletedProcess[str]:
    """`lint-imports` over the package found first on `python_path`, with the project's contracts."""
    environment = {**os.environ, "PYTHONPATH": str(python_path)}
    return subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command; "
                           "lint_imports_command()", str(ROOT / "pyproject.toml"), "--no-cache"],
                          cwd=ROOT, env=environment, capture_output=True, text=True, timeout=300)


def test_the_layer_contracts_hold() -> None:
    result = _lint(ROOT / "lib")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 kept, 0 broken" in result.stdout


def _broken_copy(tmp_path: Path, module: str, line: str) -> subprocess.CompletedProcess[str]:
    """Lint a copy of the package with `line` appended to `module` (a path under the package)."""
    copy = tmp_path / "llm_runtime"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    path = copy / module
    path.write_text(path.read_text() + f"\n{line}\n")
    return _lint(tmp_path)


def test_an_upward_import_breaks_the_layers(tmp_path: Path) -> None:
    """The worker's plan importing the server: the layers contract names that import, and the cycle it closes."""
    result = _broken_copy(tmp_path, "worker/plan.py", "from ..serving import server  # upward, on purpose")
    assert result.returncode != 0
    assert "0 kept, 2 broken" in result.stdout
    assert "llm_runtime.worker.plan -> llm_runtime.serving.server" in result.stdout


def test_a_cycle_inside_a_package_breaks_the_contract(tmp_path: Path) -> None:
    result = _broken_copy(tmp_path, "engine/outputs.py", "from . import engine  # a cycle, on purpose")
    assert result.returncode != 0
    assert "1 kept, 1 broken" in result.stdout and "- .outputs -> .engine (1 import)" in result.stdout


def test_no_module_of_the_package_is_past_450_lines() -> None:
    sizes = {path.relative_to(PACKAGE).as_posix(): len(path.read_text().splitlines())
             for path in PACKAGE.rglob("*.py")}
    assert {name: lines for name, lines in sizes.items() if lines > MAX_LINES} == {}
