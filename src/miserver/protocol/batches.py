"""Pydantic models of the Batches API (``/v1/batches``) and of batch input and output lines (DESIGN §3.2-§3.3)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, InstanceOf

from .common import ALWAYS_STRICT, RequestModel, ResponseModel

BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
]

#: Every batch status (DESIGN §4), in lifecycle order.
BATCH_STATUSES: tuple[BatchStatus, ...] = (
    "validating",
    "failed",
    "in_progress",
    "finalizing",
    "completed",
    "expired",
    "cancelling",
    "cancelled",
)
#: The statuses a batch never leaves: the one definition the whole code base reads.
TERMINAL: frozenset[str] = frozenset({"completed", "failed", "expired", "cancelled"})

#: The endpoint of Anthropic's Message Batches, whose lines keep Anthropic's error format.
ANTHROPIC_MESSAGES = "/anthropic/v1/messages"
#: Endpoints a batch accepts in this release; the rest of DESIGN §3.2 are refused until they exist.
BATCH_ENDPOINTS: tuple[str, ...] = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/api/probes/score",
    "/v1/responses",
    ANTHROPIC_MESSAGES,
)


class OutputExpiresAfter(RequestModel):
    """``output_expires_after`` of a batch create: the output files expire ``seconds`` after the batch's creation."""

    model_config = ALWAYS_STRICT

    anchor: Literal["created_at"]
    seconds: int = Field(ge=3600, le=2_592_000)


class BatchCreateRequest(RequestModel):
    """``POST /v1/batches``. ``completion_window`` is ``"24h"`` or whole hours ``"1h"``-``"168h"``. Always strict, as
    OpenAI's: an unknown field is 400 ``unknown_parameter`` naming it, whatever ``X-miLLM-Strict`` says."""

    model_config = ALWAYS_STRICT

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: OutputExpiresAfter | None = None
    pack: bool | None = None
    #: extension (model life): pin the batch to this weights revision (``X-miLLM-Weights``); while the resident
    #: revision differs its rows wait with ``waiting_reason: weights_changed``
    weights_revision: str | None = Field(None, min_length=1, max_length=64)
    #: extension (scheduling): batches of higher priority run first (before deadlines decide); default 0
    priority: int | None = Field(None, ge=-1000, le=1000)
    #: extension (ETA): run the batch even when its estimated time to finish exceeds its window (it may expire)
    millm_allow_late: bool | None = None


class BatchInputLine(RequestModel):
    """One line of a batch input file: ``{"custom_id", "method", "url", "body"}`` (DESIGN §3.3), parsed strictly
    (an unknown line field is refused). The values are checked by ``batches.validate.check_line``; ``body`` is the
    endpoint service's to parse, so it is taken as the object it is (checked to be an object, never copied: a deep
    copy of every body would cost as much as reading the file)."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    custom_id: str
    method: str
    url: str
    body: InstanceOf[dict]  # type: ignore[type-arg]  # InstanceOf needs the bare class; the keys are strings (JSON)


class BatchLineError(ResponseModel):
    """``error`` of an error-file line: the code and message of the row's error (the hosted reference's shape)."""

    code: str | None
    message: str


class BatchLineResponseExtension(ResponseModel):
    """``response.millm`` of an output line: whether the row ran in a pack, and its provenance headers."""

    packed: bool
    headers: dict[str, str]


class BatchLineResponse(ResponseModel):
    """``response`` of a result line: the synchronous route's status code and body."""

    status_code: int
    request_id: str
    body: dict[str, Any]
    millm: BatchLineResponseExtension | None = None


class BatchLineExtension(ResponseModel):
    """``millm`` of an error line refused at validation: its 1-based line number in the input file."""

    line: int


class BatchOutputLine(ResponseModel):
    """One line of a batch's output or error file (DESIGN §3.3). ``response`` is null for a row that never ran;
    ``error`` is null exactly on output (success) lines. Serialise with ``model_dump_json(exclude_unset=True)`` so
    that the optional ``millm`` blocks appear only where they were set."""

    id: str
    custom_id: str | None
    response: BatchLineResponse | None
    error: BatchLineError | None
    millm: BatchLineExtension | None = None


class BatchError(ResponseModel):
    code: str | None
    message: str | None
    param: str | None
    line: int | None


class BatchErrors(ResponseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class RequestCounts(ResponseModel):
    total: int
    completed: int
    failed: int


class InputTokensDetails(ResponseModel):
    cached_tokens: int = 0


class OutputTokensDetails(ResponseModel):
    reasoning_tokens: int = 0


class BatchUsage(ResponseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = InputTokensDetails()
    output_tokens: int
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()
    total_tokens: int


class BatchExtension(ResponseModel):
    """miServer's ``millm`` block on a batch."""

    pack: bool
    waiting_reason: (
        Literal[
            "queued",
            "model_not_resident",
            "lease_unavailable",
            "weights_torn",
            "weights_changed",
            "off_peak",
            "paused",
            "insufficient_balance",
            "upstream_unavailable",
        ]
        | None
    ) = None
    lease_holder: str | None = None
    description: str | None = None
    #: the weights revision the batch is pinned to (``weights_revision`` at create), None when not pinned
    weights_revision: str | None = None
    #: scheduling: the batch's priority, whether it is paused (never once it has ended), and its estimated
    #: completion time (Unix seconds; None until a rate of its model and endpoint is measured, and once it has ended)
    priority: int = 0
    paused: bool = False
    estimated_completion_at: int | None = None


class Batch(ResponseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    model: str | None
    errors: BatchErrors | None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts
    metadata: dict[str, str] | None
    usage: BatchUsage
    millm: BatchExtension


class BatchList(ResponseModel):
    """``GET /v1/batches``: a page of Batch objects, newest first (the OpenAI list envelope)."""

    object: Literal["list"] = "list"
    data: list[Batch]
    first_id: str | None
    last_id: str | None
    has_more: bool
