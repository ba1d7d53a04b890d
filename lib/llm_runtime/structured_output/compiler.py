"""Constraints compiled into grammars a matcher can follow token by token: `GrammarCompiler` (lesson 15).

xgrammar does the compiling: a JSON schema, a regex or an EBNF grammar becomes a pushdown automaton over
characters, and xgrammar precomputes, for each of its states, which of the vocabulary's tokens are always
allowed, always refused, or depend on the stack (most of the vocabulary falls in the first two, which is
what makes a step's mask cheap). A `choice` is compiled as the grammar `root ::= "a" | "b" | ...`;
`json_object` as the schema `{"type": "object"}` (OpenAI's meaning: any object, not any JSON value).

Compiling is where a hostile request could hurt: a schema of a megabyte, a grammar that takes seconds, a
thousand requests with fresh schemas at once. So (as vLLM V1's structured-output manager does it):

- the constraint's text is refused above `max_spec_chars`;
- `submit` never compiles on the caller's thread: it hands back a `PendingGrammar`, which the caller waits on
  where waiting holds up nobody else (the server awaits it on its event loop; `LLMEngine.add_request`, which is
  synchronous anyway, blocks on it), so tokenizing other requests never waits for a compile;
- one compile per distinct constraint (`StructuredOutputsParams.key`) is in flight, shared by every request
  that waits for it: a burst of a hundred requests with one new schema compiles it once; results are cached, and
  so are refusals (a schema that does not compile is not compiled again);
- at most `max_pending` compiles are queued or running: past that, `submit` raises EngineBusyError (the server's
  503), so a flood of fresh schemas holds a bounded amount of work;
- a compile still running `timeout_s` after it started is abandoned: everyone waiting for it is refused, it is
  counted (`num_abandoned`), its constraint is refused at once from then on, and its result is dropped when it
  finishes (xgrammar cannot be stopped midway; it still counts against `max_pending` until it ends). The deadline
  counts from the start, not from the submission: a constraint queued behind two slow ones (another client's)
  is not refused for their slowness. It is not left waiting for ever either: a compile still queued
  `queue_timeout_s` after it was submitted is cancelled and its requests get EngineBusyError (503, retry later);
- compiled grammars are cached up to `cache_bytes` (xgrammar's own measure of each), not a count: a schema of
  two hundred patterned properties compiles to 51 MB, so a count would let fresh large schemas fill memory.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor, TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from ..errors import EngineBusyError, InvalidRequestError
from ..model.tokenizer import Tokenizer
from ..sampling.structured_outputs import StructuredOutputsParams


@dataclass(frozen=True)
class CompiledGrammar:
    """A constraint compiled for one tokenizer: what each sequence's `GrammarState` starts from."""

    key: tuple[str, str, bool]  # StructuredOutputsParams.key
    compiled: Any  # xgrammar.CompiledGrammar
    vocab_size: int  # the logits' width the masks are made for (the model's vocabulary, padding included)

    @property
    def nbytes(self) -> int:
        """The memory the compiled grammar holds, as xgrammar measures it (an xgrammar too old to measure: 1 MiB,
        so the cache's byte bound still bounds how many it keeps)."""
        return int(getattr(self.compiled, "memory_size_bytes", 1 << 20))


def choice_grammar(choices: list[str]) -> str:
    """The EBNF grammar whose strings are exactly `choices`: root ::= "yes" | "no"."""
    return "root ::= " + " | ".join(_ebnf_string(choice) for choice in choices)


def _ebnf_string(text: str) -> str:
    """A quoted EBNF literal: backslash, quote and control characters escaped, the rest as it is."""
    return json.dumps(text, ensure_ascii=False)


# xgrammar's errors open with a time and the C++ source line that raised them: "[17:57:45] /project/cpp/x.cc:94: "
_LOG_PREFIX = re.compile(r"^\[[0-9:.]+\] \S+:[0-9]+: ")


def _reason(error: Exception) -> str:
    """The first line of a compile error, without xgrammar's log prefix: what the client should fix."""
    text = str(error).strip()
    return _LOG_PREFIX.sub("", text.splitlines()[0]) if text else type(error).__name__


class PendingGrammar:
    """A grammar being compiled (or already compiled) for one request: `result()` blocks, `wait()` awaits. Requests
    with the same constraint share the compile behind it, and its deadline."""

    def __init__(self, compiler: "GrammarCompiler", params: StructuredOutputsParams, job: "_Compile") -> None:
        self._compiler, self._params, self._job = compiler, params, job

    def result(self) -> CompiledGrammar:
        """The compiled grammar; InvalidRequestError when it does not compile or runs past its deadline,
        EngineBusyError when it waited past `queue_timeout_s` for a worker."""
        job = self._job
        while True:
            try:
                return job.future.result(timeout=self._wait_s())
            except FutureTimeout:
                self._check_deadlines()
            except CancelledError:
                raise self._compiler._cancelled(self._params.key, job) from None

    async def wait(self) -> CompiledGrammar:
        """`result()` for a coroutine: the event loop serves everyone else meanwhile."""
        job = self._job
        compiled = asyncio.wrap_future(job.future)
        while True:
            try:  # shielded: one waiter's timeout must not cancel the compile that the other waiters share
                return await asyncio.wait_for(asyncio.shield(compiled), self._wait_s())
            except asyncio.TimeoutError:
                self._check_deadlines()
            except asyncio.CancelledError:
                if not job.future.cancelled():
                    raise  # this waiter was cancelled, not the compile
                raise self._compiler._cancelled(self._params.key, job) from None

    def _wait_s(self) -> float:
        """How long to wait before looking again: to the deadline once the compile runs; a short poll while it is
        queued (a worker may take it any moment, and its deadline starts then)."""
        deadline = self._job.deadline(self._compiler.timeout_s)
        return _QUEUED_POLL_S if deadline is None else max(0.0, deadline - time.monotonic())

    def _check_deadlines(self) -> None:
        """Raise if the compile ran past its deadline (abandoned), or waited in the queue past its bound
        (cancelled); otherwise return, to wait on."""
        job, compiler, now = self._job, self._compiler, time.monotonic()
        deadline = job.deadline(compiler.timeout_s)
        if deadline is not None and now >= deadline:
            raise compiler._abandon(self._params, job)
        if job.started is None and now >= job.queued_at + compiler.queue_timeout_s and job.future.cancel():
            raise compiler._cancelled(self._params.key, job)


_QUEUED_POLL_S = 0.05  # how often a waiter looks whether a queued compile has started (its deadline with it)


@dataclass(eq=False)
class _Compile:
    """One compile in flight: its future, when a worker started it (time.monotonic(); None while it is queued),
    whether it was abandoned, and when it was submitted."""

    future: Future
    started: float | None = None
    abandoned: bool = False
    queued_at: float = field(default_factory=time.monotonic)

    def deadline(self, timeout_s: float) -> float | None:
        """When it is abandoned (None while queued: its time in the queue is not its own)."""
        return None if self.started is None else self.started + timeout_s


class GrammarCompiler:

    """Compiles `StructuredOutputsParams` for one tokenizer and vocabulary; thread-safe, bounded, cached."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...], *,
                 max_spec_chars: int = 65536, timeout_s: float = 10.0, queue_timeout_s: float = 30.0,
                 cache_size: int = 256, cache_bytes: int = 256 << 20, max_pending: int = 8) -> None:
        import xgrammar  # here, not at import: `import llm_runtime` stays quick for lessons that never constrain

        self._xgr = xgrammar
        # Which string each token id stands for, byte-level decoded; ids past the tokenizer's vocabulary (a
        # padded head) are never allowed. Generation stops at the model's EOS tokens.
        self.tokenizer_info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                                      stop_token_ids=list(stop_token_ids))
        self._compiler = xgrammar.GrammarCompiler(self.tokenizer_info, max_threads=1, cache_enabled=False)
        self.vocab_size = vocab_size
        self.max_spec_chars = max_spec_chars
        self.timeout_s, self.queue_timeout_s = timeout_s, queue_timeout_s
        self.cache_size, self.cache_bytes = cache_size, cache_bytes
        self._cached_bytes = 0  # xgrammar's memory_size_bytes of the grammars in _cache
        self.max_pending = max_pending
        self._cache: OrderedDict[tuple[str, str, bool], CompiledGrammar] = OrderedDict()
        # Constraints refused once (they do not compile, or compiled too slowly): refused again without compiling.
        self._refused: OrderedDict[tuple[str, str, bool], str] = OrderedDict()
        self._pending: dict[tuple[str, str, bool], _Compile] = {}  # compiles that requests may still join
        self._num_in_flight = 0  # compiles queued or running, abandoned ones included (what max_pending bounds)
        self._lock = threading.Lock()
        # Two workers: one compile that runs past its deadline still leaves one for the next request.
        self._workers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-compile")
        self.num_compiled = 0  # compiles that ran and succeeded in time (cache misses)
        self.num_abandoned = 0  # compiles that ran past their deadline (their requests refused)
        self.num_shared = 0  # requests that waited for a compile another request had started

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The grammar of `params`, from the cache or compiled now, waiting on this thread (`submit` says what is
        refused, and how)."""
        return self.submit(params).result()

    def submit(self, params: StructuredOutputsParams) -> PendingGrammar:
        """The grammar of `params` as it will be: from the cache, from the compile another request started, or from
        a compile started now. Raises at once InvalidRequestError naming the field (too long, refused before) or
        EngineBusyError (`max_pending` compiles in flight); the pending grammar raises InvalidRequestError when the
        constraint does not compile, or not within `timeout_s`."""
        if len(params.spec) > self.max_spec_chars:
            raise InvalidRequestError(params.param, f"{params.param} has {len(params.spec)} characters; at most "
                                                    f"{self.max_spec_chars} are compiled")
        key = params.key
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                done: Future = Future()
                done.set_result(cached)
                return PendingGrammar(self, params, _Compile(done))
            reason = self._refused.get(key)
            if reason is not None:
                self._refused.move_to_end(key)
                raise InvalidRequestError(params.param, reason)
            job = self._pending.get(key)
            if job is not None:
                self.num_shared += 1
                return PendingGrammar(self, params, job)
            if self._num_in_flight >= self.max_pending:
                raise EngineBusyError(f"{self._num_in_flight} constraints are being compiled already; retry later")
            job = _Compile(Future())  # (the worker's future replaces this one: the job must exist before it runs)
            job.future = self._workers.submit(self._run, job, params)
            self._pending[key] = job
            self._num_in_flight += 1
        return PendingGrammar(self, params, job)

    def _ended(self, key: tuple[str, str, bool], job: _Compile, grammar: CompiledGrammar | None = None,
               refusal: str | None = None) -> None:
        """A compile ended, on its worker, before its future is set (so whoever it wakes sees the counts and the
        cache as they will be): the cache keeps a grammar made in time, the refusals a constraint that does not
        compile; an abandoned compile's result is dropped. (Not a done callback on the future: the future would
        hold the callback and the callback the job that holds the future, a reference cycle, and every dropped
        grammar, 51 MB for a large schema, would live on until the garbage collector's next full pass.)"""
        with self._lock:
            self._num_in_flight -= 1
            if self._pending.get(key) is job:
                del self._pending[key]
            if job.abandoned:
                return
            if grammar is not None:
                self._keep(key, grammar)
                self.num_compiled += 1
            elif refusal is not None:
                self._refused[key] = refusal
                self._trim(self._refused)

    def _cancelled(self, key: tuple[str, str, bool], job: _Compile) -> EngineBusyError:
        """A waiter cancelled `job` while it was queued (no worker will run it): its place is freed (once, however
        many waiters see it cancelled); the error for the waiter to raise."""
        with self._lock:
            if self._pending.get(key) is job:
                del self._pending[key]
                self._num_in_flight -= 1
        return EngineBusyError(f"a constraint waited {time.monotonic() - job.queued_at:.0f} s for one of the "
                               f"grammar compiler's workers; retry later")

    def _abandon(self, params: StructuredOutputsParams, job: _Compile) -> InvalidRequestError:
        """A waiter saw `job` pass its deadline: abandon it (once), refuse its constraint from now on; the error for
        the waiter to raise."""
        message = f"{params.param} did not compile within {self.timeout_s:g} s; simplify it"
        with self._lock:
            if not job.abandoned and not job.future.done():
                job.abandoned = True
                self.num_abandoned += 1
                if self._pending.get(params.key) is job:
                    del self._pending[params.key]
                self._refused[params.key] = message
                self._trim(self._refused)
        return InvalidRequestError(params.param, message)

    def _keep(self, key: tuple[str, str, bool], grammar: CompiledGrammar) -> None:
        """Cache `grammar` (under the lock), evicting the least recently used past `cache_size` or `cache_bytes`;
        one larger than the whole budget is served to its requests but not kept."""
        size = grammar.nbytes
        if size > self.cache_bytes:
            return
        replaced = self._cache.pop(key, None)
        self._cached_bytes -= 0 if replaced is None else replaced.nbytes
        self._cache[key] = grammar
        self._cached_bytes += size
        while len(self._cache) > self.cache_size or self._cached_bytes > self.cache_bytes:
            self._cached_bytes -= self._cache.popitem(last=False)[1].nbytes

    def _trim(self, table: OrderedDict) -> None:
        while len(table) > self.cache_size:
            table.popitem(last=False)

    @property
    def cached_bytes(self) -> int:
        """xgrammar's measure of the grammars the cache holds now."""
        with self._lock:
            return self._cached_bytes

    @property
    def num_pending(self) -> int:
        """Compiles queued or running now (abandoned ones included, until they end)."""
        with self._lock:
            return self._num_in_flight

    def _run(self, job: _Compile, params: StructuredOutputsParams) -> CompiledGrammar:
        """On a worker: the compile's clock starts now (its deadline with it)."""
        job.started = time.monotonic()
        try:
            grammar = self._compile_now(params)
        except InvalidRequestError as error:
            self._ended(params.key, job, refusal=str(error))
            raise
        except BaseException:
            self._ended(params.key, job)
            raise
        self._ended(params.key, job, grammar)
        return grammar

    def _compile_now(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """Compile on a worker; xgrammar's parse and schema errors become InvalidRequestError naming the field."""
        try:
            compiled = self._xgrammar_compile(params)
        except (RuntimeError, ValueError, TypeError) as error:
            raise InvalidRequestError(params.param, f"{params.param} does not compile: {_reason(error)}") from None
        return CompiledGrammar(params.key, compiled, self.vocab_size)

    def _xgrammar_compile(self, params: StructuredOutputsParams) -> Any:
        compiler, any_whitespace = self._compiler, not params.disable_any_whitespace
        kind = params.kind
        if kind == "json":
            return compiler.compile_json_schema(params.json, any_whitespace=any_whitespace, strict_mode=True)
        if kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_whitespace)
        if kind == "regex":
            return compiler.compile_regex(params.regex)
        if kind == "choice":
            return compiler.compile_grammar(choice_grammar(params.choice))
        return compiler.compile_grammar(params.grammar)

    def close(self) -> None:
        """Stop the workers (a compile in flight finishes first)."""
        self._workers.shutdown(wait=False, cancel_futures=True)
