"""Penalty state kept on the device: each sequence's token counts, updated by the tokens it added.

Repetition, frequency and presence penalties need, per row, how often each vocabulary token occurs in
the output so far and whether it occurs in the prompt. Rebuilt every step from the Python lists, that
is a pass over every prompt and output token of every penalized sequence and a (B, longest) padded
copy to the device per step. `TokenCounts` keeps both on the sequence's device instead: the prompt's
`seen` mask once, and the output's counts updated with only the tokens appended since the last step
(one `index_add_` of a few ids). A step then stacks the rows it needs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class TokenCounts:
    """(vocab,) output-token counts and prompt-token mask of one sequence, on `device`."""

    def __init__(self, prompt_token_ids: Sequence[int], vocab_size: int, device: torch.device | str) -> None:
        self.vocab_size = vocab_size
        self.prompt_seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        if prompt_token_ids:
            self.prompt_seen[torch.as_tensor(list(prompt_token_ids), device=device)] = True
        self.output_counts = torch.zeros(vocab_size, dtype=torch.int64, device=device)
        self.num_counted = 0  # output tokens already in output_counts

    def update(self, output_token_ids: Sequence[int]) -> "TokenCounts":
        """Count the output tokens added since the last update (the list only grows); returns self."""
        new = output_token_ids[self.num_counted:]
        if new:
            ids = torch.as_tensor(list(new), device=self.output_counts.device)
            self.output_counts.index_add_(0, ids, torch.ones_like(ids))
            self.num_counted = len(output_token_ids)
        return self
