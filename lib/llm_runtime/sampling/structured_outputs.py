"""`StructuredOutputsParams`: the constraint a request's output must satisfy (vLLM's field of that name, lesson 15).

Exactly one of:

    StructuredOutputsParams(json={"type": "object", ...})     # a JSON schema (a dict or its JSON text)
    StructuredOutputsParams(regex=r"\\d{3}-\\d{4}")            # a regular expression the whole output matches
    StructuredOutputsParams(choice=["yes", "no"])              # one of these strings, exactly
    StructuredOutputsParams(grammar='root ::= "a" | "b"')      # an EBNF grammar (xgrammar's dialect, GBNF-like)
    StructuredOutputsParams(json_object=True)                  # any JSON object

set as `SamplingParams(structured_outputs=...)`. This file checks only the shape of the request (one
constraint, the right types, a non-empty choice); whether a schema, regex or grammar compiles is the input
processor's question (`structured_output/compiler.py`), asked once per distinct constraint (`key`).
"""

from __future__ import annotations

import json as json_module
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidRequestError

CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on a request's output; field names follow vLLM's StructuredOutputsParams."""

    json: str | dict[str, Any] | None = None  # a JSON schema; a dict is kept as its JSON text (key order kept)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # JSON as an encoder writes it, `{"a": 1, "b": [2, 3]}` and no other spacing: the model cannot spend its tokens
    # on newlines and indents (at temperature 1 the bundled model does: scripts/structured_valid_rate.py measured 36
    # of 62 requests valid within max_tokens=96 with any whitespace, 49 with this), and more of every object is
    # fixed text, which jump-forward takes without sampling. False: any whitespace between tokens, vLLM's default
    # (this default is not vLLM's).
    disable_any_whitespace: bool = True

    def __post_init__(self) -> None:
        given = [kind for kind in CONSTRAINT_KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            what = "none" if not given else ", ".join(given)
            raise InvalidRequestError("structured_outputs", f"structured_outputs takes exactly one of "
                                                            f"{', '.join(CONSTRAINT_KINDS)}; got {what}")
        if self.json is not None:
            if isinstance(self.json, dict):
                object.__setattr__(self, "json", json_module.dumps(self.json))
            elif isinstance(self.json, str):
                try:
                    schema = json_module.loads(self.json)
                except ValueError as error:
                    raise InvalidRequestError("structured_outputs.json", f"structured_outputs.json is not JSON: "
                                                                         f"{error}") from None
                if not isinstance(schema, (dict, bool)):
                    raise InvalidRequestError("structured_outputs.json", "structured_outputs.json must be a JSON "
                                                                         "schema: an object")
            else:
                raise InvalidRequestError("structured_outputs.json", f"structured_outputs.json must be a schema "
                                                                     f"(a dict or its JSON text), got "
                                                                     f"{type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(f"structured_outputs.{name}", f"structured_outputs.{name} must be a "
                                                                        f"non-empty string, got {value!r}")
        if self.choice is not None:
            choice = self.choice
            if not isinstance(choice, (list, tuple)) or not choice or not all(isinstance(c, str) and c for c in choice):
                raise InvalidRequestError("structured_outputs.choice", f"structured_outputs.choice must be a "
                                                                       f"non-empty list of non-empty strings, got "
                                                                       f"{choice!r}")
            object.__setattr__(self, "choice", list(choice))
        if self.json_object is not None and self.json_object is not True:
            raise InvalidRequestError("structured_outputs.json_object", "structured_outputs.json_object must be "
                                                                        "True (or left out)")
        if not isinstance(self.disable_any_whitespace, bool):
            raise InvalidRequestError("structured_outputs.disable_any_whitespace",
                                      "structured_outputs.disable_any_whitespace must be True or False")

    @property
    def kind(self) -> str:
        """Which constraint this is: one of CONSTRAINT_KINDS."""
        return next(kind for kind in CONSTRAINT_KINDS if getattr(self, kind) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as text: the schema's JSON, the regex, the grammar, the choices as a JSON list."""
        value = getattr(self, self.kind)
        return json_module.dumps(value) if self.kind == "choice" else "" if value is True else value

    @property
    def param(self) -> str:
        """The request field an error about this constraint names: "structured_outputs.json", ..."""
        return f"structured_outputs.{self.kind}"

    @property
    def key(self) -> tuple[str, str, bool]:
        """What compiles to the same grammar: the compile cache's key."""
        return self.kind, self.spec, self.disable_any_whitespace
