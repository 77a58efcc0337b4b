"""Pydantic models of ``POST /v1/chat/completions``: the request, the response, and the streamed chunk.

Source: the OpenAI Chat Completions API reference; only text content is served by the resident model.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Discriminator, Field, Tag
from pydantic_core import PydanticCustomError

from .common import SEED_MAX, SEED_MIN, ChatTokenLogprob, RequestModel, ResponseModel, Stop, Usage


class TextContentPart(RequestModel):
    """A ``{"type": "text", "text": ...}`` part of a message's content."""

    type: Literal["text"]
    text: str


#: Content part types of OpenAI's chat API that a text-only model cannot read, with the words of their refusal.
UNREADABLE_PARTS = {
    "image_url": "image content",
    "input_audio": "audio content",
    "audio": "audio content",
    "file": "file content",
    "refusal": "a refusal part",
}
PART_TYPES = ("text", *UNREADABLE_PARTS)


def _refuse_part(kind: str) -> str:
    raise PydanticCustomError(
        "unsupported_value",
        f"{UNREADABLE_PARTS[kind]} ('{kind}' part) is not supported by this model, which reads text only; send the "
        "content as text parts.",
    )


def _unknown_part(kind: str) -> str:
    supported = ", ".join(f"'{t}'" for t in PART_TYPES)
    raise PydanticCustomError(
        "invalid_value",
        f"'{kind}' is not a content part type (OpenAI's types are {supported}; this model reads 'text' only).",
    )


class UnreadablePart(RequestModel):
    """A known content part that the model cannot read (image, audio, file): refused on its ``type``."""

    type: Annotated[str, AfterValidator(_refuse_part)]


class UnknownPart(RequestModel):
    """A content part of no known type: refused on its ``type`` (400 ``invalid_value``)."""

    type: Annotated[str, AfterValidator(_unknown_part)]


def _part_kind(part: Any) -> str:
    kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", "text")
    if kind == "text" or not isinstance(part, (dict, RequestModel)):
        return "text"
    return "unreadable" if isinstance(kind, str) and kind in UNREADABLE_PARTS else "unknown"


#: One part of a message's content, told apart by its ``type`` so that an error names the right field: a text part
#: missing ``text`` is ``...text``; an image part is refused on ``...type``, whatever else it carries.
ContentPart = Annotated[
    Annotated[TextContentPart, Tag("text")]
    | Annotated[UnreadablePart, Tag("unreadable")]
    | Annotated[UnknownPart, Tag("unknown")],
    Discriminator(_part_kind),
]


class FunctionCallIn(RequestModel):
    """``function`` of an earlier tool call: the tool's name and its arguments as JSON text."""

    name: str
    arguments: str


class ToolCallIn(RequestModel):
    """One tool call of an earlier assistant turn (``messages[i].tool_calls[j]``)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(RequestModel):
    """One conversation turn. ``content`` is a string or a list of text parts. ``name`` is declared so that the
    service can refuse it by name (the resident model's chat template has no place for it). An assistant turn may
    carry the ``tool_calls`` it made; a ``tool`` turn is a call's result, naming the call in ``tool_call_id``."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        """The message's content as one string (parts joined without separator, as OpenAI does)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextContentPart))


class StreamOptions(RequestModel):
    include_usage: bool | None = None


class ChatCompletionRequest(RequestModel):
    """The request body. Fields the resident engine cannot honour are declared so that they are refused by name
    (``reasoning_effort``, ``verbosity``...: the chat service's ``UNSUPPORTED_FIELDS``); ``user``,
    ``safety_identifier`` (an end user's id, for a provider's abuse monitoring) and ``prompt_cache_key`` (a hint for
    a provider's prompt cache) change nothing in the answer and are accepted. A request for an upstream model goes
    there with every field as sent."""

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    n: int | None = Field(None, ge=1, le=128)
    stop: Stop | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: str | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None


class FunctionCall(ResponseModel):
    name: str
    #: the arguments as JSON text (OpenAI's form)
    arguments: str


class ToolCallOut(ResponseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatCompletionMessage(ResponseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChoiceLogprobs(ResponseModel):
    content: list[ChatTokenLogprob] | None
    refusal: list[ChatTokenLogprob] | None = None


class ChatChoice(ResponseModel):
    index: int
    message: ChatCompletionMessage
    logprobs: ChoiceLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls"]


class ChatCompletion(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ChunkToolCall(ResponseModel):
    """A tool call in a stream: ``index`` among the choice's calls (sent whole, in one delta)."""

    index: int
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChunkDelta(ResponseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ChunkToolCall] | None = None


class ChunkChoice(ResponseModel):
    index: int
    delta: ChunkDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None


class ChatCompletionChunk(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
