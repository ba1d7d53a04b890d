"""What the engine asks of a proposer (lesson 14): guesses for the sequences about to decode, and to forget.

Before each step the engine hands the proposer every running sequence whose next step is a decode. The
proposer sets each one's `draft_token_ids` (k guesses, or none) and, when its guesses were drawn from a
distribution, `draft_probs` (k, vocab), which the rejection sampler needs to stay exact. The scheduler runs
as many of them as the step's budget allows, and the rejection sampler keeps a prefix. A proposer that keeps
state per sequence (a draft model's KV cache) drops it for sequences no longer running (`keep_only`).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ..core.sequence import Sequence


class Proposer(Protocol):
    num_speculative_tokens: int

    def propose(self, sequences: list[Sequence]) -> None:
        """Set `draft_token_ids` (and `draft_probs`, or None) of each sequence."""

    def keep_only(self, running: Collection[Sequence]) -> None:
        """Forget whatever is kept for sequences not in `running` (finished, aborted or preempted)."""
