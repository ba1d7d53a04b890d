"""Tool calls for models without a tool format (OpenAI's `tools` and `tool_choice`, lesson 15).

A chat request may offer functions (`tools`, each a name, a description and a JSON schema of its
`parameters`) and make the model call one: `tool_choice` naming a function, or `"required"` (at least one
call, of any of them). Neither needs the model to know a tool-call format: the grammar makes its output a
call. A named function's output is JSON that satisfies the function's parameters: it becomes the call's
`arguments`. For `"required"`, the output is a JSON array of `{"name": ..., "parameters": {...}}` objects,
each `name` one of the tools' and its `parameters` that tool's schema (the shape vLLM constrains to): each
element becomes one call.

The model must still be told what it can call. Where the chat template renders `tools` itself (Qwen's,
Llama 3.1's), it does; SmolLM2's template ignores them, and vLLM then sends a prompt without them (its
answer for such models is a tool chat template passed with `--chat-template`). This server instead adds the
tool list to the conversation as a system message (`tool_prompt`), so that the model sees the functions and
their parameters; the README says so.

`tool_choice: "auto"` would need a parser for the model's own way of writing calls in free text, which
SmolLM2 does not have, so it is refused, as vLLM refuses it without a tool-call parser; `"none"` answers in
text.
"""

from __future__ import annotations

import json
import uuid
from typing import Any


def function_parameters(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters schema; a function without parameters takes an empty object."""
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def required_calls_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """The schema of `tool_choice: "required"`: one or more calls, each of one of the tools, with its arguments."""
    return {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
        {"properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]},
                        "parameters": function_parameters(tool)},
         "required": ["name", "parameters"]} for tool in tools]}}


def tool_prompt(tools: list[dict[str, Any]]) -> str:
    """The system message that tells a model without a tool format what it may call."""
    listed = [{"name": tool["function"]["name"], "description": tool["function"].get("description", ""),
               "parameters": function_parameters(tool)} for tool in tools]
    return ("You can call these functions. To call one, answer with its arguments as a JSON object that follows "
            "its parameters.\n" + json.dumps(listed, ensure_ascii=False, indent=1))


def make_tool_call_id() -> str:
    return f"call-{uuid.uuid4().hex[:24]}"


def parse_required_calls(text: str) -> list[tuple[str, str]]:
    """(name, arguments JSON) for each call of a `"required"` output; ValueError when it is not such an array
    (a truncated output, finish_reason "length")."""
    calls = json.loads(text)
    if not isinstance(calls, list) or not all(isinstance(c, dict) and "name" in c and "parameters" in c
                                              for c in calls):
        raise ValueError("not an array of {name, parameters} objects")
    return [(call["name"], json.dumps(call["parameters"], ensure_ascii=False)) for call in calls]
