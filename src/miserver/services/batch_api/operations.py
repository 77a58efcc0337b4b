"""Batch operations beyond OpenAI's API: pause and resume, results while running, retry and delete;
the estimate that refuses a batch that cannot finish in its window is in ``services/batch_api/eta.py``.

Routes in ``api/operations.py`` parse the request and return what these functions build; status and field changes
are the guarded statements of ``store/`` (a miss raises, and is answered 409 here).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection

from ...clock import now
from ...errors import ConflictError, InvalidRequestError
from ...ids import ordered_id
from ...protocol.batches import TERMINAL
from ...store import Store
from ...store import batches as store_batches
from ...store import files as store_files
from ...store import message_batches as store_message_batches
from ...store import operations as store_operations
from ...store.batches import BatchRecord, StaleStatus
from ..accounts import keys as accounts
from . import batches as batches_service

#: The statuses a pause or a resume applies to (dispatch stops at the next row boundary; validation goes on).
PAUSABLE = ("validating", "in_progress")
#: A terminal batch can be retried for this long after it ended (seconds).
RETRY_WINDOW_SECONDS = 30 * 86400
#: ``GET /v1/batches/{id}/results``: ``limit`` is 1..this (default :data:`RESULTS_DEFAULT_LIMIT`).
RESULTS_MAX_LIMIT = 1000
RESULTS_DEFAULT_LIMIT = 100
#: ``status`` of the results route -> the rows' stored outcome.
RESULT_STATUSES = {"succeeded": "ok", "failed": "error"}


async def _get(conn: AsyncConnection, batch_id: str) -> BatchRecord:
    """The batch, or 404 ``not_found`` (also for another key's batch)."""
    batch = await store_batches.get_batch(conn, batch_id)
    if batch is None or not accounts.visible(batch.owner_key_id):
        raise batches_service.not_found(batch_id)
    return batch


def _not_live(batch_id: str, status: str, what: str) -> ConflictError:
    return ConflictError(f"Cannot {what} a batch with status '{status}'.", param="batch_id", code="batch_not_active")


async def pause(store: Store, batch_id: str) -> dict[str, Any]:
    """Pause a ``validating`` or ``in_progress`` batch: no further row is dispatched (the row running finishes and is
    recorded); the batch stays ``in_progress`` with ``waiting_reason: paused`` and its window keeps running. Pausing a
    paused batch returns it unchanged. Raises 404, and 409 ``batch_not_active`` for another status."""
    async with store.tx() as conn:
        batch = await _get(conn, batch_id)
        if batch.paused_at is None:
            try:
                await store_batches.set_fields(conn, batch_id, PAUSABLE, paused_at=now())
            except StaleStatus:
                raise _not_live(batch_id, batch.status, "pause") from None
        batch = await _get(conn, batch_id)
    if batch.status not in PAUSABLE:
        raise _not_live(batch_id, batch.status, "pause")
    return batches_service.batch_object(batch)


async def resume(store: Store, batch_id: str) -> dict[str, Any]:
    """Resume a paused batch (dispatch goes on from its first unrecorded row); a batch that is not paused is returned
    unchanged. Raises 404, and 409 ``batch_not_active`` for a batch that has ended."""
    async with store.tx() as conn:
        batch = await _get(conn, batch_id)
        if batch.terminal:
            raise _not_live(batch_id, batch.status, "resume")
        if batch.paused_at is not None:
            try:
                await store_batches.set_fields(conn, batch_id, batches_service.LIVE_STATUSES, paused_at=None)
            except StaleStatus:
                raise _not_live(batch_id, batch.status, "resume") from None
        batch = await _get(conn, batch_id)
    return batches_service.batch_object(batch)


@dataclass(frozen=True)
class ResultsPage:
    """A page of result lines (JSONL text, input order); ``last_line``: the input line through which the page has
    looked (the next page's ``offset``); ``incomplete``: the batch may still record rows."""

    body: bytes
    last_line: int
    incomplete: bool


def _results_params(offset: int, limit: int, status: str | None) -> str | None:
    if offset < 0:
        raise InvalidRequestError("Invalid 'offset': must be 0 or more.", param="offset")
    if not 1 <= limit <= RESULTS_MAX_LIMIT:
        raise InvalidRequestError(f"Invalid 'limit': must be between 1 and {RESULTS_MAX_LIMIT}.", param="limit")
    if status is None:
        return None
    if status not in RESULT_STATUSES:
        raise InvalidRequestError(
            f"Invalid 'status': {status!r}. Supported: {', '.join(RESULT_STATUSES)}.", param="status"
        )
    return RESULT_STATUSES[status]


async def results(
    store: Store, batch_id: str, *, offset: int, limit: int, status: str | None, custom_id: str | None
) -> ResultsPage:
    """The result lines recorded so far of rows after input line ``offset``, in input order, at most ``limit``;
    ``status`` (``succeeded``/``failed``) and ``custom_id`` filter them. While the batch runs, only the rows before
    its first unrecorded row are served, so paging by ``last_line`` never skips a row recorded later. Raises 400
    naming the param, 404 for no such batch."""
    outcome = _results_params(offset, limit, status)
    async with store.read() as conn:
        batch = await _get(conn, batch_id)
        incomplete = batch.status not in TERMINAL
        first_pending = await store_operations.first_pending_line(conn, batch_id) if incomplete else None
        last = await store_operations.last_line(conn, batch_id)
        through = first_pending - 1 if first_pending is not None else last
        if batch.status == "validating":
            through = offset  # rows exist only once validation ends
        rows = await store_operations.recorded_rows(
            conn, batch_id, after_line=offset, through_line=through, limit=limit, outcome=outcome, custom_id=custom_id
        )
    last_line = rows[-1].line if len(rows) == limit else max(offset, through)
    body = b"".join(r.result.encode("utf-8") + b"\n" for r in rows)
    return ResultsPage(body, last_line, incomplete)


async def retry(store: Store, batch_id: str, *, max_window_hours: int, pack_default: bool) -> dict[str, Any]:
    """A new batch of the rows of terminal batch ``batch_id`` that did not succeed (failed when run, cancelled,
    expired), written as a new input file, on the same endpoint, window, pack and priority, with ``metadata.retry_of``;
    it shares no row with the first, so completed rows never run again. Returns the new Batch (the caller wakes the
    runner). Raises 404; 409 ``batch_not_finished`` (not terminal), ``retry_window_passed`` (ended over 30 days ago)
    and ``nothing_to_retry``."""
    async with store.tx() as conn:
        batch = await _get(conn, batch_id)
        if not batch.terminal:
            raise ConflictError(
                f"Cannot retry a batch with status '{batch.status}': wait until it ends (or cancel it).",
                param="batch_id",
                code="batch_not_finished",
            )
        ended = batch.completed_at or batch.failed_at or batch.expired_at or batch.cancelled_at or batch.created_at
        if now() - ended > RETRY_WINDOW_SECONDS:
            raise ConflictError(
                "The batch ended more than 30 days ago and can no longer be retried.",
                param="batch_id",
                code="retry_window_passed",
            )
        rows = await store_operations.retryable_rows(conn, batch_id)
        if not rows:
            raise ConflictError(
                "The batch has no failed, cancelled or expired row to retry.", param="batch_id", code="nothing_to_retry"
            )
        created = now()
        lines = [
            json.dumps({"custom_id": cid, "method": "POST", "url": batch.endpoint, "body": json.loads(body)}).encode()
            + b"\n"
            for cid, body in rows
        ]
        record = await store_files.insert_file(
            conn,
            file_id=ordered_id("file-"),
            purpose="batch",
            filename=f"{batch_id}_retry.jsonl",
            created_at=created,
            expires_at=created + RETRY_WINDOW_SECONDS,
            chunks=lines,
            owner_key_id=accounts.current().owner,  # the caller's, as the batch create_batch makes from it
        )
    metadata = dict(batch.metadata or {})
    metadata["retry_of"] = batch_id
    body: dict[str, Any] = {
        "input_file_id": record.id,
        "endpoint": batch.endpoint,
        "completion_window": batch.completion_window,
        "metadata": metadata,
        "pack": batch.pack,
        "priority": batch.priority,
        "millm_allow_late": True,  # the first batch was accepted: its retry is not refused for lateness
    }
    form = batches_service.BatchCreate(raw=json.dumps(body).encode(), caller_lease=batch.caller_lease)
    return await batches_service.create_batch(store, form, max_window_hours=max_window_hours, pack_default=pack_default)


async def delete(store: Store, batch_id: str) -> dict[str, Any]:
    """Delete a terminal batch and its rows (its files stay, under their own retention). Returns ``{id, object:
    "batch", deleted: true}``. Raises 404, and 409 ``batch_not_finished`` for a batch that has not ended."""
    async with store.tx() as conn:
        batch = await _get(conn, batch_id)
        if not await store_message_batches.delete_ended(conn, batch_id):
            raise ConflictError(
                f"Cannot delete a batch with status '{batch.status}': cancel it and delete it once it has ended.",
                param="batch_id",
                code="batch_not_finished",
            )
    return {"id": batch_id, "object": "batch", "deleted": True}
