"""Incremental detokenization: turn a stream of token ids into a stream of text deltas.

One token is not always whole text: byte-level BPE splits an emoji or a CJK character into several
tokens, and decoding a prefix of them yields the replacement character U+FFFD. So we decode a small
window of recent tokens, and release text only once it no longer ends in an incomplete character.
Invariant: the deltas joined equal the decoded text of all the tokens.

The window is what is re-decoded for every token, so it must stay short. Holding text back lets it grow:
while the new tokens decode to nothing (special tokens skipped) or end inside a character, each token
decodes them all again. A character is at most 4 bytes, and real text ends a character within a token
or two (the bundled tokenizer on CJK, emoji and mixed scripts: at most 2 held back), but a model can
emit anything: a thousand lone lead bytes would cost a thousand decodes of growing length each. So once
`_MAX_PENDING_TOKENS` are held back, the text is released up to the last of them after which it does not
end inside a character (a whole one, or no new text), or, if there is none, as it decodes, replacement
characters included (as `flush` does at the end). The deltas still join to the whole decoded text, except
that bytes cut apart there decode as replacement characters; and no decode covers more than twice that
bound of tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..model.tokenizer import Tokenizer

# Prompt tokens kept as left context, so that tokenizers that drop a leading space (SentencePiece)
# decode the first generated token as they would in the middle of the text.
_CONTEXT_TOKENS = 5
_INCOMPLETE = "\ufffd"
# Tokens held back before text is released anyway (module docstring): past the 4 bytes of any character.
_MAX_PENDING_TOKENS = 8


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
        end = len(self.tokens)
        full_text = self._decode(self.tokens[self.prefix_offset : end])
        if not final and not _is_whole(full_text, prefix_text):
            if end - self.read_offset < _MAX_PENDING_TOKENS:
                # Nothing new (e.g. a special token skipped in the output), or the rest of a character's
                # bytes is still to come: wait.
                return ""
            # Held back too long: up to the last token after which no character is cut, else all of it.
            for cut in range(end - 1, self.read_offset, -1):
                text = self._decode(self.tokens[self.prefix_offset : cut])
                if not text.endswith(_INCOMPLETE):
                    end, full_text = cut, text
                    break
        self.prefix_offset, self.read_offset = self.read_offset, end
        return full_text[len(prefix_text) :]


def _is_whole(text: str, prefix_text: str) -> bool:
    """Whether `text` (the window decoded) has new text past `prefix_text` and ends on a whole character."""
    return len(text) > len(prefix_text) and not text.endswith(_INCOMPLETE)
