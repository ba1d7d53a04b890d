"""One sequence's place in its grammar: `GrammarState` (lesson 15).

Each constrained sequence owns one xgrammar matcher, a pushdown automaton's state after the sequence's
output so far. It moves with the sequence:

- every token the sequence appends (`Sequence.append_token`) is accepted by the matcher: the output and the
  matcher never disagree, and a token the grammar refuses finishes the sequence with an error;
- a step's mask (`fill`) says which tokens may come next; a speculating sequence needs one mask per drafted
  position, so its drafts are accepted one by one, a mask filled after each, then rolled back (`fill_drafts`):
  the drafts the step keeps are accepted again when they are appended;
- drafts a proposer made are cut at the first token the grammar refuses before they are verified
  (`valid_prefix`); the tokens the grammar forces are proposed by the grammar itself (`forced_tokens`,
  jump-forward);
- preemption keeps the output, so the matcher stays where it is; forks (n > 1) happen before any output, and
  each sibling has its own matcher; a prefix-cache hit changes only how the prompt is computed.

When the grammar is complete and the matcher has accepted the end (EOS), `is_terminated` is True and the
sequence stops, even with `ignore_eos`.
"""

from __future__ import annotations

from collections.abc import Sequence as TokenList

import torch

from ..model.tokenizer import Tokenizer
from .compiler import CompiledGrammar

def allocate_bitmask(num_rows: int, vocab_size: int, pin_memory: bool = False) -> torch.Tensor:
    """(num_rows, ceil(vocab / 32)) int32 on the host, every bit set: a mask that allows every token. Pinned
    (`pin_memory`, CUDA only) when it is to be copied to a GPU without waiting for it."""
    return torch.full((num_rows, (vocab_size + 31) // 32), -1, dtype=torch.int32, pin_memory=pin_memory)


class GrammarState:
    """The matcher of one sequence, kept in step with its output tokens."""

    def __init__(self, grammar: CompiledGrammar) -> None:
        import xgrammar

        self.grammar = grammar
        self.matcher = xgrammar.GrammarMatcher(grammar.compiled)  # rolls back any number of tokens
        self.num_accepted = 0  # output tokens the matcher has taken

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its end (a stop token) was accepted: nothing may follow."""
        return self.matcher.is_terminated()

    def accept(self, token_id: int) -> bool:
        """Advance over one output token; False (and no change) when the grammar refuses it."""
        if not self.matcher.accept_token(token_id):
            return False
        self.num_accepted += 1
        return True

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into bitmask[row] (bit t of word t // 32 set: token t allowed)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def fill_drafts(self, drafts: TokenList[int], bitmask: torch.Tensor, first_row: int) -> None:
        """The masks of a speculating sequence's 1 + k rows: allowed tokens now, after draft 1, ..., after draft k.
        The matcher ends where it started, whatever happens. The drafts must be valid (`valid_prefix` cut them).

        A draft may end the grammar (a stop token once it is complete, which `valid_prefix` keeps): nothing is
        allowed after it, and xgrammar refuses to fill a mask there. Its row is left as allocated (every token
        allowed): a sequence that keeps that draft finishes on it, and the token drawn from the row is dropped
        (Scheduler.postprocess); one that refuses it never reads the row."""
        self.fill(bitmask, first_row)
        accepted = 0
        try:
            for i, token in enumerate(drafts):
                if not self.matcher.accept_token(token):
                    raise ValueError(f"draft {i} (token {token}) is not allowed by the grammar; cut drafts first")
                accepted += 1
                if self.matcher.is_terminated():
                    if accepted < len(drafts):
                        raise ValueError(f"draft {i} (token {token}) ends the grammar, and {len(drafts) - accepted} "
                                         f"drafts follow it; cut drafts first")
                    break
                self.fill(bitmask, first_row + 1 + i)
        finally:
            self.matcher.rollback(accepted)

    def valid_prefix(self, drafts: TokenList[int]) -> list[int]:
        """The longest prefix of `drafts` the grammar allows from here (the matcher ends where it started). A stop
        token that completes the grammar is kept, and nothing after it."""
        kept = 0
        try:
            for token in drafts:
                if self.matcher.is_terminated() or not self.matcher.accept_token(token):
                    break
                kept += 1
        finally:
            self.matcher.rollback(kept)
        return list(drafts[:kept])

    def forced_tokens(self, tokenizer: Tokenizer, limit: int) -> list[int]:
        """Jump-forward: the tokens of the text the grammar allows as the only continuation from here (a
        schema's next key, the punctuation around it), at most `limit` of them, each checked against the
        grammar; [] where the next character is not fixed. They are drafts the model still verifies."""
        if limit < 1 or self.is_terminated:
            return []
        text = self.matcher.find_jump_forward_string()
        if not text:
            return []
        return self.valid_prefix(tokenizer.encode(text, add_special_tokens=False)[:limit])
