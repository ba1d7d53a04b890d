"""Incremental detokenization: turn a stream of token ids into a stream of text deltas.

One token is not always whole text: byte-level BPE splits an emoji or a CJK character into several
tokens, and decoding a prefix of them yields the replacement character U+FFFD. So we decode a small
window of recent tokens, and release text only once it no longer ends in an incomplete character.
Invariant: the deltas joined equal the decoded text of all the tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..model.tokenizer import Tokenizer

# Prompt tokens kept as left context, so that tokenizers that drop a leading space (SentencePiece)
# decode the first generated token as they would in the middle of the text.
_CONTEXT_TOKENS = 5
_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    """Feeds on one token at a time; `add` returns the text that just became final."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        # tokens[prefix_offset:read_offset] were already turned into text; they are decoded again
        # as context so the next piece is decoded the way it reads after them.
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one token; return the new text (empty while a character is incomplete)."""
        self.tokens.append(token_id)
        return self._release(final=False)

    def flush(self) -> str:
        """At the end of the request: whatever is held back, incomplete or not."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.read_offset == len(self.tokens):
            return ""
        prefix_text = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.tokens[self.prefix_offset :])
        if len(full_text) <= len(prefix_text) and not final:
            return ""  # e.g. a special token skipped in the output
        if full_text.endswith(_INCOMPLETE) and not final:
            return ""  # wait for the rest of the character's bytes
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        return full_text[len(prefix_text) :]
