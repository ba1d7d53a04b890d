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
