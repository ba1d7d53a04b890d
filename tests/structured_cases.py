"""Constraints and questions shared by the engine's and the server's structured-output tests (lesson 15): a JSON
schema with nested objects, enums, bounded arrays, patterns and anyOf; a regex; a choice; an EBNF grammar; any
JSON object; and `valid`, which says whether a text satisfies one of them (parsed and validated by jsonschema)."""

from __future__ import annotations

import json
import re

from llm_runtime.sampling import StructuredOutputsParams as Structured

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "contact": {"anyOf": [{"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"},
                              {"type": "integer", "minimum": 0, "maximum": 9999}]},
    },
    "required": ["name", "age", "role", "tags", "address", "contact"],
    "additionalProperties": False,
}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
ARITHMETIC = """root ::= expr
expr ::= term (("+" | "-") term){0,7}
term ::= [0-9]{1,3} | "(" expr ")"
"""
ARITHMETIC_RE = re.compile(r"[0-9()+\-]+")


def valid(kind: str, text: str) -> bool:
    import jsonschema

    if kind in ("json", "json_object"):
        try:
            value = json.loads(text)
        except ValueError:
            return False
        if kind == "json_object":
            return isinstance(value, dict)
        try:
            jsonschema.validate(value, PERSON)
        except jsonschema.ValidationError:
            return False
        return True
    if kind == "regex":
        return re.fullmatch(PHONE, text) is not None
    if kind == "choice":
        return text in ("Paris", "London", "Rome")
    return ARITHMETIC_RE.fullmatch(text) is not None and text.count("(") == text.count(")")


CONSTRAINTS = {
    "json": ("Describe a person as JSON.", Structured(json=PERSON)),
    "json_object": ("Return a JSON object with two fields: city and country.", Structured(json_object=True)),
    "regex": ("What is a phone number?", Structured(regex=PHONE)),
    "choice": ("What is the capital of France?", Structured(choice=["Paris", "London", "Rome"])),
    "grammar": ("Write a sum of numbers.", Structured(grammar=ARITHMETIC)),
}


def finished_valid(kind: str, text: str, finish: str | None, sampled: bool) -> bool:
    """A constrained completion as the tests expect it: ended by its grammar ("stop") and valid; or, sampled under
    json_object, which bounds nothing (any key, any string), still writing when max_tokens came (seen on an AMD
    EPYC, seed 1: a key of 150 tokens): the grammar took every token, so the text is an object's beginning."""
    if finish == "stop":
        return valid(kind, text)
    return sampled and kind == "json_object" and finish == "length" and text.startswith("{")
