"""Structured output (lesson 15): constraints compiled into grammars (`compiler.py`), one matcher per constrained
sequence (`grammar_state.py`), and the per-step token masks applied to the logits (`bitmask.py`). xgrammar
does the compiling and the matching; the engine decides when masks are filled, how drafts and forced tokens
go through the speculative path, and what the sampler sees."""

from .bitmask import apply_bitmask, unpack_bitmask
from .compiler import CompiledGrammar, GrammarCompiler, PendingGrammar, choice_grammar
from .grammar_state import GrammarState, allocate_bitmask

__all__ = [
    "CompiledGrammar",
    "GrammarCompiler",
    "GrammarState",
    "PendingGrammar",
    "allocate_bitmask",
    "apply_bitmask",
    "choice_grammar",
    "unpack_bitmask",
]
