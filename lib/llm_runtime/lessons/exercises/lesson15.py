"""Lesson 15 exercises: reading a token bitmask, a choice's token mask by hand, and the text a pattern forces.

- `unpack_mask(bitmask, vocab_size)`: xgrammar's packed mask, (rows, ceil(V / 32)) int32 words, as (rows, V)
  booleans, against `structured_output.unpack_bitmask`.
- `choice_mask(choices, text, vocab)`: which tokens may follow `text` when the output must be one of `choices`,
  by comparing bytes (an answer that builds an automaton or a regex fails), against `lessons.token_mask.token_mask`
  on the automaton of the alternation of the choices.
- `forced_text(dfa, prefix)`: the bytes a pattern allows as the only continuation after `prefix`
  (character-level jump-forward), against `lessons.token_mask.forced_bytes`.
"""

from __future__ import annotations

import importlib.util
import os
import random
import re
import types

import torch

from ...structured_output import unpack_bitmask
from ..token_mask import CharacterDFA, forced_bytes, token_mask
from .check import Case, CallWatch, Verdict, method_verdict, run_cases, same_value


def check_unpack_mask(fn: object) -> Verdict:
    """`unpack_mask(bitmask, vocab_size) -> torch.Tensor`: bitmask (rows, ceil(vocab_size / 32)) int32; bit b
    (counted from the least significant) of word w is set when token 32 w + b is allowed. Return (rows,
    vocab_size) bool, True where the token is allowed (the padding bits past vocab_size dropped)."""

    def cases() -> list[Case]:
        generator = torch.Generator().manual_seed(15)
        out = []
        for rows, vocab, note in [(1, 32, "one word"), (1, 40, "a vocabulary that is not a multiple of 32"),
                                  (2, 64, ""), (3, 100, ""), *[(2, 70, "") for _ in range(10)]]:
            words = torch.randint(-2**31, 2**31, (rows, (vocab + 31) // 32), generator=generator,
                                  dtype=torch.int64).to(torch.int32)
            out.append(Case({"bitmask": words, "vocab_size": vocab}, unpack_bitmask(words, vocab), note))
        every = torch.tensor([[-1, 1]], dtype=torch.int32)  # every bit of the first word: -1 in int32
        out.append(Case({"bitmask": every, "vocab_size": 33}, unpack_bitmask(every, 33),
                        "bit 31 set: a negative word"))
        top = torch.tensor([[-2**31]], dtype=torch.int32)  # only bit 31: token 31
        out.append(Case({"bitmask": top, "vocab_size": 32}, unpack_bitmask(top, 32), "only token 31"))
        return out

    return run_cases("unpack_mask", fn, cases, same_value, "llm_runtime.structured_output.unpack_bitmask")


def _alternation(choices: list[str]) -> str:
    """A regex matching exactly one of `choices` (non-alphanumeric characters escaped)."""
    return "|".join("".join(c if c.isalnum() or c == " " else "\\" + c for c in choice) for choice in choices)


def check_choice_mask(fn: object) -> Verdict:
    """`choice_mask(choices, text, vocab) -> list[bool]`: the output must be exactly one of `choices` (strings)
    and `text` (bytes, the start of at least one of them) is what it holds so far. For each token of `vocab` (a
    list of bytes), True when text + token is still the start of (or all of) some choice; an empty token never.
    Without an automaton or a regex: an answer that uses one fails, however right its masks."""

    def cases() -> list[Case]:
        rng = random.Random(15)
        cities = ["Paris", "London", "Rome"]
        vocab = [b"P", b"Pa", b"Paris", b"Paris,", b"L", b"Lo", b"London", b"on", b"ondon", b"don", b"R", b"Rome",
                 b"", b"aris", b"ome", b" Paris", b"x"]
        inputs = [(cities, b"", vocab, "the start: every choice is open"),
                  (cities, b"L", vocab, "a token of several characters finishes the word"),
                  (cities, b"Lon", vocab, "one continuation left"),
                  (cities, b"London", vocab, "a choice complete: nothing may follow"),
                  (["cat", "catalog"], b"cat", [b"a", b"alog", b"al", b"s", b"cat", b"log", b""],
                   "one choice complete, a longer one still open"),
                  (["a-b", "a.c"], b"a", [b"-", b".", b"-b", b".c", b"x", b"b"], "punctuation in the choices")]
        for _ in range(30):
            choices = sorted({"".join(rng.choice("ab") for _ in range(rng.randint(1, 5))) for _ in range(3)})
            chosen = rng.choice(choices)
            text = chosen[: rng.randint(0, len(chosen))].encode()
            tokens = [bytes(rng.choice(b"ab") for _ in range(rng.randint(0, 3))) for _ in range(12)]
            inputs.append((choices, text, tokens, ""))
        out = []
        for choices, text, tokens, note in inputs:
            dfa = CharacterDFA(_alternation(choices))
            state = dfa.walk(dfa.start, text)
            assert state is not None, (choices, text)
            out.append(Case({"choices": choices, "text": text, "vocab": tokens},
                            token_mask(dfa, state, tokens).tolist(), note))
        return out

    return run_cases("choice_mask", fn, cases, same_value,
                     "llm_runtime.lessons.token_mask.token_mask (on the automaton of the choices)",
                     method=_without_an_automaton)


# What a choice's mask needs no automaton for: names that mean one was used (the lesson's, a regex engine's, a
# grammar compiler's). The task is the prefix test that an automaton generalises.
_AUTOMATON_NAMES = frozenset({"CharacterDFA", "token_mask", "walk", "re", "regex", "fullmatch", "xgrammar",
                              "GrammarCompiler", "GrammarState", "compile"})


def _names_used(code: types.CodeType) -> set[str]:
    """The global and attribute names a function's code (and the code of the functions inside it) refers to."""
    names = set(code.co_names)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            names |= _names_used(constant)
    return names


def _automaton_folders() -> tuple[str, ...]:
    """Where an automaton's or a regex's Python code lives: the lesson's, the `re` package, the engine's grammars
    and xgrammar (where installed)."""
    from ... import structured_output
    from .. import token_mask as lesson_automaton

    folders = [lesson_automaton.__file__, os.path.dirname(re.__file__) + os.sep,
               os.path.dirname(structured_output.__file__) + os.sep]
    spec = importlib.util.find_spec("xgrammar")
    if spec is not None and spec.submodule_search_locations:
        folders += [folder + os.sep for folder in spec.submodule_search_locations]
    return tuple(folders)


def _without_an_automaton(fn: object) -> Verdict | None:
    """None when `fn` neither names nor runs an automaton or a regex (names: read in its code; running: watched,
    so an alias such as `from ...token_mask import token_mask as tm` is caught too)."""
    case = Case({"choices": ["Paris", "London", "Rome"], "text": b"", "vocab": [b"P", b"Lon", b"x"]}, None,
                "any input: the way it is computed is the point")
    code = getattr(fn, "__code__", None)
    used = sorted(_names_used(code) & _AUTOMATON_NAMES) if isinstance(code, types.CodeType) else []
    if not used:
        watch = CallWatch(folders=_automaton_folders())
        try:
            with watch:
                fn(*case.args.values())  # type: ignore[operator]
        except Exception:  # its verdict on the cases was already given; here only the way it computes matters
            pass
        if not watch.reached:
            return None
        used = ["an automaton's or a regex's code (under another name)"]
    return method_verdict("choice_mask", case, "Every case agrees, but through an automaton or a regex: the task is "
                          "to do without one. A token may follow when text + token is the start of some choice.",
                          "byte comparisons of text + token with the choices",
                          f"it uses {', '.join(used)}")


def check_forced_text(fn: object) -> Verdict:
    """`forced_text(dfa, prefix) -> bytes`: `dfa` a `CharacterDFA` (`dfa.walk(dfa.start, prefix)` gives the state
    after `prefix`, `dfa.step(state, byte)` the next one, empty where no match is possible any more, and
    `dfa.accepts(state)` whether the text is a match). Return the bytes that must come next: take a byte while it
    is the only one that keeps a match possible and the text so far is not a match already; b"" if there is none."""

    def cases() -> list[Case]:
        record = r'\{"name": "[a-z]+", "age": \d+\}'
        inputs = [(record, b"", "the fixed opening of a record"),
                  (record, b'{"name": "bo', "inside a free string: nothing forced"),
                  (record, b'{"name": "bob"', "a closing quote, then the next key"),
                  (r"(cat|dog)s?", b"", "a choice at the start"), (r"(cat|dog)s?", b"c", ""),
                  (r"(cat|dog)s?", b"cat", "a match already: the s is optional"),
                  (r"\(\d{3}\) \d{3}-\d{4}", b"(555", ""), (r"\(\d{3}\) \d{3}-\d{4}", b"(555) 123", ""),
                  (r"abc(d|e)f", b"a", "stops before the choice"), (r"x+y", b"x", ""),
                  (r"(ab)*c", b"a", ""), (r"colou?r", b"col", "an optional letter")]
        out = []
        for pattern, prefix, note in inputs:
            dfa = CharacterDFA(pattern)
            out.append(Case({"dfa": dfa, "prefix": prefix}, forced_bytes(dfa, dfa.walk(dfa.start, prefix)), note))
        return out

    return run_cases("forced_text", fn, cases, same_value, "llm_runtime.lessons.token_mask.forced_bytes")
