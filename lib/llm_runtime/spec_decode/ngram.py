"""The n-gram proposer ("prompt lookup"): guess that text repeats (lesson 14).

Editing code, answering with quotes, filling a template: much of what a model writes has appeared
earlier in its prompt or its own output. The proposer takes the sequence's last n tokens, looks for
the same n tokens earlier in the sequence, and proposes the tokens that followed them there. It tries
the longest n first (`prompt_lookup_max`, down to `prompt_lookup_min`): a longer match is better
evidence. Among the earlier occurrences of that n-gram it takes the first: it has the most text after
it (in periodic text, a b a b a b, the most recent one runs into the end), and when a model rewrites
its prompt, the first occurrence is usually the prompt's. It costs no model at all, and its guesses are certain (a one-hot
distribution), so the rejection sampler keeps a guess with probability p(guess) under the target.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence as TokenList
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ..core.sequence import Sequence


def propose_ngram(token_ids: TokenList[int] | np.ndarray, num_tokens: int, max_n: int, min_n: int = 1) -> list[int]:
    """Up to `num_tokens` tokens that followed the first earlier occurrence of the longest suffix
    of `token_ids` of min_n .. max_n tokens; fewer when the match is near the end, none without a match."""
    if not 1 <= min_n <= max_n:
        raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {min_n} and {max_n}")
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be at least 1, got {num_tokens}")
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        # windows[i] = tokens[i : i + n] for every start i whose n-gram ends before the suffix begins to overlap
        # itself at the end: starts 0 .. length - n - 1 (the suffix's own position, length - n, is excluded).
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)  # (length - n, n)
        starts = np.flatnonzero((windows == suffix).all(axis=1))
        if len(starts):
            follow = int(starts[0]) + n  # the first occurrence, and where its continuation begins
            return tokens[follow : follow + num_tokens].tolist()
    return []


class NgramProposer:
    """Prompt lookup for every decoding sequence of a step: up to k tokens each, from its own prompt and output."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_max: int, prompt_lookup_min: int = 1) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.max_n, self.min_n = prompt_lookup_max, prompt_lookup_min

    def propose(self, sequences: list[Sequence]) -> None:
        """Set each sequence's `draft_token_ids` (empty where nothing repeats); its drafts are sure guesses
        (no distribution: the rejection sampler treats them as one-hot)."""
        for seq in sequences:
            seq.draft_token_ids = propose_ngram(seq.prompt_token_ids + seq.output_token_ids,
                                                self.num_speculative_tokens, self.max_n, self.min_n)
            seq.draft_probs = None

    def keep_only(self, running: Collection[Sequence]) -> None:
        """Nothing is kept per sequence."""
