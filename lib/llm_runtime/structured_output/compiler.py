"""Constraints compiled into grammars a matcher can follow token by token: `GrammarCompiler` (lesson 15).

xgrammar does the compiling: a JSON schema, a regex or an EBNF grammar becomes a pushdown automaton over
characters, and xgrammar precomputes, for each of its states, which of the vocabulary's tokens are always
allowed, always refused, or depend on the stack (most of the vocabulary falls in the first two, which is
what makes a step's mask cheap). A `choice` is compiled as the grammar `root ::= "a" | "b" | ...`;
`json_object` as the schema `{"type": "object"}` (OpenAI's meaning: any object, not any JSON value).

Compiling is where a hostile request could hurt: a schema of a megabyte, a grammar that takes seconds. So:
the constraint's text is refused above `max_spec_chars`; the compile runs on a worker thread and is refused
when it takes longer than `timeout_s` (the thread finishes on its own; xgrammar releases the GIL while it
works, so nothing else waits for it); and results are cached by constraint (`StructuredOutputsParams.key`),
so a thousand requests with one schema compile it once. The input processor calls `compile`; the server runs
the input processor on a worker thread, never on the event loop.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor, TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidRequestError
from ..model.tokenizer import Tokenizer
from ..sampling.structured_outputs import StructuredOutputsParams


@dataclass(frozen=True)
class CompiledGrammar:
    """A constraint compiled for one tokenizer: what each sequence's `GrammarState` starts from."""

    key: tuple[str, str, bool]  # StructuredOutputsParams.key
    compiled: Any  # xgrammar.CompiledGrammar
    vocab_size: int  # the logits' width the masks are made for (the model's vocabulary, padding included)


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


class GrammarCompiler:
    """Compiles `StructuredOutputsParams` for one tokenizer and vocabulary; thread-safe, bounded, cached."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...], *,
                 max_spec_chars: int = 65536, timeout_s: float = 10.0, cache_size: int = 256) -> None:
        import xgrammar  # here, not at import: `import llm_runtime` stays quick for lessons that never constrain

        self._xgr = xgrammar
        # Which string each token id stands for, byte-level decoded; ids past the tokenizer's vocabulary (a
        # padded head) are never allowed. Generation stops at the model's EOS tokens.
        self.tokenizer_info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                                      stop_token_ids=list(stop_token_ids))
        self._compiler = xgrammar.GrammarCompiler(self.tokenizer_info, max_threads=1, cache_enabled=False)
        self.vocab_size = vocab_size
        self.max_spec_chars = max_spec_chars
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str, bool], CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        # Two workers: one compile that runs past its deadline still leaves one for the next request.
        self._workers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-compile")
        self.num_compiled = 0  # compiles that ran (cache misses that succeeded)

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The grammar of `params`, from the cache or compiled now; InvalidRequestError naming the field when
        the constraint is too long, does not compile, or takes longer than `timeout_s` to."""
        if len(params.spec) > self.max_spec_chars:
            raise InvalidRequestError(params.param, f"{params.param} has {len(params.spec)} characters; at most "
                                                    f"{self.max_spec_chars} are compiled")
        with self._lock:
            cached = self._cache.get(params.key)
            if cached is not None:
                self._cache.move_to_end(params.key)
                return cached
        future = self._workers.submit(self._compile_now, params)
        try:
            compiled = future.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise InvalidRequestError(params.param, f"{params.param} did not compile within {self.timeout_s:g} s; "
                                                    f"simplify it") from None
        except (RuntimeError, ValueError, TypeError) as error:  # xgrammar's parse and schema errors
            message = _reason(error)
            raise InvalidRequestError(params.param, f"{params.param} does not compile: {message}") from None
        grammar = CompiledGrammar(params.key, compiled, self.vocab_size)
        with self._lock:
            self._cache[params.key] = grammar
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            self.num_compiled += 1
        return grammar

    def _compile_now(self, params: StructuredOutputsParams) -> Any:
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
