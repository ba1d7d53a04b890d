"""Lesson 15's hand-built token mask: the regex automaton matches Python's `re` on whole strings, and its masks
equal xgrammar's on the bundled tokenizer, at the start and after prefixes (tokens that cross several states
included); the end-of-sequence token is allowed exactly where the automaton accepts; and the text the
automaton forces (`forced_bytes`) is xgrammar's jump-forward string."""

from __future__ import annotations

import random
import re

import pytest
import torch

from llm_runtime.lessons.token_mask import CharacterDFA, forced_bytes, token_mask

PATTERNS = [r"\(\d{3}\) \d{3}-\d{4}", r"(cat|dog)s?( and (cat|dog)s?)*", r"[a-z]{2,4}@[a-z]+\.(com|org)",
            r"-?[0-9]+(\.[0-9]{1,2})?", r"[^,]{1,3},x*"]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_the_automaton_agrees_with_re_on_whole_strings(pattern: str) -> None:
    dfa = CharacterDFA(pattern)
    rng = random.Random(0)
    alphabet = "0123456789()- .abcdgost@,xnr"
    for length in range(12):
        for _ in range(150):
            text = "".join(rng.choice(alphabet) for _ in range(length))
            assert dfa.accepts(dfa.walk(dfa.start, text.encode())) == bool(re.fullmatch(pattern, text)), text


def test_the_hand_built_masks_equal_xgrammars(bundled) -> None:
    xgr = pytest.importorskip("xgrammar")
    from llm_runtime.sampling import StructuredOutputsParams
    from llm_runtime.structured_output import GrammarCompiler, GrammarState, allocate_bitmask, unpack_bitmask

    _, tokenizer = bundled
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    special = set(info.special_token_ids)
    vocab = [b"" if i in special else token for i, token in enumerate(info.decoded_vocab)]
    spanning = 0
    for pattern, prefix in [(PATTERNS[0], "(555) 12"), (PATTERNS[1], "cats and d"), (PATTERNS[2], "ab@c")]:
        dfa, state = CharacterDFA(pattern), GrammarState(compiler.compile(StructuredOutputsParams(regex=pattern)))
        at = dfa.start
        for token in [None, *tokenizer.encode(prefix)]:
            if token is not None:
                assert state.accept(token)
                at = dfa.walk(at, vocab[token])
            bitmask = allocate_bitmask(1, len(tokenizer))
            state.fill(bitmask, 0)
            theirs = unpack_bitmask(bitmask, len(tokenizer))[0]
            ours = token_mask(dfa, at, vocab)
            ours[tokenizer.eos_token_id] = dfa.accepts(at)
            assert torch.equal(ours, theirs[: len(vocab)]), (pattern, token, int((ours != theirs).sum()))
            assert 0 < int(ours.sum()) < len(vocab) // 2
            spanning += sum(len(vocab[i]) > 1 for i in ours.nonzero().flatten().tolist())
    assert spanning > 0  # some allowed tokens cross several states of the automaton


def test_the_forced_text_is_xgrammars_jump_forward_string(bundled) -> None:
    pytest.importorskip("xgrammar")
    from llm_runtime.sampling import StructuredOutputsParams
    from llm_runtime.structured_output import GrammarCompiler, GrammarState

    _, tokenizer = bundled
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    record = r'\{"name": "[a-z]+", "age": \d+\}'
    cases = [(record, "", '{"name": "'), (record, '{"name": "bob"', ', "age": '), (record, '{"name": "bo', ""),
             (PATTERNS[0], "(555", ") "), (r"(cat|dog)s?", "c", "at"), (r"(cat|dog)s?", "cat", ""),
             (r"colou?r", "col", "o")]
    for pattern, prefix, forced in cases:
        dfa, state = CharacterDFA(pattern), GrammarState(compiler.compile(StructuredOutputsParams(regex=pattern)))
        assert all(state.accept(token) for token in tokenizer.encode(prefix))
        assert forced_bytes(dfa, dfa.walk(dfa.start, prefix.encode())) == forced.encode(), (pattern, prefix)
        assert state.matcher.find_jump_forward_string() == forced, (pattern, prefix)
