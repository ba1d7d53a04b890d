"""Lessons ask `llm_runtime.device` about the device, never torch directly.

A CPU run plays a T4 or an H100 through LLM_RUNTIME_DEVICE_PROFILE, and the play covers only what asks the
package: a cell that asks `torch.cuda.is_bf16_supported()` takes, on a reader's T4, a branch no CPU run ever
took (it says True there: it counts emulation). So the lessons' code cells, and the helpers, exercises and
checkers under `llm_runtime/lessons/`, name no CUDA query, no `.cuda()` and no "cuda" device literal, outside
the short list below of lines that are about CUDA itself. Comparing a tensor's own device (`x.device.type ==
"cuda"`) is fine: that is where the data is, which the profile does not change.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
HELPERS = sorted((ROOT / "lib" / "llm_runtime" / "lessons").rglob("*.py"))

# What a lesson must not ask torch itself: use llm_runtime.device's has_fast_bfloat16, synchronize, gpu_count,
# memory_in_use, triton_mode, device_profile(...).describe() and resolve_device instead.
FORBIDDEN = re.compile(
    r"torch\.cuda\.|\.cuda\(|torch\.backends\.(cuda|cudnn|mps)|is_bf16_supported|_is_mkldnn_bf16_supported"
    r"|(?<!type == )(?<!type != )[\"']cuda(:\d+)?[\"']"
)
# Lines allowed anyway, and why: lesson 12 captures one layer in a CUDA graph by hand, on a CUDA model only
# (the cell's first line asks the model's device), to show what the engine's cuda_graphs.py does; lesson 16 asks
# the backend selector what a GPU engine would attend with, a question about CUDA that any machine answers.
ALLOWED = {
    "12_step_without_python.ipynb": ("torch.cuda.Stream()", "torch.cuda.current_stream()", "torch.cuda.stream(",
                                     "torch.cuda.CUDAGraph()", "torch.cuda.graph("),
    "16_batch_invariance.ipynb": ('select_backend("auto", "cuda", model.dtype, batch_invariant=True)',),
}


def forbidden_lines(name: str, source: str) -> list[str]:
    """The lines of `source` (a cell or a helper module of `name`) that ask torch about the device."""
    allowed = ALLOWED.get(name, ())
    return [line.strip() for line in source.splitlines()
            if FORBIDDEN.search(line.split("#", 1)[0]) and not any(a in line for a in allowed)]


def code_cells(path: Path) -> list[str]:
    return ["".join(cell["source"]) for cell in json.loads(path.read_text())["cells"] if cell["cell_type"] == "code"]


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name[:2])
def test_lessons_ask_the_package_about_the_device(notebook: Path) -> None:
    found = [f"cell {i}: {line}" for i, source in enumerate(code_cells(notebook))
             for line in forbidden_lines(notebook.name, source)]
    assert not found, f"{notebook.name} asks torch about the device:\n" + "\n".join(found)


def test_lesson_helpers_ask_the_package_about_the_device() -> None:
    found = [f"{path.relative_to(ROOT)}: {line}" for path in HELPERS
             for line in forbidden_lines(path.name, path.read_text())]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("planted", [
    'has_bf16 = torch.cuda.is_bf16_supported()',
    'if torch.cuda.is_available():',
    'x = x.cuda()',
    'device = "cuda" if ok else "cpu"',
    'torch.ops.mkldnn._is_mkldnn_bf16_supported()',
])
def test_the_scan_finds_a_planted_query(planted: str) -> None:
    assert forbidden_lines("01_manual_inference.ipynb", f"import torch\n{planted}\n") == [planted]


def test_the_scan_lets_a_tensor_say_where_it_is() -> None:
    assert forbidden_lines("01_manual_inference.ipynb", 'on_gpu = model.device.type == "cuda"\n') == []
    assert forbidden_lines("12_step_without_python.ipynb", "graph = torch.cuda.CUDAGraph()\n") == []
    assert forbidden_lines("11_attention_kernels.ipynb", "graph = torch.cuda.CUDAGraph()\n") != []
