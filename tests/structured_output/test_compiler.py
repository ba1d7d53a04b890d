"""Compiling constraints (structured_output/compiler.py): every kind compiles for the bundled tokenizer; a bad
schema, regex or grammar, an over-long one or one too slow to compile is refused naming its field; the cache
compiles a constraint once; choices are escaped so the grammar accepts exactly the strings given. Under load:
one compile per distinct constraint, shared by a burst of requests; a bound on compiles in flight (busy past it);
a compile past its deadline abandoned, counted once, its constraint refused at once afterwards and its late
result dropped; one left queued past its bound cancelled as busy; a constraint that does not compile is not
compiled again; the cache bounded by the bytes its grammars hold."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

import pytest

from llm_runtime import InvalidRequestError
from llm_runtime.errors import EngineBusyError
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
    # JSON as an encoder writes it by default; any whitespace only when asked (vLLM's default)
    (Params(json=SCHEMA), '{"name": "Ann", "age": 3}', '{\n  "name": "Ann",\n  "age": 3\n}'),
    (Params(json=SCHEMA, disable_any_whitespace=False), '{\n  "name": "Ann",\n  "age": 3\n}', '{"name": "Ann"}'),
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


def test_the_cache_is_bounded_by_the_bytes_its_grammars_hold(bundled_tokenizer) -> None:
    """Fresh large schemas must not fill memory: before, 256 cached grammars of 51 MB each (a schema of 200
    patterned properties) could be kept."""
    compiler = GrammarCompiler(bundled_tokenizer, 49152, (2,))
    sizes = {regex: compiler.compile(Params(regex=regex)).nbytes for regex in ("a+", "b+", "c+")}
    assert all(size > 0 for size in sizes.values()) and compiler.cached_bytes == sum(sizes.values())
    small = GrammarCompiler(bundled_tokenizer, 49152, (2,), cache_bytes=sizes["a+"] + sizes["b+"])
    first = small.compile(Params(regex="a+"))
    small.compile(Params(regex="b+"))
    small.compile(Params(regex="c+"))  # past the budget: a+, the least recently used, goes
    assert small.cached_bytes <= small.cache_bytes and small.compile(Params(regex="a+")) is not first
    tiny = GrammarCompiler(bundled_tokenizer, 49152, (2,), cache_bytes=1)  # no grammar fits: served, not kept
    assert tiny.compile(Params(regex="a+")) is not None and tiny.cached_bytes == 0
    assert tiny.compile(Params(regex="a+")) is not None and tiny.num_compiled == 2


def test_a_grammar_nobody_holds_is_freed_at_once(bundled_tokenizer) -> None:
    """Without waiting for the garbage collector: before, each compile's future and its callback held each other,
    so every uncached grammar (51 MB for a large schema) lived on until a full collection (a soak of fresh
    schemas grew a server by 500 MB in two minutes)."""
    compiler = GrammarCompiler(bundled_tokenizer, 49152, (2,), cache_bytes=1)  # nothing is cached
    gc.disable()
    try:
        grammar = compiler.compile(Params(regex="[a-z]+@[a-z]+"))
        freed = weakref.ref(grammar)
        del grammar
        deadline = time.monotonic() + 2  # the worker's frame lets go of it a moment after the waiter wakes
        while freed() is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert freed() is None
    finally:
        gc.enable()


def test_a_compile_left_queued_past_its_bound_is_cancelled_as_busy(bundled_tokenizer, monkeypatch) -> None:
    """Both workers held by slow compiles: a constraint queued behind them waits `queue_timeout_s`, then it and
    everyone sharing it get EngineBusyError (the server's 503), and its place in the bound is freed."""
    compiler = GrammarCompiler(bundled_tokenizer, 49152, (2,), timeout_s=30, queue_timeout_s=0.3)
    release, runs = _gated(compiler, monkeypatch, {"slow+", "slower+"})
    slow = [compiler.submit(Params(regex=regex)) for regex in ("slow+", "slower+")]
    queued, sharing = compiler.submit(Params(regex="queued+")), compiler.submit(Params(regex="queued+"))
    started = time.perf_counter()
    with pytest.raises(EngineBusyError, match="waited .* for one of the grammar compiler's workers"):
        queued.result()
    assert time.perf_counter() - started < 5
    with pytest.raises(EngineBusyError):
        asyncio.run(sharing.wait())
    assert compiler.num_pending == 2  # the slow ones only
    release.set()
    assert all(pending.result() is not None for pending in slow)
    assert compiler.compile(Params(regex="queued+")) is not None and runs.count("queued+") == 1  # not refused


def _gated(compiler: GrammarCompiler, monkeypatch, slow: set[str]) -> tuple[threading.Event, list[str]]:
    """Make compiles of the regexes in `slow` wait for the returned event; the list records every compile run."""
    real, release, runs = compiler._compile_now, threading.Event(), []

    def compile_now(params):
        runs.append(params.spec)
        if params.regex in slow:
            release.wait(30)
        return real(params)

    monkeypatch.setattr(compiler, "_compile_now", compile_now)
    return release, runs


def test_a_compile_past_its_deadline_is_abandoned_and_others_go_on(bundled_tokenizer, monkeypatch) -> None:
    compiler = GrammarCompiler(bundled_tokenizer, 49152, (2,), timeout_s=0.2)
    release, runs = _gated(compiler, monkeypatch, {"slow"})
    started = time.perf_counter()
    with pytest.raises(InvalidRequestError, match="did not compile within") as refused:
        compiler.compile(Params(regex="slow"))
    assert refused.value.param == "structured_outputs.regex" and time.perf_counter() - started < 2
    assert compiler.num_abandoned == 1 and compiler.num_pending == 1  # still running: it cannot be stopped
    assert compiler.compile(Params(regex="fast")) is not None  # the second worker is free
    with pytest.raises(InvalidRequestError, match="did not compile within"):  # refused at once, not compiled again
        compiler.submit(Params(regex="slow"))
    release.set()
    deadline = time.monotonic() + 10
    while compiler.num_pending and time.monotonic() < deadline:
        time.sleep(0.01)
    assert compiler.num_pending == 0 and runs.count("slow") == 1
    with pytest.raises(InvalidRequestError, match="did not compile within"):  # its late result was dropped
        compiler.submit(Params(regex="slow"))
    assert compiler.num_abandoned == 1 and compiler.num_compiled == 1


def test_a_burst_with_one_new_constraint_compiles_it_once(bundled_tokenizer, monkeypatch) -> None:
    """100 requests with one schema arrive while it compiles: they all wait for the one compile and get its
    grammar; before, each ran its own (and the late ones were refused for a schema that compiles)."""
    compiler = GrammarCompiler(bundled_tokenizer, 49152, (2,), timeout_s=20)
    release, runs = _gated(compiler, monkeypatch, {"[a-z]{1,8}@[a-z]{1,8}"})
    params = Params(regex="[a-z]{1,8}@[a-z]{1,8}")
    pending = [compiler.submit(params) for _ in range(100)]  # returns at once: nobody waits on this thread
    with ThreadPoolExecutor(max_workers=16) as pool:
        waiting = [pool.submit(grammar.result) for grammar in pending]
        time.sleep(0.2)
        assert not any(future.done() for future in waiting)
        release.set()
        grammars = [future.result(timeout=30) for future in waiting]
    assert len({id(grammar) for grammar in grammars}) == 1 and runs == [params.spec]
    assert compiler.num_compiled == 1 and compiler.num_shared == 99 and compiler.num_pending == 0


def test_compiles_in_flight_are_bounded(bundled_tokenizer, monkeypatch) -> None:
    compiler = GrammarCompiler(bundled_tokenizer, 49152, (2,), timeout_s=20, max_pending=2)
    release, _ = _gated(compiler, monkeypatch, {"a+", "b+", "c+"})
    first, second = compiler.submit(Params(regex="a+")), compiler.submit(Params(regex="b+"))
    compiler.submit(Params(regex="a+"))  # joins the first: no new compile
    with pytest.raises(EngineBusyError, match="being compiled already"):
        compiler.submit(Params(regex="c+"))
    release.set()
    assert first.result() is not None and second.result() is not None
    assert compiler.submit(Params(regex="c+")).result() is not None  # room again
    assert compiler.num_compiled == 3


def test_a_constraint_that_does_not_compile_is_refused_again_without_compiling(bundled_tokenizer,
                                                                               monkeypatch) -> None:
    compiler = GrammarCompiler(bundled_tokenizer, 49152, (2,))
    _, runs = _gated(compiler, monkeypatch, set())
    for _ in range(3):
        with pytest.raises(InvalidRequestError, match="does not compile") as refused:
            compiler.compile(Params(regex="(unclosed"))
        assert refused.value.param == "structured_outputs.regex"
    assert runs == ["(unclosed"] and compiler.num_compiled == 0


def test_a_constraint_queued_behind_slow_ones_gets_its_own_time(bundled_tokenizer, monkeypatch) -> None:
    """Two slow constraints (another client's) hold both workers past their deadline; a third, queued behind them,
    is not refused for their slowness: its clock starts when a worker takes it, and it compiles."""
    compiler = GrammarCompiler(bundled_tokenizer, 49152, (2,), timeout_s=0.3)
    release, runs = _gated(compiler, monkeypatch, {"slow+", "slower+"})
    slow = [compiler.submit(Params(regex=regex)) for regex in ("slow+", "slower+")]
    queued = compiler.submit(Params(regex="queued+"))
    for pending in slow:
        with pytest.raises(InvalidRequestError, match="did not compile within"):
            pending.result()
    threading.Timer(0.5, release.set).start()  # the slow ones end later still: the queued one waits, then runs
    assert queued.result() is not None and compiler.num_abandoned == 2 and runs[-1] == "queued+"
