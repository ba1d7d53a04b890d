"""Token masks (structured_output/bitmask.py, grammar_state.py): the unpacked bitmask is xgrammar's own
application of it; only constrained rows change and the input stays as it was; a speculating sequence's masks
are the masks after each draft, and the matcher ends where it started; drafts are cut at the first refused
token; jump-forward proposes the tokens of the text the grammar fixes, and nothing where it is free."""

from __future__ import annotations

import math
import re

import pytest
import torch

from llm_runtime.sampling import StructuredOutputsParams as Params
from llm_runtime.structured_output import (GrammarCompiler, GrammarState, allocate_bitmask, apply_bitmask,
                                           unpack_bitmask)

xgrammar = pytest.importorskip("xgrammar")
VOCAB = 49152


@pytest.fixture(scope="module")
def compiler(bundled_tokenizer) -> GrammarCompiler:
    return GrammarCompiler(bundled_tokenizer, VOCAB, (bundled_tokenizer.eos_token_id,))


def test_the_unpacked_mask_is_xgrammars_own(compiler, bundled_tokenizer) -> None:
    state = GrammarState(compiler.compile(Params(regex=r"[0-9]{2,4}(px|em)")))
    bitmask = allocate_bitmask(3, VOCAB)
    state.fill(bitmask, 1)
    logits = torch.randn(3, VOCAB)
    theirs, before = logits.clone(), logits.clone()
    xgrammar.apply_token_bitmask_inplace(theirs, bitmask)
    ours = apply_bitmask(logits, bitmask[1:2], [1])
    assert torch.equal(ours[1], theirs[1]) and torch.equal(ours[0], before[0]) and torch.equal(ours[2], before[2])
    assert ours is logits and math.isinf(float(ours[1].min()))  # in place: no copy of the (R, V) logits
    scattered = apply_bitmask(before.clone(), torch.cat([bitmask[1:2], bitmask[1:2]]), [0, 2])  # rows apart
    refused = torch.isinf(theirs[1])
    for row in (0, 2):
        assert torch.equal(torch.isinf(scattered[row]), refused)
        assert torch.equal(scattered[row][~refused], before[row][~refused])
    assert torch.equal(scattered[1], before[1])
    allowed = unpack_bitmask(bitmask[1:2], VOCAB)[0]
    digits = [t for t in range(len(bundled_tokenizer)) if re.fullmatch("[0-9]{1,4}", bundled_tokenizer.decode([t]))]
    assert allowed[digits].all() and 0 < int(allowed.sum()) < 200  # digits (and digit runs), nothing else
    assert unpack_bitmask(bitmask[:1], VOCAB).all()  # an unfilled row allows everything


def test_a_speculating_sequences_masks_are_those_after_each_draft(compiler, bundled_tokenizer) -> None:
    grammar = compiler.compile(Params(json={"type": "object", "properties": {"city": {"type": "string"}},
                                            "required": ["city"]}, disable_any_whitespace=True))
    drafts = bundled_tokenizer.encode('{"city": "Par', add_special_tokens=False)
    state, stepwise = GrammarState(grammar), GrammarState(grammar)
    together = allocate_bitmask(len(drafts) + 1, VOCAB)
    state.fill_drafts(drafts, together, 0)
    one_by_one = allocate_bitmask(len(drafts) + 1, VOCAB)
    for i, token in enumerate([*drafts, None]):
        stepwise.fill(one_by_one, i)
        if token is not None:
            assert stepwise.accept(token)
    assert torch.equal(together, one_by_one)
    assert state.num_accepted == 0 and state.valid_prefix(drafts) == drafts  # back where it started


def test_drafts_are_cut_at_the_first_token_the_grammar_refuses(compiler, bundled_tokenizer) -> None:
    state = GrammarState(compiler.compile(Params(regex=r"ab+c")))
    a, b, c = (bundled_tokenizer.convert_tokens_to_ids(x) for x in "abc")
    assert state.valid_prefix([a, b, b, a, c]) == [a, b, b]
    assert state.valid_prefix([b]) == [] and state.accept(a) and state.valid_prefix([b, c]) == [b, c]
    with pytest.raises(ValueError, match="cut drafts first"):
        state.fill_drafts([c, b], allocate_bitmask(3, VOCAB), 0)
    assert state.num_accepted == 1 and state.valid_prefix([b, c]) == [b, c]  # the failed fill changed nothing


def test_jump_forward_proposes_the_fixed_text_and_nothing_where_it_is_free(compiler, bundled_tokenizer) -> None:
    schema = {"type": "object", "properties": {"temperature_in_celsius": {"type": "integer"}},
              "required": ["temperature_in_celsius"]}
    state = GrammarState(compiler.compile(Params(json=schema, disable_any_whitespace=True)))
    forced = state.forced_tokens(bundled_tokenizer, 32)
    assert bundled_tokenizer.decode(forced) == '{"temperature_in_celsius": '
    assert state.num_accepted == 0 and state.forced_tokens(bundled_tokenizer, 2) == forced[:2]
    for token in forced:
        assert state.accept(token)
    assert state.forced_tokens(bundled_tokenizer, 32) == []  # the number is the model's to choose
    free = GrammarState(compiler.compile(Params(regex=r"[a-z]+")))
    assert free.forced_tokens(bundled_tokenizer, 8) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_masks_applied_on_a_gpu_from_pinned_memory_equal_the_cpus(compiler, bundled_tokenizer) -> None:
    """On CUDA the mask and the row index go over from pinned memory, without waiting for the stream; the
    masked logits are the CPU's, bit for bit."""
    state = GrammarState(compiler.compile(Params(regex=r"[a-z]{2,5}")))
    vocab = len(bundled_tokenizer)
    bitmask = allocate_bitmask(2, vocab, pin_memory=True)
    assert bitmask.is_pinned()
    state.fill(bitmask, 0)
    state.fill(bitmask, 1)
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    on_cpu = apply_bitmask(logits, bitmask, [0, 2])
    on_gpu = apply_bitmask(logits.cuda(), bitmask, [0, 2])
    assert torch.equal(on_gpu.cpu(), on_cpu)
    assert torch.equal(on_cpu[1], logits[1]) and bool(torch.isinf(on_cpu[0]).any())
