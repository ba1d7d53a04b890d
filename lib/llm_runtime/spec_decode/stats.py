"""How well the guesses paid: drafts verified, drafts kept, and how many each verification kept (lesson 14).

vLLM reports the same three: the acceptance rate (kept drafts over verified ones), the mean acceptance
length (tokens a sequence gains per verification: the kept drafts plus the token drawn after them) and
the distribution of kept drafts per verification, here a histogram over 0 .. k. The engine's `stats()`
(`EngineStats`) derives the first two from these counters.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpeculationStats:
    """Counters over an engine's life; `record` adds one sequence's verification."""

    num_speculative_tokens: int
    num_draft_tokens: int = 0  # drafts verified
    num_accepted_tokens: int = 0  # of those, kept
    accepted_counts: list[int] = field(default_factory=list)  # [a]: verifications that kept a drafts, 0 .. k

    def __post_init__(self) -> None:
        if not self.accepted_counts:
            self.accepted_counts = [0] * (self.num_speculative_tokens + 1)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        if not 0 <= num_accepted <= num_drafts <= self.num_speculative_tokens:
            raise ValueError(f"kept {num_accepted} of {num_drafts} drafts (at most {self.num_speculative_tokens})")
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        self.accepted_counts[num_accepted] += 1

def expected_tokens_per_verification(acceptance_rate: float, num_speculative_tokens: int) -> float:
    """Tokens a sequence gains per verification of k drafts when each is kept with probability `acceptance_rate`
    given the ones before it: 1 + a + a^2 + ... + a^k = (1 - a^(k + 1)) / (1 - a) (Leviathan et al. 2023).
    With the cost of verifying k + 1 tokens over one decode, it predicts the speed-up (lesson 14)."""
    if not 0 <= acceptance_rate <= 1:
        raise ValueError(f"acceptance_rate must be in [0, 1], got {acceptance_rate}")
    if num_speculative_tokens < 0:
        raise ValueError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
    return float(sum(acceptance_rate ** i for i in range(num_speculative_tokens + 1)))
