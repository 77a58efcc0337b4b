"""Anthropic's Messages request as a chat completion request, and a chat completion as a Message: the translation
both ways, without running anything (:mod:`~miserver.services.inference.messages` runs it).

Request (:func:`chat_body`): ``system`` becomes a system turn in front; a turn's text blocks are joined; an
``assistant`` turn's ``tool_use`` blocks become its ``tool_calls`` (``input`` as the arguments' JSON text); each
``tool_result`` block of a ``user`` turn becomes a ``tool`` turn answering its call (its text; an ``is_error``
result as ``Error: <text>``), the turn's text blocks a ``user`` turn after them; ``tools`` become chat's function
tools (``input_schema`` the parameters) and ``tool_choice`` ``auto`` / ``any`` / ``tool`` / ``none`` chat's
``auto`` / ``required`` / the named function / ``none``. ``stop_sequences`` (any number) and ``top_k`` travel as
chat :class:`~miserver.services.inference.chat.Extras`.

Answer (:func:`message`): the chat completion's text as one ``text`` block, its tool calls as ``tool_use`` blocks
(``id`` ``toolu_...``, ``input`` the arguments object), the finish reason as the stop reason.
"""

from __future__ import annotations

import json
from typing import Any

from ...errors import InvalidRequestError, UnsupportedParameterError, UnsupportedValueError, UpstreamError
from ...protocol.anthropic import (
    Message,
    MessagesRequest,
    MessageUsage,
    StopReason,
    TextBlock,
    TextBlockParam,
    ToolResultBlockParam,
    ToolUseBlock,
    ToolUseBlockParam,
    blocks_text,
)
from ...protocol.anthropic_tools import ToolParam
from .chat import Extras
from .tools import Mode, Tool, check_tool, choose

#: Anthropic's ``tool_choice`` types as chat's tool modes.
MODES: dict[str, Mode] = {"auto": "auto", "any": "required", "tool": "named", "none": "none"}
#: Fields of a client tool that ask for what this server lacks: refused when set (``False`` and ``[]`` are neutral).
REFUSED_TOOL_FIELDS = {
    "strict": "strict tool schemas are not supported; a 'tool_choice' of type 'any' or 'tool' makes the call follow "
    "the 'input_schema' by grammar",
    "input_examples": "tool input examples are not supported",
    "defer_loading": "tool search is not supported",
    "allowed_callers": "programmatic tool calling is not supported",
    "eager_input_streaming": "the input of a tool call is streamed in one piece",
}


def _refused_block_field(block: Any, where: str) -> None:
    """400 ``unsupported_parameter`` on ``<where>.citations`` for a block that asks for citations (there are none
    here: refused rather than ignored). A block's ``cache_control`` is accepted without effect (its shape is the
    request model's check)."""
    if getattr(block, "citations", None) is not None:
        param = f"{where}.citations"
        raise UnsupportedParameterError(
            f"Unsupported parameter: '{param}' is not supported by this server (no citations); remove it.",
            param=param,
        )


def _result_text(block: ToolResultBlockParam, where: str) -> str:
    """A ``tool_result``'s content as text (its ``text`` blocks joined); 400 on another block in it."""
    if block.content is None or isinstance(block.content, str):
        text = block.content or ""
    else:
        for k, inner in enumerate(block.content):
            if not isinstance(inner, TextBlockParam):
                raise UnsupportedValueError(
                    f"Invalid value for '{where}.content[{k}].type': a tool result's content is read as text here; "
                    f"send it as a string or as 'text' blocks, not '{inner.type}'.",
                    param=f"{where}.content[{k}].type",
                )
            _refused_block_field(inner, f"{where}.content[{k}]")
        text = blocks_text(block.content)
    return f"Error: {text}" if block.is_error else text


def _tool_call(block: ToolUseBlockParam) -> dict[str, Any]:
    arguments = json.dumps(block.input, ensure_ascii=False)
    return {"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}}


def _turns(req: MessagesRequest) -> list[dict[str, Any]]:
    """The chat turns of ``req``; 400 naming the block for a ``tool_use`` outside an ``assistant`` turn, a
    ``tool_result`` outside a ``user`` turn or answering no earlier ``tool_use``, and refused block fields."""
    turns: list[dict[str, Any]] = []
    if req.system is not None:
        if isinstance(req.system, list):
            for j, block in enumerate(req.system):
                if not isinstance(block, TextBlockParam):
                    raise UnsupportedValueError(
                        f"Invalid value for 'system[{j}].type': the system prompt is text ('text' blocks).",
                        param=f"system[{j}].type",
                    )
                _refused_block_field(block, f"system[{j}]")
        turns.append({"role": "system", "content": blocks_text(req.system)})
    called: set[str] = set()
    for i, m in enumerate(req.messages):
        if isinstance(m.content, str):
            turns.append({"role": m.role, "content": m.content})
            continue
        text: list[str] = []
        calls: list[dict[str, Any]] = []
        pending = False  # text read since the last tool turn (a user turn's text goes after its results)
        for j, block in enumerate(m.content):
            where = f"messages[{i}].content[{j}]"
            _refused_block_field(block, where)
            if isinstance(block, ToolUseBlockParam):
                if m.role != "assistant":
                    raise InvalidRequestError(
                        f"Invalid value for '{where}.type': a 'tool_use' block belongs to an 'assistant' turn.",
                        param=f"{where}.type",
                    )
                calls.append(_tool_call(block))
                called.add(block.id)
            elif isinstance(block, ToolResultBlockParam):
                if m.role != "user":
                    raise InvalidRequestError(
                        f"Invalid value for '{where}.type': a 'tool_result' block belongs to a 'user' turn.",
                        param=f"{where}.type",
                    )
                if block.tool_use_id not in called:
                    raise InvalidRequestError(
                        f"Invalid value for '{where}.tool_use_id': {block.tool_use_id!r} names no 'tool_use' block of "
                        "an earlier assistant turn.",
                        param=f"{where}.tool_use_id",
                    )
                if pending:
                    turns.append({"role": "user", "content": "".join(text)})
                    text, pending = [], False
                result = _result_text(block, where)
                turns.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": result})
            elif isinstance(block, TextBlockParam):
                text.append(block.text)
                pending = True
        if m.role == "assistant":
            turn: dict[str, Any] = {"role": "assistant", "content": "".join(text) if text or not calls else None}
            if calls:
                turn["tool_calls"] = calls
            turns.append(turn)
        elif pending or not any(isinstance(b, ToolResultBlockParam) for b in m.content):
            turns.append({"role": "user", "content": "".join(text)})
    return turns


def _tools(req: MessagesRequest) -> list[Tool]:
    """``req.tools`` checked under Anthropic's names (``tools[i].name``, ``tools[i].input_schema``, the refused
    fields)."""
    tools: list[Tool] = []
    for i, tool in enumerate(req.tools or []):
        assert isinstance(tool, ToolParam), "a server tool is refused by the request model"
        for name, why in REFUSED_TOOL_FIELDS.items():
            value = getattr(tool, name)
            if value is not None and value is not False and value != []:
                param = f"tools[{i}].{name}"
                raise UnsupportedParameterError(f"Unsupported parameter: '{param}': {why}.", param=param)
        tools.append(
            check_tool(
                tool.name,
                tool.description,
                tool.input_schema,
                tools,
                name_param=f"tools[{i}].name",
                schema_param=f"tools[{i}].input_schema",
            )
        )
    return tools


def _tool_choice(req: MessagesRequest, tools: list[Tool]) -> Any:
    """Chat's ``tool_choice`` for ``req`` (None when not given); 400 on ``tool_choice`` for a ``tool`` choice
    without a listed ``name``, a ``name`` with another type, and a forcing choice without tools."""
    choice = req.tool_choice
    if choice is None:
        return None
    if (choice.type == "tool") != (choice.name is not None):
        raise InvalidRequestError(
            "Invalid value for 'tool_choice': 'name' is given with type 'tool' (and only with it).",
            param="tool_choice.name" if choice.type == "tool" else "tool_choice",
        )
    choose(tools, MODES[choice.type], choice.name)
    if choice.type == "tool":
        return {"type": "function", "function": {"name": choice.name}}
    return MODES[choice.type]


def chat_body(req: MessagesRequest) -> tuple[dict[str, Any], Extras]:
    """The chat completion body equivalent to ``req``, and its :class:`~miserver.services.inference.chat.Extras`
    (``stop_sequences``, ``top_k``: 0 is off). Raises :class:`~miserver.errors.InvalidRequestError` (400) naming the
    Messages field for the block and tool rules of :func:`_turns`, :func:`_tools` and :func:`_tool_choice`."""
    tools = _tools(req)
    body: dict[str, Any] = {"model": req.model, "messages": _turns(req), "max_tokens": req.max_tokens}
    if tools:
        body["tools"] = [
            {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}
            for t in tools
        ]
    choice = _tool_choice(req, tools)
    if choice is not None:
        body["tool_choice"] = choice
    if req.temperature is not None:
        body["temperature"] = req.temperature
    if req.top_p is not None:
        body["top_p"] = req.top_p
    if req.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body, Extras(stop=tuple(req.stop_sequences or ()), top_k=req.top_k or None)


# -- the answer --------------------------------------------------------------------------------------------------------


def stop_reason(finish_reason: str | None, stop_sequence: str | None) -> StopReason:
    """Anthropic's ``stop_reason`` of a chat ``finish_reason`` (``stop`` with a matched sequence is
    ``stop_sequence``; an upstream's ``content_filter`` is ``refusal``)."""
    if finish_reason == "length":
        return "max_tokens"
    if finish_reason == "tool_calls":
        return "tool_use"
    if finish_reason == "content_filter":
        return "refusal"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def matched_stop(choice: dict[str, Any], extras: Extras) -> str | None:
    """The stop sequence that ended ``choice``: as the resident engine told ``extras``, else as an upstream says
    it (vLLM's ``stop_reason``, SGLang's ``matched_stop``) when it is one of the request's; else None."""
    index = choice.get("index", 0)
    if index in extras.matched:
        return extras.matched[index]
    for key in ("stop_reason", "matched_stop"):
        value = choice.get(key)
        if isinstance(value, str) and value in extras.stop:
            return value
    return None


def tool_use_id(call_id: Any) -> str:
    """A chat tool call's id as a ``tool_use`` block's (``toolu_...``): ``call_x`` is ``toolu_x``."""
    text = str(call_id or "")
    return text if text.startswith("toolu_") else "toolu_" + text.removeprefix("call_")


def _bad_answer(upstream: str, what: str) -> UpstreamError:
    """502 ``upstream_bad_response``: the upstream's chat completion cannot be read as a Message (only an upstream can
    answer so: the resident engine's answers are built here)."""
    envelope = {
        "message": f"The upstream {upstream} answered {what}.",
        "type": "server_error",
        "param": None,
        "code": "upstream_bad_response",
    }
    return UpstreamError(502, {"error": envelope})


def tool_input(arguments: Any, upstream: str) -> dict[str, Any]:
    """A tool call's arguments (JSON text) as a ``tool_use`` input; 502 ``upstream_bad_response`` when they are not
    a JSON object."""
    try:
        value = json.loads(arguments) if isinstance(arguments, str) else None
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise _bad_answer(upstream, "a tool call whose arguments are not a JSON object")
    return value


def message(completion: dict[str, Any], message_id: str, extras: Extras, upstream: str = "") -> Message:
    """The Message of a chat completion (its first choice: Messages asks for one); 502 ``upstream_bad_response``
    for a completion without a choice or a tool call whose arguments are not a JSON object."""
    choices = completion.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else None
    said = choice.get("message") if choice is not None else None
    if choice is None or not isinstance(said, dict):
        raise _bad_answer(upstream, "a chat completion without a message")
    content: list[TextBlock | ToolUseBlock] = []
    if said.get("content") or not said.get("tool_calls"):
        content.append(TextBlock(text=said.get("content") or ""))
    for call in said.get("tool_calls") or []:
        function = call.get("function") or {}
        name, arguments = str(function.get("name") or ""), function.get("arguments")
        content.append(ToolUseBlock(id=tool_use_id(call.get("id")), name=name, input=tool_input(arguments, upstream)))
    usage = completion.get("usage") or {}
    finish = "tool_calls" if said.get("tool_calls") else choice.get("finish_reason")
    stop = matched_stop(choice, extras) if finish == "stop" else None
    return Message(
        id=message_id,
        content=content,
        model=str(completion.get("model", "")),
        stop_reason=stop_reason(finish, stop),
        stop_sequence=stop,
        usage=MessageUsage(
            input_tokens=int(usage.get("prompt_tokens") or 0), output_tokens=int(usage.get("completion_tokens") or 0)
        ),
    )
