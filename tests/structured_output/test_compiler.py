"""Compiling constraints (structured_output/compiler.py): every kind compiles for the bundled tokenizer; a bad
schema, regex or grammar, an over-long one or one too slow to compile is refused naming its field; the cache
compiles a constraint once; choices are escaped so the grammar accepts exactly the strings given."""

from __future__ import annotations

import threading
import time

import pytest

from llm_runtime import InvalidRequestError
from llm_runtime.sampling import StructuredOutputsParams as Params
from llm_runtime.structured_output import GrammarCompiler, choice_grammar

xgrammar = pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def compiler(bundled_tokenizer) -> GrammarCompiler:
    return GrammarCompiler(bundled_tokenizer, 49152, (bundled_tokenizer.eos_token_id,), max_spec_chars=4096)


def accepts(compiled, text: str) -> bool:
    """Whether the grammar takes `text` and is then complete (may end there)."""
    matcher = xgrammar.GrammarMatcher(compiled.compiled)
    return matcher.accept_string(text) and matcher.is_completed()


@pytest.mark.parametrize("params, good, bad", [
    (Params(json=SCHEMA), '{"name": "Ann", "age": 3}', '{"name": "Ann"}'),
    (Params(json=SCHEMA, disable_any_whitespace=True), '{"name": "Ann", "age": 3}', '{ "name": "Ann", "age": 3}'),
    (Params(json_object=True), '{"a": [1, 2]}', "[1, 2]"),
    (Params(regex=r"\d{3}-\d{4}"), "555-1234", "5555-123"),
    (Params(choice=["yes", "no"]), "no", "maybe"),
    (Params(grammar='root ::= "(" [a-z]+ ")"'), "(abc)", "(ABC)"),
])
def test_every_kind_compiles_to_the_strings_it_describes(compiler, params, good: str, bad: str) -> None:
    compiled = compiler.compile(params)
    assert accepts(compiled, good) and not accepts(compiled, bad)


def test_choices_with_quotes_backslashes_newlines_and_unicode_are_taken_exactly(compiler) -> None:
    choices = ['say "hi"', "back\\slash", "two\nlines", "naïve ☃", "tab\there"]
    compiled = compiler.compile(Params(choice=choices))
    assert all(accepts(compiled, choice) for choice in choices)
    assert not accepts(compiled, "say hi") and not accepts(compiled, "backslash")
    assert choice_grammar(["a"]) == 'root ::= "a"'


@pytest.mark.parametrize("params, field, reason", [
    (Params(json='{"type": "object", "properties": {"a": {"type": "nonsense"}}}'), "structured_outputs.json",
     'Unsupported type "nonsense"'),
    (Params(regex="(unclosed"), "structured_outputs.regex", "The parenthesis is not closed"),
    (Params(grammar="root ::= missing_rule"), "structured_outputs.grammar", 'Rule "missing_rule" is not defined'),
    (Params(grammar="this is not ebnf"), "structured_outputs.grammar", "EBNF parser error"),
    (Params(regex="a" * 5000), "structured_outputs.regex", "at most 4096 are compiled"),
])
def test_a_bad_or_oversized_constraint_is_refused_naming_its_field(compiler, params, field: str, reason: str) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        compiler.compile(params)
    assert refused.value.param == field
    # The reason as xgrammar gives it, without its log prefix (a time and a C++ source line).
    assert reason in str(refused.value) and ".cc:" not in str(refused.value)


def test_a_constraint_compiles_once_and_the_cache_is_bounded(bundled_tokenizer) -> None:
    compiler = GrammarCompiler(bundled_tokenizer, 49152, (2,), cache_size=2)
    first = compiler.compile(Params(regex="a+"))
    assert compiler.compile(Params(regex="a+")) is first and compiler.num_compiled == 1
    compiler.compile(Params(regex="b+"))
    compiler.compile(Params(regex="c+"))  # evicts a+, the least recently used
    assert compiler.compile(Params(regex="a+")) is not first and compiler.num_compiled == 4


def test_a_compile_past_its_deadline_is_refused_and_others_go_on(bundled_tokenizer, monkeypatch) -> None:
    compiler = GrammarCompiler(bundled_tokenizer, 49152, (2,), timeout_s=0.2)
    real = compiler._compile_now
    release = threading.Event()

    def slow(params):
        if params.regex == "slow":
            release.wait(5)
        return real(params)

    monkeypatch.setattr(compiler, "_compile_now", slow)
    started = time.perf_counter()
    with pytest.raises(InvalidRequestError, match="did not compile within") as refused:
        compiler.compile(Params(regex="slow"))
    assert refused.value.param == "structured_outputs.regex" and time.perf_counter() - started < 2
    assert compiler.compile(Params(regex="fast")) is not None  # the second worker is free
    release.set()
