"""Stored batches: records, guarded status transitions, listing. Only this module writes ``batches.status``.

A transition is one ``UPDATE ... WHERE id = :id AND status IN (:allowed)``: it returns False instead of
overwriting a status that moved on (a terminal status is never overwritten).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sqlalchemy import insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from .schema import TERMINAL_STATUSES, batches


@dataclass(frozen=True)
class BatchRecord:
    id: str
    endpoint: str
    model: str | None
    input_file_id: str
    completion_window: str
    status: str
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    total: int
    completed: int
    failed: int
    input_tokens: int
    output_tokens: int
    metadata: dict[str, str] | None
    errors: list[dict[str, Any]] | None
    pack: bool
    output_expires_seconds: int | None
    lease_holder: str | None
    waiting_reason: str | None
    caller_lease: str | None
    claimed_by: str | None
    claimed_until: int | None

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES

    @classmethod
    def from_row(cls, row: Any) -> BatchRecord:
        m = dict(row._mapping)
        metadata, errors = m.pop("metadata_json"), m.pop("errors_json")
        m["metadata"] = json.loads(metadata) if metadata else None
        m["errors"] = json.loads(errors) if errors else None
        m["pack"] = bool(m["pack"])
        return cls(**m)


async def insert_batch(
    conn: AsyncConnection,
    *,
    batch_id: str,
    endpoint: str,
    input_file_id: str,
    completion_window: str,
    created_at: int,
    expires_at: int,
    metadata: dict[str, str] | None,
    pack: bool,
    output_expires_seconds: int | None,
    caller_lease: str | None = None,
) -> BatchRecord:
    await conn.execute(
        insert(batches).values(
            id=batch_id,
            endpoint=endpoint,
            input_file_id=input_file_id,
            completion_window=completion_window,
            status="validating",
            created_at=created_at,
            expires_at=expires_at,
            metadata_json=json.dumps(metadata) if metadata is not None else None,
            pack=pack,
            output_expires_seconds=output_expires_seconds,
            caller_lease=caller_lease,
        )
    )
    record = await get_batch(conn, batch_id)
    assert record is not None
    return record


async def get_batch(conn: AsyncConnection, batch_id: str) -> BatchRecord | None:
    row = (await conn.execute(select(batches).where(batches.c.id == batch_id))).first()
    return BatchRecord.from_row(row) if row else None


async def get_status(conn: AsyncConnection, batch_id: str) -> str | None:
    """The batch's status alone (the runner asks after each recorded row whether a cancel arrived); None if absent."""
    return (await conn.execute(select(batches.c.status).where(batches.c.id == batch_id))).scalar()


async def list_batches(conn: AsyncConnection, *, limit: int, after: str | None) -> tuple[list[BatchRecord], bool]:
    """Newest first; ``after`` is the last id of the previous page. Returns the page and ``has_more``."""
    q = select(batches)
    if after:
        q = q.where(batches.c.id < after)
    q = q.order_by(batches.c.id.desc()).limit(limit + 1)
    rows = [BatchRecord.from_row(r) for r in (await conn.execute(q)).all()]
    return rows[:limit], len(rows) > limit


async def active_batches(conn: AsyncConnection) -> list[BatchRecord]:
    """Non-terminal batches in creation order."""
    q = select(batches).where(batches.c.status.not_in(TERMINAL_STATUSES)).order_by(batches.c.id)
    return [BatchRecord.from_row(r) for r in (await conn.execute(q)).all()]


async def transition(
    conn: AsyncConnection, batch_id: str, allowed: tuple[str, ...], to: str, at: int, **values: Any
) -> bool:
    """Move ``batch_id`` to status ``to`` (stamping ``<to>_at``) only if its status is in ``allowed``.

    ``values`` are further columns to set in the same statement (``errors`` is JSON-encoded).
    Returns whether the row changed.
    """
    if "errors" in values:
        errors = values.pop("errors")
        values["errors_json"] = json.dumps(errors) if errors is not None else None
    stmt = (
        update(batches)
        .where(batches.c.id == batch_id, batches.c.status.in_(allowed))
        .values(status=to, **{f"{to}_at": at}, **values)
    )
    return (await conn.execute(stmt)).rowcount == 1


async def set_fields(conn: AsyncConnection, batch_id: str, **values: Any) -> None:
    """Set non-status columns (``waiting_reason``, ``model``, ``errors``...)."""
    if "errors" in values:
        errors = values.pop("errors")
        values["errors_json"] = json.dumps(errors) if errors is not None else None
    await conn.execute(update(batches).where(batches.c.id == batch_id).values(**values))


async def claim_batch(conn: AsyncConnection, batch_id: str, *, worker: str, now_ms: int, ttl_ms: int) -> bool:
    """Claim a batch for work that one process must do alone (validation). True when ``worker`` holds it now.

    The claim is free, already ``worker``'s, or past its deadline (its process died); it lasts ``ttl_ms``.
    """
    stmt = (
        update(batches)
        .where(
            batches.c.id == batch_id,
            (batches.c.claimed_by.is_(None)) | (batches.c.claimed_by == worker) | (batches.c.claimed_until < now_ms),
        )
        .values(claimed_by=worker, claimed_until=now_ms + ttl_ms)
    )
    return (await conn.execute(stmt)).rowcount == 1
