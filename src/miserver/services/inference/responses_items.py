"""The Responses API's items and function tools in chat terms, and back: one translation for the resident engine and
for upstreams (both run the chat service).

A conversation is kept as *turns* (JSON-able ``dict[str, str]``, stored with a Response for ``previous_response_id``):

- a message: ``{"role", "content"}`` (an answer keeps its output item's ``id``);
- a function call: ``{"type": "function_call", "role": "assistant", "id": "fc_...", "call_id", "name",
  "arguments"}`` (``arguments`` JSON text);
- a function call's result: ``{"type": "function_call_output", "role": "tool", "call_id", "output"}`` (and the
  ``id`` sent with it, if any).

In chat terms a function call is an assistant turn's ``tool_calls`` entry (calls that follow an assistant turn join
it), a result is a ``tool`` turn; Responses ``tools`` (flat: ``{"type": "function", "name", "description",
"parameters", "strict"}``) are chat's ``{"type": "function", "function": {...}}``, checked by
:func:`~miserver.services.inference.tools.parse_tools`.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from ...errors import InvalidRequestError, MissingParameterError, UnsupportedParameterError, UnsupportedValueError
from ...ids import random_id
from ...protocol.responses import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputMessage,
    OutputFunctionCall,
    OutputMessage,
    OutputText,
    OutputTextPart,
    ResponseCreateRequest,
)
from ...protocol.responses_items import (
    InputItemOutputText,
    InputItemText,
    StoredFunctionCall,
    StoredFunctionCallOutput,
    StoredInputItem,
)
from .tools import parse_tools

Turn = dict[str, str]
Turns = list[Turn]
FUNCTION_CALL = "function_call"
FUNCTION_CALL_OUTPUT = "function_call_output"
#: The fields of a Responses function tool.
TOOL_FIELDS = ("type", "name", "description", "parameters", "strict")
Listed = StoredInputItem | StoredFunctionCall | StoredFunctionCallOutput


# -- tools ------------------------------------------------------------------------------------------------------------


def chat_tools(req: ResponseCreateRequest) -> tuple[list[dict[str, Any]] | None, Any]:
    """The request's ``tools`` and ``tool_choice`` in chat terms (``(None, None)`` when both are absent), checked as
    chat checks them. Raises 400 naming the field: ``tools[i]`` (not an object), ``tools[i].type``
    (``unsupported_value`` for any tool but ``function``: web_search, file_search, mcp, ...), ``tools[i].name``
    (missing, not 1-64 letters, digits, ``_`` or ``-``, or given twice), ``tools[i].parameters`` (not an object
    schema), ``tools[i].<field>`` (``unsupported_parameter`` for a field other than :data:`TOOL_FIELDS`),
    ``tool_choice`` (an unknown value or tool, a choice without tools, or a hosted tool's choice)."""
    tools = None
    if req.tools:
        tools = [_chat_tool(i, tool) for i, tool in enumerate(req.tools)]
    choice = _chat_tool_choice(req.tool_choice)
    try:
        parse_tools(tools, choice)
    except InvalidRequestError as exc:
        raise _named(exc) from None
    return tools, choice


def _chat_tool(i: int, tool: Any) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise InvalidRequestError(f"Invalid type for '{where}': expected an object.", param=where)
    kind = tool.get("type")
    if kind != "function":
        if not isinstance(kind, str):
            raise MissingParameterError(f"Missing required parameter: '{where}.type'.", param=f"{where}.type")
        raise UnsupportedValueError(
            f"Invalid value for '{where}.type': '{kind}' tools are not supported; this server runs function tools "
            "only ('type': 'function').",
            param=f"{where}.type",
        )
    extra = next((k for k in tool if k not in TOOL_FIELDS), None)
    if extra is not None:
        hint = (
            " (a Responses function tool is flat: 'name', 'parameters', ... beside 'type')"
            if extra == "function"
            else ""
        )
        raise UnsupportedParameterError(
            f"Unsupported parameter: '{where}.{extra}' is not supported{hint}.", param=f"{where}.{extra}"
        )
    if not isinstance(tool.get("name"), str):
        raise MissingParameterError(f"Missing required parameter: '{where}.name'.", param=f"{where}.name")
    strict = tool.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequestError(f"Invalid type for '{where}.strict': expected a boolean.", param=f"{where}.strict")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: Any) -> Any:
    if not isinstance(choice, dict):
        return choice  # a string: chat's values are the same ("auto", "none", "required")
    kind = choice.get("type")
    if kind == "function":
        if not isinstance(choice.get("name"), str):
            raise MissingParameterError("Missing required parameter: 'tool_choice.name'.", param="tool_choice.name")
        return {"type": "function", "function": {"name": choice["name"]}}
    raise UnsupportedValueError(
        f"Invalid value for 'tool_choice.type': {kind!r} is not supported; use 'auto', 'none', 'required' or "
        "{'type': 'function', 'name': ...}.",
        param="tool_choice.type" if isinstance(kind, str) else "tool_choice",
    )


def _named(exc: InvalidRequestError) -> InvalidRequestError:
    """A chat error on a tool named as the Responses field (``tools[0].function.name`` is ``tools[0].name``)."""
    if exc.param is None or ".function." not in exc.param:
        return exc
    return type(exc)(exc.message.replace(".function.", "."), param=exc.param.replace(".function.", "."), code=exc.code)


def echo_tools(req: ResponseCreateRequest) -> list[dict[str, Any]]:
    """The Response's ``tools``: each function tool with every field (``description``, ``parameters``,
    ``strict`` null when not sent)."""
    return [{k: tool.get(k) for k in TOOL_FIELDS} for tool in req.tools or []]


def echo_tool_choice(req: ResponseCreateRequest) -> str | dict[str, Any]:
    """The Response's ``tool_choice``: as sent (``"auto"`` when absent)."""
    choice = req.tool_choice
    if isinstance(choice, dict):
        return {"type": "function", "name": choice.get("name")}
    return choice if isinstance(choice, str) else "auto"


# -- input: items as turns, turns as chat messages ------------------------------------------------------------------


def input_turns(req: ResponseCreateRequest, earlier: Turns | None) -> Turns:
    """``input`` as turns. With ``earlier`` (the ``previous_response_id`` chain's turns; None: not known yet, the
    pairing check is left to the run), each ``function_call_output`` must answer a call made before it. Raises 400
    on an ``output_text`` part outside an assistant message (``input[i].content[j].type``) and on a result of no
    earlier call (``input[i].call_id``)."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    turns: Turns = []
    calls = {t["call_id"] for t in earlier or [] if t.get("type") == FUNCTION_CALL}
    for i, item in enumerate(req.input):
        if isinstance(item, FunctionCallItem):
            calls.add(item.call_id)
            call = {"call_id": item.call_id, "name": item.name, "arguments": item.arguments}
            turns.append({"type": FUNCTION_CALL, "role": "assistant", **({"id": item.id} if item.id else {}), **call})
            continue
        if isinstance(item, FunctionCallOutputItem):
            if earlier is not None and item.call_id not in calls:
                raise InvalidRequestError(
                    f"No tool call found for function call output with call_id {item.call_id!r}: send the "
                    "'function_call' item before it, or continue the Response that made the call "
                    "('previous_response_id').",
                    param=f"input[{i}].call_id",
                )
            output = {"call_id": item.call_id, "output": item.text()}
            turns.append(
                {"type": FUNCTION_CALL_OUTPUT, "role": "tool", **({"id": item.id} if item.id else {}), **output}
            )
            continue
        assert isinstance(item, InputMessage), "other items are refused by the request model"
        if item.role != "assistant" and not isinstance(item.content, str):
            for j, part in enumerate(item.content):
                if isinstance(part, OutputTextPart):
                    param = f"input[{i}].content[{j}].type"
                    raise InvalidRequestError(
                        f"Invalid value for '{param}': 'output_text' parts belong to assistant messages; a "
                        f"{item.role} message's text is an 'input_text' part.",
                        param=param,
                    )
        turns.append({"role": item.role, "content": item.text()})
    return turns


def chat_messages(turns: Turns) -> list[dict[str, Any]]:
    """The turns as chat messages: a function call joins the assistant turn before it (or starts one, content
    null) as a ``tool_calls`` entry; a result is a ``tool`` turn. A stored answer's id stays out."""
    messages: list[dict[str, Any]] = []
    for turn in turns:
        kind = turn.get("type")
        if kind == FUNCTION_CALL:
            call = {
                "id": turn["call_id"],
                "type": "function",
                "function": {"name": turn["name"], "arguments": turn["arguments"]},
            }
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == FUNCTION_CALL_OUTPUT:
            messages.append({"role": "tool", "tool_call_id": turn["call_id"], "content": turn["output"]})
        else:
            messages.append({"role": turn["role"], "content": turn["content"]})
    return messages


# -- output: a chat answer as output items, output items as turns --------------------------------------------------


def output_items(message: dict[str, Any], message_id: str, status: str) -> list[dict[str, Any]]:
    """A chat answer's ``message`` as Response output items: a message (when it has text, or makes no call), then a
    ``function_call`` item per tool call (``id`` ``fc_...``, ``call_id`` the chat call's id). ``status`` is the
    items' (``completed`` or ``incomplete``)."""
    text = message.get("content") or ""
    calls = message.get("tool_calls") or []
    items: list[dict[str, Any]] = []
    if text or not calls:
        items.append(OutputMessage(id=message_id, status=status, content=[OutputText(text=text)]).model_dump())  # type: ignore[arg-type]
    for call in calls:
        function = call.get("function") or {}
        items.append(
            function_call_item(
                str(call.get("id") or random_id("call_")),
                str(function.get("name") or ""),
                str(function.get("arguments") or ""),
                status,
            )
        )
    return items


def function_call_item(
    call_id: str, name: str, arguments: str, status: str, item_id: str | None = None
) -> dict[str, Any]:
    """A ``function_call`` output item (a new ``fc_...`` id unless ``item_id``)."""
    return OutputFunctionCall(
        id=item_id or random_id("fc_"),
        status=status,  # type: ignore[arg-type]
        call_id=call_id,
        name=name,
        arguments=arguments,
    ).model_dump()


def answer_turns(output: list[dict[str, Any]]) -> Turns:
    """A Response's output items as turns (one each, with the item's id), for the Responses that continue it."""
    turns: Turns = []
    for item in output:
        if item["type"] == FUNCTION_CALL:
            fields = {k: str(item[k]) for k in ("id", "call_id", "name", "arguments")}
            turns.append({"type": FUNCTION_CALL, "role": "assistant", **fields})
        else:
            text = "".join(str(part.get("text", "")) for part in item["content"])
            turns.append({"role": "assistant", "content": text, "id": str(item["id"])})
    return turns


# -- GET /v1/responses/{id}/input_items -------------------------------------------------------------------------------

#: The id prefix of an item that has no id of its own, by turn type.
ID_PREFIX = {FUNCTION_CALL: "fc_", FUNCTION_CALL_OUTPUT: "fco_"}


def input_item_id(turns: Turns, index: int) -> str:
    """The id of the ``index``-th turn of a conversation that has none of its own (an input turn sent without an
    id): a digest of the conversation up to it, so the same on every read (pages go ``after`` it) and the same in
    every Response that continues the conversation; ``msg_``, ``fc_`` or ``fco_`` by the item's type."""
    prefix = ID_PREFIX.get(turns[index].get("type", ""), "msg_")
    return prefix + hashlib.sha256(json.dumps(turns[: index + 1]).encode()).hexdigest()[:32]


def listed_item(turns: Turns, index: int) -> Listed:
    """The ``index``-th turn as ``GET /v1/responses/{id}/input_items`` lists it (OpenAI's item shapes)."""
    turn = turns[index]
    item_id = turn.get("id") or input_item_id(turns, index)
    kind = turn.get("type")
    if kind == FUNCTION_CALL:
        return StoredFunctionCall(id=item_id, call_id=turn["call_id"], name=turn["name"], arguments=turn["arguments"])
    if kind == FUNCTION_CALL_OUTPUT:
        return StoredFunctionCallOutput(id=item_id, call_id=turn["call_id"], output=turn["output"])
    assistant = turn["role"] == "assistant"
    return StoredInputItem(
        id=item_id,
        role=turn["role"],  # type: ignore[arg-type]  # the roles a request may send
        content=[InputItemOutputText(text=turn["content"]) if assistant else InputItemText(text=turn["content"])],
    )
