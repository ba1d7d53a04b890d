"""A token mask by hand (lesson 15): a regular expression to a character automaton, then to the set of tokens
allowed next.

    dfa = CharacterDFA(r"\\(\\d{3}\\) \\d{3}-\\d{4}")
    state = dfa.walk(dfa.start, b"(555) ")          # None once the text can no longer match
    allowed = token_mask(dfa, state, vocab)          # (len(vocab),) bool: tokens that keep a match possible
    forced_bytes(dfa, state)                         # b"" or the text the pattern fixes next (jump-forward)

The automaton reads bytes, as the vocabulary's tokens are byte strings: a token is allowed if walking all of
its bytes from the current state never leaves the automaton, and one token may cross several states on the
way (which is why the mask is not a lookup of the next character). The regex dialect is small: literals,
`.`, classes (`[a-z0-9_]`, `[^...]`), `\\d \\w \\s` and escaped punctuation, groups, `|`, `* + ?` and
`{m}`, `{m,}`, `{m,n}`; ASCII only in classes. The engine's masks come from xgrammar (`structured_output/`),
which compiles the same idea ahead of time for every state and splits the vocabulary into the tokens whose
fate a state decides at once and the few it must walk; the lesson checks that both give the same mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

Node = tuple  # ("set", frozenset[int]) | ("cat", list[Node]) | ("alt", list[Node]) | ("rep", Node, int, int | None)
_CLASSES = {"d": frozenset(range(48, 58)),
            "w": frozenset([*range(48, 58), *range(65, 91), *range(97, 123), 95]),
            "s": frozenset(b" \t\n\r\f\v")}
ANY_BYTE_BUT_NEWLINE = frozenset(range(256)) - {10}


class _Parser:
    """Recursive descent over the pattern: alternation, then concatenation, then repetition of an atom."""

    def __init__(self, pattern: str) -> None:
        self.text, self.i = pattern, 0

    def parse(self) -> Node:
        node = self._alt()
        if self.i != len(self.text):
            raise ValueError(f"unexpected {self.text[self.i]!r} at {self.i} in {self.text!r}")
        return node

    def _peek(self) -> str | None:
        return self.text[self.i] if self.i < len(self.text) else None

    def _take(self) -> str:
        if self.i >= len(self.text):
            raise ValueError(f"the pattern {self.text!r} ends too early")
        self.i += 1
        return self.text[self.i - 1]

    def _alt(self) -> Node:
        options = [self._cat()]
        while self._peek() == "|":
            self._take()
            options.append(self._cat())
        return options[0] if len(options) == 1 else ("alt", options)

    def _cat(self) -> Node:
        parts = []
        while self._peek() not in (None, "|", ")"):
            parts.append(self._repeat())
        return ("cat", parts)

    def _repeat(self) -> Node:
        node = self._atom()
        while self._peek() in ("*", "+", "?", "{"):
            op = self._take()
            if op == "{":
                close = self.text.index("}", self.i)
                low, _, high = self.text[self.i:close].partition(",")
                bounds = (int(low), int(low)) if "," not in self.text[self.i:close] else (
                    int(low), int(high) if high else None)
                self.i = close + 1
            else:
                bounds = {"*": (0, None), "+": (1, None), "?": (0, 1)}[op]
            node = ("rep", node, *bounds)
        return node

    def _atom(self) -> Node:
        char = self._take()
        if char == "(":
            node = self._alt()
            if self._take() != ")":
                raise ValueError(f"unclosed group in {self.text!r}")
            return node
        if char == "[":
            return ("set", self._class())
        if char == ".":
            return ("set", ANY_BYTE_BUT_NEWLINE)
        if char == "\\":
            escaped = self._take()
            if escaped in _CLASSES:
                return ("set", _CLASSES[escaped])
            return _literal(escaped)
        if char in "*+?{":
            raise ValueError(f"nothing to repeat at {self.i - 1} in {self.text!r}")
        return _literal(char)

    def _class(self) -> frozenset[int]:
        negate = self._peek() == "^"
        if negate:
            self._take()
        members: set[int] = set()
        while (char := self._take()) != "]":
            if char == "\\":
                escaped = self._take()
                members |= _CLASSES.get(escaped, {ord(escaped)})
                continue
            if self._peek() == "-" and self.i + 1 < len(self.text) and self.text[self.i + 1] != "]":
                self._take()
                members |= set(range(ord(char), ord(self._take()) + 1))
            else:
                members.add(ord(char))
        return frozenset(range(256)) - members if negate else frozenset(members)


def _literal(char: str) -> Node:
    return ("cat", [("set", frozenset([byte])) for byte in char.encode("utf-8")])


@dataclass
class _NFA:
    """Thompson's construction: per state, (byte set or None for an empty move, next state) edges."""

    edges: list[list[tuple[frozenset[int] | None, int]]] = field(default_factory=list)

    def new(self) -> int:
        self.edges.append([])
        return len(self.edges) - 1

    def build(self, node: Node, start: int) -> int:
        """States for `node` entered at `start`; returns the state where it ends."""
        kind = node[0]
        if kind == "set":
            end = self.new()
            self.edges[start].append((node[1], end))
            return end
        if kind == "cat":
            for part in node[1]:
                start = self.build(part, start)
            return start
        if kind == "alt":
            end = self.new()
            for option in node[1]:
                self.edges[self.build(option, start)].append((None, end))
            return end
        _, inner, low, high = node
        for _ in range(low):
            start = self.build(inner, start)
        if high is None:  # a loop: any number more
            loop = self.new()
            self.edges[start].append((None, loop))
            self.edges[self.build(inner, loop)].append((None, loop))
            return loop
        end = self.new()
        for _ in range(high - low):
            self.edges[start].append((None, end))
            start = self.build(inner, start)
        self.edges[start].append((None, end))
        return end


class CharacterDFA:
    """The regex as a deterministic automaton over bytes, built lazily by subset construction: a state is the set
    of NFA states the text read so far could be in; the empty set is dead (no match possible any more)."""

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self._nfa = _NFA()
        begin = self._nfa.new()
        self._final = self._nfa.build(_Parser(pattern).parse(), begin)
        self.start = self._closure({begin})
        self._steps: dict[tuple[frozenset[int], int], frozenset[int]] = {}

    def __repr__(self) -> str:
        return f"CharacterDFA({self.pattern!r})"

    def _closure(self, states: set[int]) -> frozenset[int]:
        stack, seen = list(states), set(states)
        while stack:
            for label, target in self._nfa.edges[stack.pop()]:
                if label is None and target not in seen:
                    seen.add(target)
                    stack.append(target)
        return frozenset(seen)

    def step(self, state: frozenset[int], byte: int) -> frozenset[int]:
        key = (state, byte)
        if key not in self._steps:
            self._steps[key] = self._closure({target for s in state for label, target in self._nfa.edges[s]
                                              if label is not None and byte in label})
        return self._steps[key]

    def walk(self, state: frozenset[int] | None, data: bytes) -> frozenset[int] | None:
        """The state after reading `data`, or None where the text can no longer match."""
        for byte in data:
            if not state:
                return None
            state = self.step(state, byte)
        return state or None

    def accepts(self, state: frozenset[int] | None) -> bool:
        return state is not None and self._final in state


def token_mask(dfa: CharacterDFA, state: frozenset[int], vocab: list[bytes]) -> torch.Tensor:
    """(len(vocab),) bool: the tokens whose bytes keep a match possible from `state` (an empty token never)."""
    return torch.tensor([bool(token) and dfa.walk(state, token) is not None for token in vocab])


def forced_bytes(dfa: CharacterDFA, state: frozenset[int] | None, limit: int = 256) -> bytes:
    """The text the automaton allows as the only continuation from `state`: bytes are taken while exactly one
    byte keeps a match possible and the text so far is not already a match (where it could also end). b"" at
    a choice, at an accepting state or at a dead one; at most `limit` bytes."""
    forced = bytearray()
    while state and not dfa.accepts(state) and len(forced) < limit:
        live = [byte for byte in range(256) if dfa.step(state, byte)]
        if len(live) != 1:
            break
        forced.append(live[0])
        state = dfa.step(state, live[0])
    return bytes(forced)
