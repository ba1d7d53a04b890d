"""How a lesson meets a feature its reader's device lacks: it says so and skips that part, never raises.

    if runs_here(device_profile(device).quantized_reason(torch.float32), "the 4-bit model in float32"):
        ...  # the part that needs it

`runs_here` takes the reason a rule gave (None: allowed) and prints, when there is one, what is skipped and
why, so a reader on a T4 (or a CPU run under `LLM_RUNTIME_DEVICE_PROFILE=t4`) reads why a cell did nothing.
"""

from __future__ import annotations

from collections.abc import Callable


def runs_here(reason: str | None, what: str, report: Callable[[str], None] = print) -> bool:
    """True when `reason` is None (the device can run `what`); else report that `what` is skipped, and why."""
    if reason is None:
        return True
    report(f"Skipped here: {what}. {reason[0].upper()}{reason[1:]}.")
    return False
