"""Result lines and the output/error files of a finished batch (DESIGN §3.3), written in input order.

A finished batch's files are created in the same transaction as its terminal status, so a crash leaves either
both or neither; rows never run (cancel, expiry) become ``batch_cancelled``/``batch_expired`` error lines there.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection

from ..clock import now
from ..errors import APIError
from ..ids import ordered_id, random_id
from ..protocol.batches import (
    BatchLineError,
    BatchLineExtension,
    BatchLineResponse,
    BatchLineResponseExtension,
    BatchOutputLine,
)
from ..services.inference.context import ServiceResult
from ..store import batches as store_batches
from ..store import files as store_files
from ..store import rows as store_rows
from ..store.batches import BatchRecord

UNRUN_MESSAGES = {
    "batch_cancelled": "The batch was cancelled before this request ran.",
    "batch_expired": "The batch expired before this request ran.",
    "batch_failed": "The batch failed validation before this request ran (see the batch's errors for the lines "
    "that failed it); this request was not run and not charged.",
    "insufficient_quota": "The balance of the batch's API key ran out before this request ran; it was not charged.",
    "key_revoked": "The batch's API key was revoked before this request ran; it was not charged.",
}


def _dump(line: BatchOutputLine) -> str:
    return line.model_dump_json(exclude_unset=True)


def _line_error(error: APIError) -> BatchLineError:
    return BatchLineError(code=error.code, message=error.message)


def success_line(custom_id: str, result: ServiceResult, *, packed: bool = False) -> str:
    """The output line of a row that the service answered (JSON text, one line)."""
    return _dump(
        BatchOutputLine(
            id=random_id("batch_req_"),
            custom_id=custom_id,
            response=BatchLineResponse(
                status_code=result.status_code,
                request_id=random_id("req_"),
                body=result.body,
                millm=BatchLineResponseExtension(packed=packed, headers=result.headers),
            ),
            error=None,
        )
    )


def _error_response(error: APIError, endpoint: str) -> BatchLineResponse:
    status, body = error.answer_for(endpoint)  # the route's own error body (Anthropic's under /anthropic/)
    return BatchLineResponse(status_code=status, request_id=random_id("req_"), body=body)


def failure_line(custom_id: str, error: APIError, endpoint: str = "") -> str:
    """The error line of a row refused while running: the synchronous route's status and body under ``response``
    (the route of ``endpoint``), and the same code and message under ``error``."""
    return _dump(_error_line(custom_id, error, endpoint))


def invalid_line(custom_id: str | None, line: int, error: APIError, endpoint: str = "") -> str:
    """The error line of an input line refused at validation: as :func:`failure_line`, plus ``millm.line`` (its
    1-based line number in the input file)."""
    return _dump(_error_line(custom_id, error, endpoint, BatchLineExtension(line=line)))


def _error_line(
    custom_id: str | None, error: APIError, endpoint: str, extension: BatchLineExtension | None = None
) -> BatchOutputLine:
    fields: dict[str, object] = {"millm": extension} if extension is not None else {}
    return BatchOutputLine(
        id=random_id("batch_req_"),
        custom_id=custom_id,
        response=_error_response(error, endpoint),
        error=_line_error(error),
        **fields,  # type: ignore[arg-type]  # left unset (not null) when absent: see BatchOutputLine
    )


def unrun_line(custom_id: str | None, code: str) -> str:
    """The error line of a row that never ran: ``code`` is a key of :data:`UNRUN_MESSAGES` (``batch_cancelled``,
    ``batch_expired``, ``batch_failed``, ``insufficient_quota``, ``key_revoked``); KeyError for another."""
    return _dump(
        BatchOutputLine(
            id=random_id("batch_req_"),
            custom_id=custom_id,
            response=None,
            error=BatchLineError(code=code, message=UNRUN_MESSAGES[code]),
        )
    )


class StatusMoved(Exception):
    """The batch left the expected status while its files were being written: roll back."""


async def _write_files(
    conn: AsyncConnection, batch: BatchRecord, unrun_code: str | None, file_expiry_seconds: int
) -> dict[str, Any]:
    created = now()
    expires = created + (batch.output_expires_seconds or file_expiry_seconds)
    writers: dict[str, store_files.ChunkWriter] = {}
    completed = failed = 0

    async def writer(kind: str) -> store_files.ChunkWriter:
        if kind not in writers:
            writers[kind] = await store_files.create_empty(
                conn,
                file_id=ordered_id("file-"),
                purpose="batch_output",
                filename=f"batch_{batch.id.removeprefix('batch_')}_{kind}.jsonl",
                created_at=created,
                expires_at=expires,
                owner_key_id=batch.owner_key_id,  # the batch's owner reads its results
            )
        return writers[kind]

    async for row in store_rows.iter_rows(conn, batch.id):
        if row.state == "done":
            assert row.result is not None
            text, ok = row.result, row.outcome == "ok"
        else:
            assert unrun_code is not None, f"batch {batch.id} finishes with a pending row and no reason for it"
            text, ok = unrun_line(row.custom_id, unrun_code), False
        await (await writer("output" if ok else "error")).write(text.encode("utf-8") + b"\n")
        completed += ok
        failed += not ok
    for w in writers.values():
        await w.close()
    return {
        "output_file_id": writers["output"].file_id if "output" in writers else None,
        "error_file_id": writers["error"].file_id if "error" in writers else None,
        "completed": completed,
        "failed": failed,
    }


async def finish(
    conn: AsyncConnection,
    batch: BatchRecord,
    *,
    allowed: tuple[str, ...],
    to: str,
    unrun_code: str | None,
    file_expiry_seconds: int,
    extra: dict[str, Any] | None = None,
) -> bool:
    """Write the batch's output and error files and move it to ``to`` in the caller's transaction.

    First fences the pending rows (:func:`~miserver.store.rows.fence_unrun`): a row written as never run can no
    longer be recorded by a worker still running it. Raises :class:`StatusMoved` when the batch left ``allowed``
    meanwhile (or, for ``completed``, still has a pending row): the caller's transaction must roll back (the files
    written here go with it). Returns True.
    """
    await store_rows.fence_unrun(conn, batch.id)
    values = await _write_files(conn, batch, unrun_code, file_expiry_seconds)
    values["total"] = max(batch.total, values["completed"] + values["failed"])
    values.update(extra or {})
    moved = await store_batches.try_transition(
        conn, batch.id, allowed, to, now(), waiting_reason=None, lease_holder=None, **values
    )
    if not moved:
        raise StatusMoved(batch.id)
    return True
