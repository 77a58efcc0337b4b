"""Function tools on the resident engine (chat ``tools``, ``tool_choice``), with a generic tool prompt.

The embedded model's chat template (plain ChatML) has no tool format, so miServer writes one of its own, the same
for every model: the system turn lists the tools (name, description and the JSON Schema of the parameters) and asks
for a call as one JSON object ``{"name": <tool>, "arguments": {...}}`` and nothing else. ``tool_choice``:

- ``"auto"`` (the default with tools): the model answers freely; an answer that is exactly such an object naming a
  listed tool, with arguments valid as JSON, becomes a tool call (``finish_reason: "tool_calls"``), any other answer
  is text;
- ``"required"``: the answer is constrained by a grammar to a call of one of the tools, its arguments valid under
  that tool's parameter schema; ``{"type": "function", "function": {"name": X}}`` constrains it to a call of ``X``;
- ``"none"``: the tools stay in the prompt, the answer is text.

Earlier turns go back into the prompt in the same format: an assistant turn's ``tool_calls`` as the call objects it
made, a ``tool`` turn's content as the result (ChatML renders the ``tool`` role as it is).

Anthropic's Messages API reaches the same tools through the chat service (its ``tools`` and ``tool_choice`` are
written as chat's, checked by :func:`check_tool` and :func:`choose` under its own field names first).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ...engines.base import Grammar
from ...errors import InvalidRequestError, MissingParameterError
from ...ids import random_id

#: OpenAI's rule for a function's name.
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Tool:
    """One function tool: its name, description (may be empty) and the JSON Schema of its arguments (an object)."""

    name: str
    description: str
    parameters: dict[str, Any]


@dataclass(frozen=True)
class ToolCall:
    """A call the model made: OpenAI's ``id`` (``call_...``), the tool's name and its arguments as JSON text."""

    id: str
    name: str
    arguments: str


Mode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class Tools:
    """The tools of a request and how the model may use them (``named``: only ``forced`` may be called)."""

    tools: tuple[Tool, ...]
    mode: Mode
    forced: str | None = None

    def by_name(self, name: str) -> Tool | None:
        return next((t for t in self.tools if t.name == name), None)


def check_tool(
    name: Any, description: Any, parameters: Any, taken: Sequence[Tool], *, name_param: str, schema_param: str
) -> Tool:
    """One tool's definition, checked (``taken``: the request's tools before it; ``parameters`` None: no
    arguments). The same rules for every API, each naming its own fields: raises :class:`MissingParameterError` on
    ``name_param`` when there is no name, :class:`InvalidRequestError` (400) on ``name_param`` for a name that is not
    1-64 letters, digits, ``_`` or ``-`` or is given twice, and on ``schema_param`` for parameters that are not a JSON
    Schema of type ``object``."""
    if not isinstance(name, str):
        raise MissingParameterError(f"Missing required parameter: '{name_param}'.", param=name_param)
    if not NAME.match(name) or any(t.name == name for t in taken):
        why = "is given twice" if NAME.match(name) else "must be 1-64 letters, digits, underscores or dashes"
        raise InvalidRequestError(f"Invalid '{name_param}': {name!r} {why}.", param=name_param)
    if parameters is None:
        parameters = EMPTY_PARAMETERS
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise InvalidRequestError(
            f"Invalid '{schema_param}': the parameters are a JSON Schema of type 'object'.", param=schema_param
        )
    return Tool(name, str(description or ""), {"type": "object", **parameters})


def choose(tools: Sequence[Tool], mode: Mode, forced: str | None = None, *, param: str = "tool_choice") -> Tools | None:
    """The tools with how the model may use them (None without tools, where ``mode`` may only be ``none`` or
    ``auto``). Raises :class:`InvalidRequestError` (400) on ``param`` for a choice other than those without tools,
    and for a ``named`` choice whose ``forced`` tool is not among them."""
    if not tools:
        if mode not in ("none", "auto"):
            raise InvalidRequestError(
                f"Invalid value for '{param}': it may only force a tool call when 'tools' are specified.", param=param
            )
        return None
    if mode == "named" and not any(t.name == forced for t in tools):
        raise InvalidRequestError(f"Invalid value for '{param}': no tool named {forced!r} is in 'tools'.", param=param)
    return Tools(tuple(tools), mode, forced if mode == "named" else None)


def parse_tools(tools: list[Any] | None, tool_choice: Any) -> Tools | None:
    """Chat's ``tools`` and ``tool_choice``, checked (None without tools, where ``tool_choice`` may only be ``none``
    or ``auto``). Raises :class:`InvalidRequestError` (400) naming the field: ``tools[i].type``,
    ``tools[i].function.name`` (missing, or not 1-64 letters, digits, ``_`` or ``-``, or given twice),
    ``tools[i].function.parameters`` (not an object schema), ``tool_choice`` (unknown value or tool)."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise InvalidRequestError(
                "Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' are specified.",
                param="tool_choice",
            )
        return None
    parsed: list[Tool] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise InvalidRequestError(
                f"Invalid value for '{where}.type': it must be 'function'.", param=f"{where}.type"
            )
        function = tool.get("function")
        if not isinstance(function, dict):
            raise MissingParameterError(f"Missing required parameter: '{where}.function'.", param=f"{where}.function")
        parsed.append(
            check_tool(
                function.get("name"),
                function.get("description"),
                function.get("parameters"),
                parsed,
                name_param=f"{where}.function.name",
                schema_param=f"{where}.function.parameters",
            )
        )
    if tool_choice in (None, "auto", "none", "required"):
        return choose(parsed, tool_choice or "auto")
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            hint = " (chat names it under 'function', not beside 'type')" if "name" in tool_choice else ""
            raise MissingParameterError(
                f"Missing required parameter: 'tool_choice.function.name'{hint}.", param="tool_choice.function.name"
            )
        return choose(parsed, "named", name)
    raise InvalidRequestError(
        "Invalid value for 'tool_choice': it must be 'none', 'auto', 'required' or {'type': 'function', "
        "'function': {'name': ...}}.",
        param="tool_choice",
    )


def system_prompt(tools: Tools) -> str:
    """The generic tool prompt: the tools as JSON lines and the call format."""
    lines = [
        json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters}, ensure_ascii=False)
        for t in tools.tools
    ]
    return (
        "You can call these tools (one JSON object per line: the tool's name, what it does, the JSON Schema of its "
        "arguments):\n" + "\n".join(lines) + "\nTo call a tool, answer with only a JSON object of the form "
        '{"name": "<tool name>", "arguments": {<the arguments>}} and nothing else. Otherwise answer in text.'
    )


def with_tools(messages: list[dict[str, str]], tools: Tools) -> list[dict[str, str]]:
    """``messages`` (role/content dicts) with the tool prompt added to the system turn (a new first turn when there
    is none)."""
    prompt = system_prompt(tools)
    if messages and messages[0]["role"] == "system":
        first = {"role": "system", "content": messages[0]["content"] + "\n\n" + prompt}
        return [first, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def call_text(name: str, arguments: str) -> str:
    """An earlier call as the model writes it (``arguments``: JSON text; kept as sent where it is not JSON)."""
    try:
        args: Any = json.loads(arguments)
    except ValueError:
        args = arguments
    return json.dumps({"name": name, "arguments": args}, ensure_ascii=False)


def call_grammar(tools: Tools) -> Grammar | None:
    """The grammar of the answer: for ``required``, a call of any tool; for ``named``, a call of that tool; else
    None. A call is ``{"name": <the tool's name>, "arguments": <valid under its parameters>}``."""
    if tools.mode not in ("required", "named"):
        return None
    chosen = [t for t in tools.tools if tools.mode == "required" or t.name == tools.forced]
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": t.parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in chosen
    ]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return Grammar("json_schema", json.dumps(schema, separators=(",", ":")))


def parse_call(text: str, tools: Tools) -> ToolCall | None:
    """The tool call ``text`` is (a JSON object naming a listed tool, with object arguments), else None."""
    try:
        value = json.loads(text.strip())
    except ValueError:
        return None
    if not isinstance(value, dict) or set(value) != {"name", "arguments"}:
        return None
    name, arguments = value["name"], value["arguments"]
    if not isinstance(name, str) or tools.by_name(name) is None or not isinstance(arguments, dict):
        return None
    return ToolCall(random_id("call_"), name, json.dumps(arguments, ensure_ascii=False))
