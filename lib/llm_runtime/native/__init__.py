"""The package's C kernels' common ground: building and loading them (`build.py`), the headers they share
(`number_formats.h`), registering PyTorch operators (`operators.py`) and the two registered from C++ for the
compiled forward pass (`cpp_operators.py`, `csrc/operators.cpp`). The kernels themselves live beside their
Python callers: `attention/csrc/` (paged attention on the CPU), `model/csrc/` (quantized products)."""

from .build import FLAG_SETS, INCLUDE_DIR, KernelUnavailable, build_library, build_torch_library

__all__ = ["FLAG_SETS", "INCLUDE_DIR", "KernelUnavailable", "build_library", "build_torch_library"]
