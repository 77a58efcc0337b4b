"""Pydantic models of Anthropic's Messages API (``POST /anthropic/v1/messages``) and Message Batches API.

Source: Anthropic's API reference (Messages, Message Batches, Errors) and the shapes the official ``anthropic`` SDK
validates. Only text is served: a content block of another known type is refused on its ``type``
(``unsupported_value``), one of no known type too (``invalid_value``). Fields that ask for features the resident
engine lacks (tools, extended thinking...) are declared so that the service refuses them by name.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Discriminator, Field, Tag
from pydantic_core import PydanticCustomError

from .common import RequestModel, ResponseModel

#: Content block types of Anthropic's API that a text-only server cannot read or produce, with their refusal words.
UNREADABLE_BLOCKS = {
    "image": "image content",
    "document": "document content",
    "search_result": "a search result",
    "tool_use": "a tool use",
    "tool_result": "a tool result",
    "server_tool_use": "a server tool use",
    "web_search_tool_result": "a web search result",
    "thinking": "a thinking block",
    "redacted_thinking": "a thinking block",
    "container_upload": "a container upload",
    "mcp_tool_use": "an MCP tool use",
    "mcp_tool_result": "an MCP tool result",
}
BLOCK_TYPES = ("text", *UNREADABLE_BLOCKS)


def _refuse_block(kind: str) -> str:
    raise PydanticCustomError(
        "unsupported_value",
        f"{UNREADABLE_BLOCKS[kind]} ('{kind}' block) is not supported by this server, which serves text only; send "
        "the content as a string or as 'text' blocks.",
    )


def _unknown_block(kind: str) -> str:
    raise PydanticCustomError(
        "invalid_value",
        f"'{kind}' is not a content block type (this server reads 'text' blocks only).",
    )


class TextBlockParam(RequestModel):
    """A ``{"type": "text", "text": ...}`` block of a message's content or of ``system``. ``cache_control`` and
    ``citations`` are declared so that the service can refuse them by name (no prompt cache, no citations here)."""

    type: Literal["text"]
    text: str
    cache_control: Any = None
    citations: Any = None


class UnreadableBlock(RequestModel):
    """A known content block that a text-only server cannot take (image, document, tool use...): refused on
    ``type``."""

    type: Annotated[str, AfterValidator(_refuse_block)]


class UnknownBlock(RequestModel):
    """A content block of no known type: refused on its ``type`` (400 ``invalid_value``)."""

    type: Annotated[str, AfterValidator(_unknown_block)]


def _block_kind(block: Any) -> str:
    kind = block.get("type") if isinstance(block, dict) else getattr(block, "type", "text")
    if kind == "text" or not isinstance(block, (dict, RequestModel)):
        return "text"
    return "unreadable" if isinstance(kind, str) and kind in UNREADABLE_BLOCKS else "unknown"


#: One content block, told apart by its ``type`` so that an error names the right field.
ContentBlockParam = Annotated[
    Annotated[TextBlockParam, Tag("text")]
    | Annotated[UnreadableBlock, Tag("unreadable")]
    | Annotated[UnknownBlock, Tag("unknown")],
    Discriminator(_block_kind),
]


def blocks_text(content: str | list[Any]) -> str:
    """A message's (or ``system``'s) content as one string: text blocks joined without separator."""
    if isinstance(content, str):
        return content
    return "".join(block.text for block in content if isinstance(block, TextBlockParam))


class InputMessage(RequestModel):
    """One conversation turn: ``user`` or ``assistant`` (the system prompt is the request's ``system``)."""

    role: Literal["user", "assistant"]
    content: str | list[ContentBlockParam]

    def text(self) -> str:
        """The turn's content as one string."""
        return blocks_text(self.content)


class RequestMetadata(RequestModel):
    """``metadata``: an opaque ``user_id`` (accepted; it changes nothing in the answer)."""

    user_id: str | None = Field(None, max_length=256)


class MessagesRequest(RequestModel):
    """The body of ``POST /anthropic/v1/messages`` (and the ``params`` of a Message Batch request).

    ``max_tokens`` is required, as in Anthropic's API; ``temperature`` is 0..1 (default 1). The fields after
    ``stream`` are declared so that the service refuses them by name (``unsupported_parameter``).
    """

    model: str
    max_tokens: int = Field(ge=1)
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[ContentBlockParam] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    metadata: RequestMetadata | None = None
    stream: bool | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    thinking: Any = None
    mcp_servers: list[Any] | None = None
    container: Any = None
    context_management: Any = None
    service_tier: str | None = None
    output_format: Any = None
    output_config: Any = None
    cache_control: Any = None
    diagnostics: Any = None
    inference_geo: str | None = None
    speed: str | None = None


# -- the Message ---------------------------------------------------------------------------------------------------

StopReason = Literal["end_turn", "max_tokens", "stop_sequence"]


class TextBlock(ResponseModel):
    """A text block of the answer."""

    type: Literal["text"] = "text"
    text: str


class MessageUsage(ResponseModel):
    """``usage`` of a Message: tokens in the prompt and generated (no prompt cache here: its counts are 0)."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class Message(ResponseModel):
    """Anthropic's Message object: ``id`` ``msg_...``, one text block, the stop reason and usage."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[TextBlock]
    model: str
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: MessageUsage


# -- streaming events (Server-Sent Events, ``event: <type>``) ---------------------------------------------------------


class MessageStartEvent(ResponseModel):
    type: Literal["message_start"] = "message_start"
    message: Message


class ContentBlockStartEvent(ResponseModel):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: TextBlock


class TextDelta(ResponseModel):
    type: Literal["text_delta"] = "text_delta"
    text: str


class ContentBlockDeltaEvent(ResponseModel):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: TextDelta


class ContentBlockStopEvent(ResponseModel):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class MessageDelta(ResponseModel):
    stop_reason: StopReason | None
    stop_sequence: str | None


class MessageDeltaUsage(ResponseModel):
    output_tokens: int


class MessageDeltaEvent(ResponseModel):
    type: Literal["message_delta"] = "message_delta"
    delta: MessageDelta
    usage: MessageDeltaUsage


class MessageStopEvent(ResponseModel):
    type: Literal["message_stop"] = "message_stop"


# -- Message Batches ---------------------------------------------------------------------------------------------------

#: Anthropic's limits on one Message Batch: requests, and bytes of the create body.
MAX_BATCH_REQUESTS = 100_000
MAX_BATCH_BYTES = 256 * 1024 * 1024


class MessageBatchRequestItem(RequestModel):
    """One request of a Message Batch: its ``custom_id`` and the Messages body (``params``), checked when the batch
    is validated (an invalid ``params`` becomes an ``errored`` result, as a batch line)."""

    custom_id: str
    params: dict[str, Any]


class MessageBatchCreateRequest(RequestModel):
    """``POST /anthropic/v1/messages/batches``: the requests, inline."""

    requests: list[MessageBatchRequestItem] = Field(min_length=1, max_length=MAX_BATCH_REQUESTS)


class MessageBatchRequestCounts(ResponseModel):
    """Requests by state; their sum is the batch's number of requests."""

    processing: int
    succeeded: int
    errored: int
    canceled: int
    expired: int


class MessageBatch(ResponseModel):
    """Anthropic's Message Batch object; times are RFC 3339 strings."""

    id: str
    type: Literal["message_batch"] = "message_batch"
    processing_status: Literal["in_progress", "canceling", "ended"]
    request_counts: MessageBatchRequestCounts
    ended_at: str | None
    created_at: str
    expires_at: str
    archived_at: str | None = None
    cancel_initiated_at: str | None
    results_url: str | None


class MessageBatchList(ResponseModel):
    """A page of Message Batches, newest first."""

    data: list[MessageBatch]
    has_more: bool
    first_id: str | None
    last_id: str | None


class DeletedMessageBatch(ResponseModel):
    id: str
    type: Literal["message_batch_deleted"] = "message_batch_deleted"


# -- token counting and models -----------------------------------------------------------------------------------------


class CountTokensRequest(RequestModel):
    """``POST /anthropic/v1/messages/count_tokens``: a Messages request's prompt, without ``max_tokens``. The fields
    after ``system`` are declared so that the service refuses them by name (``unsupported_parameter``)."""

    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[ContentBlockParam] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    thinking: Any = None
    mcp_servers: list[Any] | None = None
    context_management: Any = None
    output_format: Any = None
    output_config: Any = None
    cache_control: Any = None


class MessageTokensCount(ResponseModel):
    """What ``count_tokens`` answers: the prompt's tokens as ``POST /anthropic/v1/messages`` would count them."""

    input_tokens: int


class ModelInfo(ResponseModel):
    """A model in Anthropic's shape (``created_at`` RFC 3339)."""

    type: Literal["model"] = "model"
    id: str
    display_name: str
    created_at: str
    lifecycle: Literal["active"] = "active"
    #: the model's context length in tokens, where this server knows it (the resident model's)
    max_input_tokens: int | None = None


class ModelInfoList(ResponseModel):
    """``GET /anthropic/v1/models``."""

    data: list[ModelInfo]
    has_more: bool
    first_id: str | None
    last_id: str | None
