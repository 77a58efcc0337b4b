"""Pydantic models of the OpenAI Responses API (``POST /v1/responses``): the request, the Response object, the
deletion object. The resident model reads text only: messages of roles user/assistant/system/developer whose content
is a string or ``input_text`` parts (an assistant turn may also carry ``output_text`` parts, as a Response's own
output item does when a client sends it back), and the items of a function tool's round trip (``function_call``,
``function_call_output``).

Fields of OpenAI's request that the engine cannot honour (reasoning, background, ...) are declared so that the
service refuses them by name; content parts and input items that are not text or function calls are refused on their
``type``. The items ``GET /v1/responses/{id}/input_items`` lists are in :mod:`.responses_items`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Discriminator, Field, Tag
from pydantic_core import PydanticCustomError

from .common import RequestModel, ResponseModel

#: OpenAI's floor for ``max_output_tokens``.
MIN_OUTPUT_TOKENS = 16

# -- input content parts --------------------------------------------------------------------------------------------


class InputTextPart(RequestModel):
    """``{"type": "input_text", "text": ...}``."""

    type: Literal["input_text"]
    text: str


class OutputTextPart(RequestModel):
    """``{"type": "output_text", "text": ...}``: an earlier answer of the model, sent back as an assistant turn.
    ``annotations`` and ``logprobs`` are declared because a Response's own output part carries them."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


#: Content part types of OpenAI's Responses API that a text-only model cannot read, with the words of the refusal.
UNREADABLE_PARTS = {
    "input_image": "image content",
    "input_file": "file content",
    "input_audio": "audio content",
    "refusal": "a refusal part",
}
PART_TYPES = ("input_text", "output_text", *UNREADABLE_PARTS)


def _refuse_part(kind: str) -> str:
    raise PydanticCustomError(
        "unsupported_value",
        f"{UNREADABLE_PARTS[kind]} ('{kind}' part) is not supported by this model, which reads text only; send the "
        "content as 'input_text' parts.",
    )


def _unknown_part(kind: str) -> str:
    supported = ", ".join(f"'{t}'" for t in PART_TYPES)
    raise PydanticCustomError(
        "invalid_value",
        f"'{kind}' is not a content part type (OpenAI's types are {supported}; this model reads 'input_text' and "
        "'output_text').",
    )


class UnreadablePart(RequestModel):
    """A known part that the model cannot read (image, file, audio): refused on its ``type``."""

    type: Annotated[str, AfterValidator(_refuse_part)]


class UnknownPart(RequestModel):
    """A part of no known type: refused on its ``type`` (400 ``invalid_value``)."""

    type: Annotated[str, AfterValidator(_unknown_part)]


def _part_kind(part: Any) -> str:
    if not isinstance(part, dict):
        return "input_text"  # not an object: the error says what a part is
    kind = part.get("type")
    if kind in ("input_text", "output_text"):
        return str(kind)
    if not isinstance(kind, str):
        return "input_text"  # no type, or not a string: the error names ``type``
    return "unreadable" if kind in UNREADABLE_PARTS else "unknown"


ContentPart = Annotated[
    Annotated[InputTextPart, Tag("input_text")]
    | Annotated[OutputTextPart, Tag("output_text")]
    | Annotated[UnreadablePart, Tag("unreadable")]
    | Annotated[UnknownPart, Tag("unknown")],
    Discriminator(_part_kind),
]

# -- input items ----------------------------------------------------------------------------------------------------


class InputMessage(RequestModel):
    """One conversation turn: ``{"role", "content"}`` (OpenAI's easy input message), optionally with
    ``"type": "message"`` and, for an output item sent back, its ``id`` and ``status``."""

    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        """The content as one string (parts joined without separator, as the chat service joins text parts)."""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if isinstance(p, (InputTextPart, OutputTextPart)))


class FunctionCallItem(RequestModel):
    """A call the model made (a Response's ``function_call`` output item, sent back): ``call_id`` pairs it with its
    ``function_call_output``; ``arguments`` is JSON text."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(RequestModel):
    """The result of the call ``call_id``: a string, or ``input_text`` parts (joined without separator)."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(p.text for p in self.output if isinstance(p, (InputTextPart, OutputTextPart)))


#: Input item types of OpenAI's Responses API other than messages and function calls: other tools' calls and their
#: outputs, reasoning, references to stored items. None can be served by a text-only model with function tools.
UNSUPPORTED_ITEMS = (
    "custom_tool_call",
    "custom_tool_call_output",
    "reasoning",
    "item_reference",
    "file_search_call",
    "web_search_call",
    "computer_call",
    "computer_call_output",
    "code_interpreter_call",
    "image_generation_call",
    "local_shell_call",
    "local_shell_call_output",
    "shell_call",
    "shell_call_output",
    "apply_patch_call",
    "apply_patch_call_output",
    "mcp_list_tools",
    "mcp_approval_request",
    "mcp_approval_response",
    "mcp_call",
    "compaction",
)


def _refuse_item(kind: str) -> str:
    raise PydanticCustomError(
        "unsupported_value",
        f"'{kind}' input items are not supported: this server has function tools only, and no reasoning items or "
        "stored items to reference; send messages with text content, 'function_call' and 'function_call_output'.",
    )


def _unknown_item(kind: str) -> str:
    raise PydanticCustomError(
        "invalid_value",
        f"'{kind}' is not an input item type (this server reads items of type 'message', 'function_call' and "
        "'function_call_output').",
    )


class UnsupportedItem(RequestModel):
    """An input item of a known non-message type: refused on its ``type``."""

    type: Annotated[str, AfterValidator(_refuse_item)]


class UnknownItem(RequestModel):
    """An input item of no known type: refused on its ``type``."""

    type: Annotated[str, AfterValidator(_unknown_item)]


def _item_kind(item: Any) -> str:
    if not isinstance(item, dict) or item.get("type", "message") == "message":
        return "message"
    kind = item.get("type")
    if kind in ("function_call", "function_call_output"):
        return str(kind)
    return "unsupported" if isinstance(kind, str) and kind in UNSUPPORTED_ITEMS else "unknown"


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[UnsupportedItem, Tag("unsupported")]
    | Annotated[UnknownItem, Tag("unknown")],
    Discriminator(_item_kind),
]

# -- the request ----------------------------------------------------------------------------------------------------


class TextConfig(RequestModel):
    """``text``: ``format`` is checked by the service (``text``, ``json_object``, or ``json_schema`` with its name
    and schema); ``verbosity`` is declared so that it is refused by name."""

    format: dict[str, Any] | None = None
    verbosity: str | None = None


class ResponseStreamOptions(RequestModel):
    """``stream_options``: OpenAI's obfuscation padding of deltas (never added here)."""

    include_obfuscation: bool | None = None


class ResponseCreateRequest(RequestModel):
    """``POST /v1/responses``. ``tools`` and ``tool_choice`` are checked by the service (function tools only).
    Fields after ``max_tool_calls`` are OpenAI's but cannot be honoured by the resident engine unless neutral; the
    service refuses them by name. ``stop`` is no field of OpenAI's Responses API: it is
    declared so that it is refused rather than ignored."""

    model: str
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=MIN_OUTPUT_TOKENS)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    metadata: dict[str, str] | None = None
    user: str | None = None
    text: TextConfig | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    stream: bool | None = None
    stream_options: ResponseStreamOptions | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    parallel_tool_calls: bool | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    max_tool_calls: int | None = None
    reasoning: dict[str, Any] | None = None
    background: bool | None = None
    include: list[str] | None = None
    conversation: Any = None
    prompt: Any = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    context_management: Any = None
    stop: Any = None


# -- the Response object ----------------------------------------------------------------------------------------------


class OutputText(ResponseModel):
    """The one content part of the answer."""

    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(ResponseModel):
    """The answer as an output item of type ``message``."""

    id: str
    type: Literal["message"] = "message"
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class OutputFunctionCall(ResponseModel):
    """A call of a function tool as an output item: ``id`` ``fc_...`` (the item), ``call_id`` ``call_...`` (what
    the ``function_call_output`` that answers it names), ``arguments`` JSON text."""

    id: str
    type: Literal["function_call"] = "function_call"
    status: Literal["in_progress", "completed", "incomplete"]
    call_id: str
    name: str
    arguments: str


class InputTokensDetails(ResponseModel):
    """Zeros: every prompt token is counted and priced alike (see ``common.PromptTokensDetails``)."""

    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(ResponseModel):
    """No reasoning here: zero."""

    reasoning_tokens: int = 0


class ResponseUsage(ResponseModel):
    """Token counts of a Response; ``output_tokens`` counts every generated token (stop and end tokens too)."""

    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(ResponseModel):
    """Why a Response is ``incomplete``: the output reached ``max_output_tokens`` (or the model's context)."""

    reason: Literal["max_output_tokens"]


class ResponseTextConfig(ResponseModel):
    """``text`` of a Response: ``format`` echoes the request's ``text.format`` (``{"type": "text"}``, ``{"type":
    "json_object"}``, or ``{"type": "json_schema", "name", "schema", "strict"?, "description"?}``)."""

    format: dict[str, Any] = Field(default_factory=lambda: {"type": "text"})


class ReasoningEcho(ResponseModel):
    """``reasoning`` of a Response: none."""

    effort: None = None
    summary: None = None


class ResponseObject(ResponseModel):
    """OpenAI's Response object. ``status`` ``in_progress`` only in the first events of a stream."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "in_progress"]
    background: bool = False
    completed_at: int | None = None
    error: None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    model: str
    output: list[OutputMessage | OutputFunctionCall]
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    reasoning: ReasoningEcho = Field(default_factory=ReasoningEcho)
    service_tier: Literal["default"] = "default"
    store: bool = True
    temperature: float = 1.0
    text: ResponseTextConfig = Field(default_factory=ResponseTextConfig)
    #: ``"auto"``, ``"none"``, ``"required"`` or ``{"type": "function", "name": ...}``, as sent
    tool_choice: str | dict[str, Any] = "auto"
    #: the function tools, ``{"type": "function", "name", "description", "parameters", "strict"}`` each
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_logprobs: int = 0
    top_p: float = 1.0
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)


class ResponseDeleted(ResponseModel):
    """``DELETE /v1/responses/{id}``."""

    id: str
    object: Literal["response"] = "response"
    deleted: Literal[True] = True
