"""Anthropic's Message Batches API (``/anthropic/v1/messages/batches``): another envelope over the same durable batch.

A create writes its inline ``requests`` as an ordinary batch input file (JSON Lines of ``{custom_id, method, url:
"/anthropic/v1/messages", body: params}``) and creates an ordinary batch on the endpoint ``/anthropic/v1/messages``
through :func:`miserver.services.batch_api.batches.create_batch`: the same table, validation, runner, exactly-once
recording
and interactive-first admission as ``/v1/batches``. The Message Batch id is the batch id under another prefix
(``batch_<x>`` is ``msgbatch_<x>``), and any batch on that endpoint, however it was created, is a Message Batch.
Results are read from the batch's output and error files (output lines first, then error lines; Anthropic does not
promise the input order either).
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

from ...clock import now
from ...errors import (
    ANTHROPIC_ERROR_TYPES,
    ConflictError,
    FileExpiredError,
    InvalidRequestError,
    NotFoundError,
    PayloadTooLargeError,
)
from ...ids import ordered_id
from ...protocol.anthropic import (
    MAX_BATCH_BYTES,
    DeletedMessageBatch,
    MessageBatch,
    MessageBatchCreateRequest,
    MessageBatchList,
    MessageBatchRequestCounts,
)
from ...protocol.batches import TERMINAL
from ...protocol.parsing import parse_request
from ...store import Store
from ...store import batches as store_batches
from ...store import files as store_files
from ...store import message_batches as store_message_batches
from ...store import rows as store_rows
from ...store.batches import BatchRecord
from ..accounts import keys as accounts
from ..accounts.prices import PriceTable
from ..inference.checks import decode_json
from . import batches as batches_service
from .files import content_expired

ENDPOINT = "/anthropic/v1/messages"
BATCH_PREFIX, MESSAGE_BATCH_PREFIX = "batch_", "msgbatch_"
#: Anthropic's ``custom_id``: 1-64 letters, digits, ``-`` and ``_``.
CUSTOM_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
#: Anthropic's batches end (expire) 24 hours after creation.
WINDOW_HOURS = 24
#: ``metadata`` key of the batches this API creates: the number of requests (known before validation counts them).
REQUESTS_KEY = "anthropic_requests"
#: ``GET .../batches``: ``limit`` is 1..this.
LIST_LIMIT_MAX = 1000


def message_batch_id(batch_id: str) -> str:
    """``batch_<x>`` -> ``msgbatch_<x>``."""
    return MESSAGE_BATCH_PREFIX + batch_id.removeprefix(BATCH_PREFIX)


def batch_id_of(message_batch_id: str) -> str | None:
    """``msgbatch_<x>`` -> ``batch_<x>``; None for an id of another form."""
    if not message_batch_id.startswith(MESSAGE_BATCH_PREFIX):
        return None
    return BATCH_PREFIX + message_batch_id.removeprefix(MESSAGE_BATCH_PREFIX)


def not_found(message_batch_id: str) -> NotFoundError:
    """404 (``not_found_error``) for an id that names no Message Batch."""
    return NotFoundError(f"No such Message Batch: {message_batch_id}", param="message_batch_id")


def rfc3339(seconds: int | None) -> str | None:
    """Unix seconds as an RFC 3339 UTC time (``2026-12-01T00:00:00Z``); None stays None."""
    if seconds is None:
        return None
    return datetime.fromtimestamp(seconds, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _ended_at(b: BatchRecord) -> int | None:
    return b.completed_at or b.failed_at or b.expired_at or b.cancelled_at


def request_counts(b: BatchRecord, unrun: int) -> MessageBatchRequestCounts:
    """The counts of a batch: ``unrun`` is its rows never run (counted once it has ended: ``expired`` for an
    expired batch, ``canceled`` for a cancelled one, ``errored`` for one that failed, as :func:`result_line` reads
    them). Before validation has counted the lines, the number of requests this API wrote is ``processing``."""
    if b.status in TERMINAL:
        expired = unrun if b.status == "expired" else 0
        canceled = unrun if b.status == "cancelled" else 0
        return MessageBatchRequestCounts(
            processing=0,
            succeeded=b.completed,
            errored=b.failed - expired - canceled,
            canceled=canceled,
            expired=expired,
        )
    total = b.total or int((b.metadata or {}).get(REQUESTS_KEY, "0"))
    return MessageBatchRequestCounts(
        processing=max(total - b.completed - b.failed, 0),
        succeeded=b.completed,
        errored=b.failed,
        canceled=0,
        expired=0,
    )


def message_batch(b: BatchRecord, unrun: int, base_url: str) -> dict[str, Any]:
    """The Message Batch object of batch ``b`` (``base_url`` ends with ``/``: the server's, for ``results_url``)."""
    ended = b.status in TERMINAL
    status = "ended" if ended else "canceling" if b.status == "cancelling" else "in_progress"
    mid = message_batch_id(b.id)
    return MessageBatch(
        id=mid,
        processing_status=status,  # type: ignore[arg-type]
        request_counts=request_counts(b, unrun),
        ended_at=rfc3339(_ended_at(b)),
        created_at=rfc3339(b.created_at) or "",
        expires_at=rfc3339(b.expires_at) or "",
        cancel_initiated_at=rfc3339(b.cancelling_at),
        results_url=f"{base_url}anthropic/v1/messages/batches/{mid}/results" if ended else None,
    ).model_dump()


async def _get(store: Store, message_batch_id: str) -> tuple[BatchRecord, int]:
    """The batch of ``message_batch_id`` and its unrun rows (0 until it has ended); 404 when there is none on this
    endpoint."""
    batch_id = batch_id_of(message_batch_id)
    async with store.tx() as conn:
        batch = await store_batches.get_batch(conn, batch_id) if batch_id else None
        if batch is None or batch.endpoint != ENDPOINT or not accounts.visible(batch.owner_key_id):
            raise not_found(message_batch_id)
        unrun = await store_rows.count_pending(conn, batch.id) if batch.terminal else 0
    return batch, unrun


# -- operations ------------------------------------------------------------------------------------------------------


def check_create(raw: bytes) -> MessageBatchCreateRequest:
    """Parse a create body: 413 over 256 MB; 400 for the JSON, the schema (1-100,000 requests, each
    ``{custom_id, params}``; always strict: an unknown field, of the body or of a request, is 400
    ``unknown_parameter`` naming it), a ``custom_id`` not of 1-64 letters, digits, ``-``, ``_``, or used twice. The
    ``params`` are checked when the batch is validated (an invalid one becomes an ``errored`` result)."""
    if len(raw) > MAX_BATCH_BYTES:
        raise PayloadTooLargeError(
            f"The request body is {len(raw)} bytes; a Message Batch may be at most {MAX_BATCH_BYTES} bytes.",
            code="request_too_large",
        )
    req = parse_request(MessageBatchCreateRequest, decode_json(raw), strict=True)
    seen: set[str] = set()
    for i, item in enumerate(req.requests):
        param = f"requests[{i}].custom_id"
        if not CUSTOM_ID.match(item.custom_id):
            raise InvalidRequestError(
                f"Invalid value for '{param}': {item.custom_id!r}; use 1 to 64 letters, digits, '-' and '_'.",
                param=param,
            )
        if item.custom_id in seen:
            raise InvalidRequestError(
                f"Invalid value for '{param}': the custom_id {item.custom_id!r} is used by an earlier request.",
                param=param,
                code="duplicate_custom_id",
            )
        seen.add(item.custom_id)
    return req


def _lines(req: MessageBatchCreateRequest) -> list[bytes]:
    return [
        json.dumps(
            {"custom_id": r.custom_id, "method": "POST", "url": ENDPOINT, "body": r.params}, ensure_ascii=False
        ).encode("utf-8")
        + b"\n"
        for r in req.requests
    ]


async def create(
    store: Store,
    raw: bytes,
    *,
    base_url: str,
    max_window_hours: int,
    pack_default: bool,
    file_expiry_seconds: int,
    caller_lease: str | None = None,
    prices: PriceTable | None = None,
) -> dict[str, Any]:
    """Create a Message Batch: its requests become an input file, and a batch on ``/anthropic/v1/messages`` is
    created over it by the batches service (the caller then wakes the runner; the batch keeps the batch prices of
    ``prices`` as they are now). Both belong to the calling key. Returns the Message Batch."""
    req = check_create(raw)
    created = now()
    async with store.tx() as conn:
        record = await store_files.insert_file(
            conn,
            file_id=ordered_id("file-"),
            purpose="batch",
            filename="message_batch_requests.jsonl",
            created_at=created,
            expires_at=created + file_expiry_seconds,
            chunks=_lines(req),
            owner_key_id=accounts.current().owner,
        )
    body = {
        "input_file_id": record.id,
        "endpoint": ENDPOINT,
        "completion_window": f"{min(WINDOW_HOURS, max_window_hours)}h",
        "metadata": {REQUESTS_KEY: str(len(req.requests))},
    }
    form = batches_service.BatchCreate(raw=json.dumps(body).encode(), caller_lease=caller_lease)
    answer = await batches_service.create_batch(
        store, form, max_window_hours=max_window_hours, pack_default=pack_default, prices=prices
    )
    batch, unrun = await _get(store, message_batch_id(answer["id"]))
    return message_batch(batch, unrun, base_url)


async def retrieve(store: Store, message_batch_id: str, *, base_url: str) -> dict[str, Any]:
    """The Message Batch; 404 when there is none."""
    batch, unrun = await _get(store, message_batch_id)
    return message_batch(batch, unrun, base_url)


def _cursor(value: str | None, param: str) -> str | None:
    if value is None:
        return None
    batch_id = batch_id_of(value)
    if batch_id is None:
        raise InvalidRequestError(
            f"Invalid '{param}': {value!r} is not a Message Batch id (msgbatch_...).", param=param
        )
    return batch_id


async def list_batches(
    store: Store, *, limit: int, after_id: str | None, before_id: str | None, base_url: str
) -> dict[str, Any]:
    """A page of Message Batches, newest first (``after_id``: the page after that batch; ``before_id``: the page
    before it); 400 for a ``limit`` outside 1..1000, both cursors at once, or a cursor of another form."""
    if not 1 <= limit <= LIST_LIMIT_MAX:
        raise InvalidRequestError(f"Invalid 'limit': must be between 1 and {LIST_LIMIT_MAX}.", param="limit")
    if after_id is not None and before_id is not None:
        raise InvalidRequestError("Send at most one of 'after_id' and 'before_id'.", param="before_id")
    after, before = _cursor(after_id, "after_id"), _cursor(before_id, "before_id")
    async with store.tx() as conn:
        page, has_more = await store_message_batches.list_for_endpoint(
            conn, endpoint=ENDPOINT, limit=limit, after=after, before=before, owner=accounts.scope()
        )
        unrun = [await store_rows.count_pending(conn, b.id) if b.terminal else 0 for b in page]
    data = [message_batch(b, n, base_url) for b, n in zip(page, unrun)]
    return MessageBatchList.model_validate(
        {
            "data": data,
            "has_more": has_more and bool(data),
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
        }
    ).model_dump()


async def cancel(store: Store, message_batch_id: str, *, base_url: str) -> dict[str, Any]:
    """Ask the batch to stop (the batches service's cancel); returns the Message Batch, now ``canceling`` (or as it
    is when already canceling or canceled); 404; 409 for a batch that has ended otherwise. The caller wakes the
    runner."""
    batch, _ = await _get(store, message_batch_id)
    await batches_service.cancel_batch(store, batch.id)
    batch, unrun = await _get(store, message_batch_id)
    return message_batch(batch, unrun, base_url)


async def delete(store: Store, message_batch_id: str) -> dict[str, Any]:
    """Delete an ended Message Batch with its rows and result files (and the input file this API wrote for it);
    404; 409 ``batch_not_ended`` while it is processing (cancel it first)."""
    batch, _ = await _get(store, message_batch_id)
    async with store.tx() as conn:
        if not await store_message_batches.delete_ended(conn, batch.id):
            raise ConflictError(
                f"The Message Batch {message_batch_id} is still processing; cancel it and delete it once it has ended.",
                param="message_batch_id",
                code="batch_not_ended",
            )
        owned = [batch.output_file_id, batch.error_file_id]
        if REQUESTS_KEY in (batch.metadata or {}):
            owned.append(batch.input_file_id)
        for file_id in owned:
            if file_id is None:
                continue
            await store_files.get_file(conn, file_id, lock=True)  # a batch create over the file waits for this delete
            if await store_files.referencing_active_batch(conn, file_id) is None:
                await store_files.delete_file(conn, file_id)
    return DeletedMessageBatch(id=message_batch_id).model_dump()


async def results(store: Store, message_batch_id: str) -> AsyncIterator[bytes]:
    """The results of an ended Message Batch as JSON Lines (one ``{custom_id, result}`` per request). Raises before
    the first byte: 404; 409 ``batch_not_ended`` while it is processing; 404 ``file_expired`` once its result
    files have expired."""
    batch, _ = await _get(store, message_batch_id)
    if not batch.terminal:
        raise ConflictError(
            f"The Message Batch {message_batch_id} is still processing; its results are available once it has ended.",
            param="message_batch_id",
            code="batch_not_ended",
        )
    file_ids = [f for f in (batch.output_file_id, batch.error_file_id) if f is not None]
    async with store.tx() as conn:
        for file_id in file_ids:
            record = await store_files.get_file(conn, file_id)
            if record is None or content_expired(record, now()):
                raise FileExpiredError(
                    f"The results of the Message Batch {message_batch_id} have expired.", param="message_batch_id"
                )
    return _result_lines(store, file_ids)


async def _result_lines(store: Store, file_ids: list[str]) -> AsyncIterator[bytes]:
    for file_id in file_ids:
        rest = b""
        async for piece in store.file_content(file_id):
            *complete, rest = (rest + piece).split(b"\n")
            for raw in complete:
                if raw.strip():
                    yield result_line(json.loads(raw)) + b"\n"
        if rest.strip():
            yield result_line(json.loads(rest)) + b"\n"


def _error_body(line: dict[str, Any]) -> dict[str, Any]:
    response = line.get("response") or {}
    body = response.get("body")
    if isinstance(body, dict) and body.get("type") == "error":
        return body  # already Anthropic's envelope (the route's own error body)
    status = int(response.get("status_code") or 500)
    kind = ANTHROPIC_ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    message = (line.get("error") or {}).get("message") or "The request failed."
    return {"type": "error", "error": {"type": kind, "message": message}}


#: Anthropic's error type for a request its batch left unrun for a reason other than a cancel or the expiry.
UNRUN_ERROR_TYPES = {
    "batch_failed": "invalid_request_error",
    "insufficient_quota": "billing_error",
    "key_revoked": "authentication_error",
}


def result_line(line: dict[str, Any]) -> bytes:
    """One result of Anthropic's shape from one line of a batch's output or error file: ``succeeded`` with the
    Message, ``errored`` with the route's error body, ``canceled`` or ``expired`` for a request never run (a
    request left unrun by its batch's failure, or its key's, is ``errored`` with the reason)."""
    custom_id = line.get("custom_id") or f"line-{(line.get('millm') or {}).get('line', 0)}"
    if line.get("error") is None:
        result: dict[str, Any] = {"type": "succeeded", "message": line["response"]["body"]}
    elif line.get("response") is None:
        code = line["error"].get("code")
        if code in ("batch_expired", "batch_cancelled"):
            result = {"type": "expired" if code == "batch_expired" else "canceled"}
        else:
            kind = UNRUN_ERROR_TYPES.get(code, "invalid_request_error")
            message = line["error"].get("message") or "The request was not run."
            result = {"type": "errored", "error": {"type": "error", "error": {"type": kind, "message": message}}}
    else:
        result = {"type": "errored", "error": _error_body(line)}
    return json.dumps({"custom_id": custom_id, "result": result}, ensure_ascii=False).encode("utf-8")
