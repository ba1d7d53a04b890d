"""Where the package keeps what it makes once and reuses: converted models, built kernels, measured peaks."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """$XDG_CACHE_HOME/llm_runtime, else ~/.cache/llm_runtime."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "llm_runtime"
