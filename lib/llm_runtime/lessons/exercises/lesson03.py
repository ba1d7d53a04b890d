"""Lesson 03 exercises: stop strings in a stream of text pieces, checked against the output processor.

Each token's text arrives as one piece (possibly empty, while a character is incomplete). The
checkers feed the same pieces to the package's `SequenceText` (`engine/output_processor.py`) through
a real `Sequence`, one token at a time, as the engine does.

- `stop_text(pieces, stop)`: the final text and the stop string that ended it.
- `stream_deltas(pieces, stop)`: the text a stream sends after each piece, never part of a stop string.
"""

from __future__ import annotations

import random

from ...engine.output_processor import SequenceText
from ...core.sequence import Sequence
from ...sampling import SamplingParams
from .check import Case, Verdict, run_cases, same_value


class _Pieces:
    """Stands in for `IncrementalDetokenizer`: token i decodes to pieces[i], nothing is held back."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def add(self, token_id: int) -> str:
        return self.pieces[token_id]

    def flush(self) -> str:
        return ""


def _run(pieces: list[str], stop: list[str]) -> tuple[str, str | None, list[str]]:
    """The package's answer: (final text, stop string or None, the delta sent after each piece handled)."""
    params = SamplingParams(stop=list(stop), max_tokens=len(pieces))
    seq = Sequence("exercise", [0], params, max_new_tokens=len(pieces))
    text = SequenceText(_Pieces(pieces), params)  # type: ignore[arg-type]
    deltas = []
    for token_id in range(len(pieces)):
        seq.append_token(token_id, now=0.0)  # the last piece finishes it by length
        text.append(seq, now=0.0)  # a stop string found here finishes it as stopped
        deltas.append(text.take_delta(seq.is_finished))
        if seq.is_finished:
            break
    stop_reason = seq.stop_reason if isinstance(seq.stop_reason, str) else None
    return text.text, stop_reason, deltas


def _stop_strings(rng: random.Random, alphabet: str) -> list[str]:
    """0 to 2 distinct stop strings, none a prefix of another (so at most one can match at a position)."""
    stops: list[str] = []
    for _ in range(rng.choice([0, 1, 1, 2, 2])):
        candidate = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
        if not any(candidate.startswith(s) or s.startswith(candidate) for s in stops):
            stops.append(candidate)
    return stops


_HAND_CASES = [
    (["The", " capital", " of", " Fr", "ance", " is"], [" France"], "a stop string split across two pieces"),
    (["a", "b", "c", "d"], ["bcd"], "a stop string over three pieces"),
    (["xy", "", "zx", "y"], ["zxy", "q"], "an empty piece (an incomplete character)"),
    (["Hello", " world"], [], "no stop strings"),
    (["x", "bzay"], ["ay", "bz"], "two stop strings end in the same piece: the earlier one wins"),
    (["no", " stop", " here"], ["STOP"], "a stop string that never comes"),
]


def _cases(answer: int) -> list[Case]:
    rng = random.Random(3)
    inputs = list(_HAND_CASES)
    while len(inputs) < 60:
        alphabet = rng.choice(["ab", "abc"])
        pieces = ["".join(rng.choice(alphabet) for _ in range(rng.choice([0, 1, 1, 2, 3])))
                  for _ in range(rng.randint(1, 8))]
        inputs.append((pieces, _stop_strings(rng, alphabet), ""))
    out = []
    for pieces, stop, note in inputs:
        final_text, stop_reason, deltas = _run(pieces, stop)
        expected = (final_text, stop_reason) if answer == 0 else deltas
        out.append(Case({"pieces": pieces, "stop": stop}, expected, note))
    return out


def check_stop_text(fn: object) -> Verdict:
    """`stop_text(pieces, stop) -> (text, stop_reason)`: `pieces` (list of str) is the text of each new
    token in order, `stop` a list of stop strings. After each piece, if a stop string now occurs in the
    text, the request ends: the text is cut just before the earliest occurrence (the stop string is
    not output) and `stop_reason` is that stop string. Otherwise the text is every piece joined and
    `stop_reason` is None. Pieces after the stop are never generated."""
    return run_cases("stop_text", fn, lambda: _cases(0), same_value,
                     "llm_runtime.engine.output_processor.SequenceText")


def check_stream_deltas(fn: object) -> Verdict:
    """`stream_deltas(pieces, stop) -> list[str]`: what a stream sends after each piece, one string per
    piece handled (the last one is the piece that ended the request: a stop string or the last piece).
    While the request runs, the last len(longest stop string) - 1 characters are held back (they could
    be the start of a stop string); when it ends, everything left of the (cut) text goes out. The
    deltas joined equal `stop_text`'s text."""
    return run_cases("stream_deltas", fn, lambda: _cases(1), same_value,
                     "llm_runtime.engine.output_processor.SequenceText.take_delta")
