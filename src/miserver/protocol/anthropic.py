"""Pydantic models of Anthropic's Messages API (``POST /anthropic/v1/messages``) and Message Batches API.

Source: Anthropic's API reference (Messages, Message Batches, Errors) and the shapes the official ``anthropic`` SDK
validates. Text and client tools are served: ``text``, ``tool_use`` and ``tool_result`` blocks are read, a content
block of another known type is refused on its ``type`` (``unsupported_value``), one of no known type too
(``invalid_value``). Fields that ask for features the resident engine lacks (extended thinking, MCP servers...) are
declared so that the service refuses them by name; ``cache_control``, which changes nothing in the answer, is
accepted without effect where Anthropic takes it (:mod:`miserver.protocol.anthropic_cache`). Tool definitions and
``tool_choice`` are in :mod:`miserver.protocol.anthropic_tools`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Discriminator, Field, Tag
from pydantic_core import PydanticCustomError

from .anthropic_cache import CacheControl
from .anthropic_tools import ToolChoice, ToolUnion
from .common import ALWAYS_STRICT, RequestModel, ResponseModel

#: Content block types of Anthropic's API that a text-only server cannot read or produce, with their refusal words.
UNREADABLE_BLOCKS = {
    "image": "image content",
    "document": "document content",
    "search_result": "a search result",
    "server_tool_use": "a server tool use",
    "web_search_tool_result": "a web search result",
    "thinking": "a thinking block",
    "redacted_thinking": "a thinking block",
    "container_upload": "a container upload",
    "mcp_tool_use": "an MCP tool use",
    "mcp_tool_result": "an MCP tool result",
}
BLOCK_TYPES = ("text", "tool_use", "tool_result", *UNREADABLE_BLOCKS)


def _refuse_block(kind: str) -> str:
    raise PydanticCustomError(
        "unsupported_value",
        f"{UNREADABLE_BLOCKS[kind]} ('{kind}' block) is not supported by this server, which reads text and client "
        "tools only; send the content as a string or as 'text', 'tool_use' and 'tool_result' blocks.",
    )


def _unknown_block(kind: str) -> str:
    raise PydanticCustomError(
        "invalid_value",
        f"'{kind}' is not a content block type (this server reads 'text', 'tool_use' and 'tool_result' blocks).",
    )


class TextBlockParam(RequestModel):
    """A ``{"type": "text", "text": ...}`` block of a message's content or of ``system``. ``cache_control`` (a
    prompt caching breakpoint, see :mod:`~miserver.protocol.anthropic_cache`) is accepted without effect;
    ``citations`` is declared so that the service can refuse it by name (no citations here)."""

    type: Literal["text"]
    text: str
    cache_control: CacheControl = None
    citations: Any = None


class ToolUseBlockParam(RequestModel):
    """An earlier call of a tool, in an ``assistant`` turn: its ``id`` (``toolu_...``, which a later ``tool_result``
    names), the tool's ``name`` and its ``input`` object. ``cache_control`` is accepted without effect."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl = None


class ToolResultBlockParam(RequestModel):
    """The result of an earlier call, in a ``user`` turn: ``tool_use_id`` names the ``tool_use`` block it answers;
    ``content`` is a string or blocks (``text`` only is read); ``is_error`` says the call failed. ``cache_control``
    is accepted without effect."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[ContentBlockParam] | None = None
    is_error: bool | None = None
    cache_control: CacheControl = None


class UnreadableBlock(RequestModel):
    """A known content block that this server cannot take (image, document, thinking...): refused on ``type``."""

    type: Annotated[str, AfterValidator(_refuse_block)]


class UnknownBlock(RequestModel):
    """A content block of no known type: refused on its ``type`` (400 ``invalid_value``)."""

    type: Annotated[str, AfterValidator(_unknown_block)]


def _block_kind(block: Any) -> str:
    kind = block.get("type") if isinstance(block, dict) else getattr(block, "type", "text")
    if kind == "text" or not isinstance(block, (dict, RequestModel)):
        return "text"
    if kind in ("tool_use", "tool_result"):
        return str(kind)
    return "unreadable" if isinstance(kind, str) and kind in UNREADABLE_BLOCKS else "unknown"


#: One content block, told apart by its ``type`` so that an error names the right field.
ContentBlockParam = Annotated[
    Annotated[TextBlockParam, Tag("text")]
    | Annotated[ToolUseBlockParam, Tag("tool_use")]
    | Annotated[ToolResultBlockParam, Tag("tool_result")]
    | Annotated[UnreadableBlock, Tag("unreadable")]
    | Annotated[UnknownBlock, Tag("unknown")],
    Discriminator(_block_kind),
]
ToolResultBlockParam.model_rebuild()


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

    ``max_tokens`` is required, as in Anthropic's API; ``temperature`` is 0..1 (default 1). ``cache_control`` (a
    prompt caching breakpoint on the request's last cacheable block) is accepted without effect. The fields after it
    are declared so that the service refuses them by name (``unsupported_parameter``).
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
    tools: list[ToolUnion] | None = None
    tool_choice: ToolChoice | None = None
    cache_control: CacheControl = None
    thinking: Any = None
    mcp_servers: list[Any] | None = None
    container: Any = None
    context_management: Any = None
    service_tier: str | None = None
    output_format: Any = None
    output_config: Any = None
    diagnostics: Any = None
    inference_geo: str | None = None
    speed: str | None = None


# -- the Message ---------------------------------------------------------------------------------------------------

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use", "refusal"]


class TextBlock(ResponseModel):
    """A text block of the answer."""

    type: Literal["text"] = "text"
    text: str


class ToolUseBlock(ResponseModel):
    """A call of a tool in the answer: ``id`` ``toolu_...``, the tool's ``name``, its ``input`` (a JSON object)."""

    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class MessageUsage(ResponseModel):
    """``usage`` of a Message: tokens in the prompt and generated; ``cache_creation_input_tokens`` and
    ``cache_read_input_tokens`` are 0, every prompt token counted and priced alike (see
    ``common.PromptTokensDetails``; a ``cache_control`` breakpoint is accepted without effect)."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class Message(ResponseModel):
    """Anthropic's Message object: ``id`` ``msg_...``, one text block or the tool calls, the stop reason and usage."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[TextBlock | ToolUseBlock]
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
    #: a ``tool_use`` block starts with ``input: {}``; its input follows in ``input_json_delta`` events
    content_block: TextBlock | ToolUseBlock


class TextDelta(ResponseModel):
    type: Literal["text_delta"] = "text_delta"
    text: str


class InputJsonDelta(ResponseModel):
    """A piece of a ``tool_use`` block's input as JSON text; the pieces of a block joined are its input."""

    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class ContentBlockDeltaEvent(ResponseModel):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: TextDelta | InputJsonDelta


class ContentBlockStopEvent(ResponseModel):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class MessageDelta(ResponseModel):
    stop_reason: StopReason | None
    stop_sequence: str | None


class MessageDeltaUsage(ResponseModel):
    """The stream's final counts (tokens): ``input_tokens`` too, as Anthropic's API reports them cumulatively; the
    prompt cache counts are 0, as in the Message's ``usage``."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


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
    is validated (an invalid ``params`` becomes an ``errored`` result, as a batch line). Always strict."""

    model_config = ALWAYS_STRICT

    custom_id: str
    params: dict[str, Any]


class MessageBatchCreateRequest(RequestModel):
    """``POST /anthropic/v1/messages/batches``: the requests, inline. Always strict, as Anthropic's: an unknown field
    (here or in a request item) is 400 naming it, whatever ``X-miLLM-Strict`` says."""

    model_config = ALWAYS_STRICT

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
    """``POST /anthropic/v1/messages/count_tokens``: a Messages request's prompt (its tools included), without
    ``max_tokens``. ``cache_control`` is accepted without effect; the fields after it are declared so that the
    service refuses them by name (``unsupported_parameter``)."""

    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[ContentBlockParam] | None = None
    tools: list[ToolUnion] | None = None
    tool_choice: ToolChoice | None = None
    cache_control: CacheControl = None
    thinking: Any = None
    mcp_servers: list[Any] | None = None
    context_management: Any = None
    output_format: Any = None
    output_config: Any = None


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
