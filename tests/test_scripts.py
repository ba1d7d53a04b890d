"""The scripts that run outside CI at least refuse clearly where they cannot run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the script would run for minutes")
def test_gpu_check_says_there_is_no_gpu_and_exits_2(tmp_path: Path) -> None:
    result = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path / "report")],
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHON": sys.executable})
    assert result.returncode == 2
    assert "no CUDA GPU is visible" in result.stderr


REGISTRY_HOSTS = ("pypi.org", "pythonhosted.org", "download.pytorch.org", "huggingface.co", "github.com/")


def test_no_script_or_make_target_names_a_package_registry() -> None:
    """Packages and sources come through pip and apt as the machine configures them (its index, mirror or wheel
    folder), so the scripts, the Makefile and the README's commands work wherever pip does: none names a registry's
    address (scripts/build_llamacpp.sh fetched llama.cpp's sources from one by URL)."""
    files = [ROOT / "Makefile", ROOT / "README.md", ROOT / "pyproject.toml", *sorted((ROOT / "scripts").iterdir())]
    found = [(path.name, host) for path in files if path.is_file()
             for host in REGISTRY_HOSTS if host in path.read_text(errors="replace")]
    assert found == []
