"""How a lesson meets its reader's device: it skips a part the device lacks, saying why, and sizes its
timed workloads for a CPU that plays a GPU.

    if runs_here(load_reason(DEVICE, quantization="gguf", dtype="float32"), "the 4-bit model in float32"):
        ...  # the part that needs it

`runs_here` takes the reason a rule gave (None: allowed) and prints, when there is one, what is skipped and
why, so a reader on a T4 (or a CPU run under `LLM_RUNTIME_DEVICE_PROFILE=t4`) reads why a cell did nothing.

`timed_on_the_device(device)` says whether a lesson's timings are its device's own (not where the CPU plays a
GPU), so a claim about speed is checked only where they are. `workload_size(n, device)` is `n` on the device
itself, and a quarter of it when the CPU plays a GPU: that run checks the GPU's rules (what is refused, what is
skipped, which dtype), and its timings are the CPU's in the GPU's dtype, so a smaller load tells as much
(`at_least` keeps what a cell's point needs: two requests to share a prefix, three chunks to see them grow).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..device import device_profile

EMULATED_WORKLOAD_SHARE = 4  # an emulated run times a quarter of each load


def runs_here(reason: str | None, what: str, report: Callable[[str], None] = print) -> bool:
    """True when `reason` is None (the device can run `what`); else report that `what` is skipped, and why."""
    if reason is None:
        return True
    report(f"Skipped here: {what}. {reason[0].upper()}{reason[1:]}.")
    return False


def timed_on_the_device(device: torch.device | str) -> bool:
    """False where the CPU plays a GPU: a timing taken there is the CPU's (in float16 on a T4, a dtype it has no
    arithmetic units for), so a lesson's claim about speed holds only where this is True:
    `assert speedup > 2 or not timed_on_the_device(model.device)`."""
    return not device_profile(device).emulated


def workload_size(n: int, device: torch.device | str, at_least: int = 1) -> int:
    """`n` (requests, tokens, steps) on a real device; n / 4, but at least `at_least` (and at most n), when the
    CPU plays a GPU."""
    if device_profile(device).emulated:
        return min(n, max(at_least, n // EMULATED_WORKLOAD_SHARE))
    return n
