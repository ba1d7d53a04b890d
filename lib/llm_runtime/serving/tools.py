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
from dataclasses import dataclass, field
from typing import Any, Literal

from ..errors import InvalidRequestError
from ..sampling import StructuredOutputsParams
from . import protocol


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


# ------------------------------------------------------------------ one chat request's constraint
@dataclass(frozen=True)
class ChatConstraint:
    """What a chat request asks its output to be, from whichever field asked: the constraint for the engine, how
    the answer is shaped (text, one named call, or calls of any tools), the conversation as the model sees it,
    and the request's name for each field an engine refusal may name."""

    structured: StructuredOutputsParams | None
    messages: list[dict[str, Any]]
    tool_mode: Literal["text", "named", "required"] = "text"
    function_name: str | None = None  # the named call's function
    field_names: dict[str, str] = field(default_factory=dict)


def chat_constraint(body: Any) -> ChatConstraint:
    """The constraint of a ChatCompletionRequest; InvalidRequestError naming the field when the request asks
    for two constraints at once, names a function it does not offer, or asks for "auto"."""
    messages = render_tool_messages([m.model_dump(exclude_none=True) for m in body.messages])
    given = [name for name, value in (("structured_outputs", body.structured_outputs),
                                      ("response_format", _format_constraint(body.response_format)),
                                      ("tool_choice", _uses_tools(body))) if value]
    if len(given) > 1:
        raise InvalidRequestError(given[1], f"{given[1]} cannot be combined with {given[0]}: a request takes one "
                                            f"constraint on its output")
    if body.tool_choice is not None and not body.tools:
        raise InvalidRequestError("tool_choice", "tool_choice needs tools to choose from")
    if body.structured_outputs is not None:
        return ChatConstraint(body.structured_outputs.params(), messages)
    structured = _format_constraint(body.response_format)
    if structured is not None:
        names = {"structured_outputs": "response_format", "structured_outputs.json": "response_format.json_schema"}
        return ChatConstraint(structured, messages, field_names=names)
    if not body.tools or body.tool_choice == "none":
        return ChatConstraint(None, messages)
    if body.tool_choice in (None, "auto"):
        raise InvalidRequestError("tool_choice", 'tool_choice "auto" (the default with tools) needs a parser for '
                                                 "the model's own tool-call format, which this model has none of: "
                                                 'name a function ({"type": "function", "function": {"name": ...}}), '
                                                 'or say "required" or "none"')
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools]
    names = {"structured_outputs": "tools", "structured_outputs.json": "tools"}
    messages = with_tool_prompt(messages, tools)
    if body.tool_choice == "required":
        return ChatConstraint(StructuredOutputsParams(json=required_calls_schema(tools)), messages, "required",
                              field_names=names)
    name = body.tool_choice.function.name
    chosen = [tool for tool in tools if tool["function"]["name"] == name]
    if not chosen:
        raise InvalidRequestError("tool_choice", f"tool_choice names the function {name!r}, which is not among "
                                                 f"the tools: {[tool['function']['name'] for tool in tools]}")
    return ChatConstraint(StructuredOutputsParams(json=function_parameters(chosen[0])), messages, "named", name,
                          field_names=names)


def _format_constraint(response_format: Any) -> StructuredOutputsParams | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object" or response_format.json_schema.schema_ is None:
        return StructuredOutputsParams(json_object=True)
    return StructuredOutputsParams(json=response_format.json_schema.schema_)


def _uses_tools(body: Any) -> bool:
    return bool(body.tools) and body.tool_choice not in (None, "none", "auto")


def render_tool_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation for a template without a tool format: an assistant's earlier calls become its content
    (the JSON it wrote), a tool's answer stays a message of role "tool"."""
    rendered = []
    for message in messages:
        calls = message.pop("tool_calls", None)
        message.pop("tool_call_id", None)
        if calls and message.get("content") in (None, ""):
            message["content"] = json.dumps([{"name": c["function"]["name"],
                                              "parameters": _arguments(c["function"]["arguments"])} for c in calls],
                                            ensure_ascii=False)
        rendered.append(message)
    return rendered


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def with_tool_prompt(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tool list as the conversation's system message: appended to the one the client sent, if any."""
    prompt = tool_prompt(tools)
    if messages and messages[0]["role"] == "system":
        content = messages[0].get("content")
        if isinstance(content, list):
            content = "\n".join(part["text"] for part in content)
        return [{**messages[0], "content": f"{content}\n\n{prompt}"}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def tool_calls_of(constraint: ChatConstraint, text: str) -> list[protocol.ToolCall] | None:
    """The calls an output makes under `constraint`; None when it makes none (text mode, or a "required" output
    that was cut short and is no JSON array)."""
    if constraint.tool_mode == "named":
        assert constraint.function_name is not None
        return [protocol.ToolCall(id=make_tool_call_id(),
                                  function=protocol.FunctionCall(name=constraint.function_name, arguments=text))]
    if constraint.tool_mode == "required":
        try:
            calls = parse_required_calls(text)
        except ValueError:
            return None
        return [protocol.ToolCall(id=make_tool_call_id(), function=protocol.FunctionCall(name=name, arguments=args))
                for name, args in calls]
    return None
