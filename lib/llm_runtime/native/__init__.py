"""The package's C kernels' common ground: building and loading them (`build.py`) and the headers they share
(`number_formats.h`). The kernels themselves live beside their Python callers: `attention/csrc/` (paged
attention on the CPU), `model/csrc/` (quantized products)."""

from .build import FLAG_SETS, INCLUDE_DIR, KernelUnavailable, build_library

__all__ = ["FLAG_SETS", "INCLUDE_DIR", "KernelUnavailable", "build_library"]
