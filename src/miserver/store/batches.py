"""Stored batches: records, guarded status transitions, listing. Only this module writes ``batches.status``.

Every write is one ``UPDATE ... WHERE id = :id AND status IN (:allowed)`` that names the statuses it may leave, and
a write that matches no row raises :class:`StaleStatus` (DESIGN §10): a stale read can never overwrite a status that
moved on, undo recorded work or restart a finished validation. :func:`try_transition` is the one exception, for
callers to whom a miss is an answer (a cancel of a batch that already ended).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sqlalchemy import bindparam, func, insert, or_, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from . import outbox
from .schema import TERMINAL_STATUSES, batch_rows, batches


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
    #: accounts: the owner key (None: made with no keys), the batch prices fixed at creation
    #: (``{model: [input, output]}``, micro-units per million tokens), the input tokens counted at validation, and
    #: since when the batch waits for a top-up
    owner_key_id: str | None = None
    prices: dict[str, list[int]] | None = None
    enqueued_tokens: int = 0
    balance_waiting_since: int | None = None
    #: model life: the weights revision the batch is pinned to (None: whatever is resident)
    weights_revision: str | None = None
    #: scheduling and operations: order before deadlines (higher first), when it was paused (None: not
    #: paused), whether it was accepted past its estimated finish (``millm_allow_late``), the ETA (Unix seconds)
    priority: int = 0
    paused_at: int | None = None
    allow_late: bool = False
    estimated_completion_at: int | None = None

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES

    @classmethod
    def from_row(cls, row: Any) -> BatchRecord:
        m = dict(row._mapping)
        metadata, errors = m.pop("metadata_json"), m.pop("errors_json")
        m["metadata"] = json.loads(metadata) if metadata else None
        m["errors"] = json.loads(errors) if errors else None
        prices = m.pop("prices_json", None)
        m["prices"] = json.loads(prices) if prices else None
        m["pack"] = bool(m["pack"])
        m["allow_late"] = bool(m.get("allow_late", False))
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
    owner_key_id: str | None = None,
    prices: dict[str, list[int]] | None = None,
    weights_revision: str | None = None,
    priority: int = 0,
    allow_late: bool = False,
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
            owner_key_id=owner_key_id,
            prices_json=json.dumps(prices) if prices is not None else None,
            weights_revision=weights_revision,
            priority=priority,
            allow_late=allow_late,
        )
    )
    record = await get_batch(conn, batch_id)
    assert record is not None
    return record


# Named statements of the reads that every poll, runner pass and retrieve make, built once.
_GET_BATCH = select(batches).where(batches.c.id == bindparam("b_id"))
_ACTIVE_BATCHES = select(batches).where(batches.c.status.not_in(TERMINAL_STATUSES)).order_by(batches.c.id)


async def get_batch(conn: AsyncConnection, batch_id: str) -> BatchRecord | None:
    """The batch ``batch_id``; None when there is none."""
    row = (await conn.execute(_GET_BATCH, {"b_id": batch_id})).first()
    return BatchRecord.from_row(row) if row else None


async def get_status(conn: AsyncConnection, batch_id: str) -> str | None:
    """The batch's status alone (the runner asks after each recorded row whether a cancel arrived); None if absent."""
    return (await conn.execute(select(batches.c.status).where(batches.c.id == batch_id))).scalar()


async def list_batches(
    conn: AsyncConnection, *, limit: int, after: str | None, owner: str | None = None
) -> tuple[list[BatchRecord], bool]:
    """Newest first, the batches of ``owner`` (None: every owner's); ``after`` is the last id of the previous page.
    Returns the page and ``has_more``."""
    q = select(batches)
    if owner is not None:
        q = q.where(batches.c.owner_key_id == owner)
    if after:
        q = q.where(batches.c.id < after)
    q = q.order_by(batches.c.id.desc()).limit(limit + 1)
    rows = [BatchRecord.from_row(r) for r in (await conn.execute(q)).all()]
    return rows[:limit], len(rows) > limit


async def search_batches(
    conn: AsyncConnection,
    *,
    text: str | None,
    statuses: tuple[str, ...] | None,
    owner: str | None,
    limit: int,
    offset: int,
) -> tuple[list[BatchRecord], int]:
    """Newest first, the batches of ``owner`` (None: every owner's) whose id or metadata text contains ``text``
    (case-insensitive; matched on the stored JSON, so the caller passes ``text`` JSON-escaped) and whose status is
    one of ``statuses`` (None: any); ``limit`` rows from ``offset``. Returns the page and the number that match."""
    conds = []
    if owner is not None:
        conds.append(batches.c.owner_key_id == owner)
    if statuses is not None:
        conds.append(batches.c.status.in_(statuses))
    if text:
        pattern = "%" + text.lower().replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        conds.append(
            or_(
                func.lower(batches.c.id).like(pattern, escape="\\"),
                func.lower(func.coalesce(batches.c.metadata_json, "")).like(pattern, escape="\\"),
            )
        )
    count = (await conn.execute(select(func.count()).select_from(batches).where(*conds))).scalar_one()
    q = select(batches).where(*conds).order_by(batches.c.id.desc()).limit(limit).offset(offset)
    rows = [BatchRecord.from_row(r) for r in (await conn.execute(q)).all()]
    return rows, int(count)


async def active_batches(conn: AsyncConnection) -> list[BatchRecord]:
    """Non-terminal batches in creation order."""
    return [BatchRecord.from_row(r) for r in (await conn.execute(_ACTIVE_BATCHES)).all()]


class StaleStatus(Exception):
    """A guarded write matched no row: the batch is gone or no longer in a status the write may leave.

    Raised by every status-changing statement of this module (DESIGN §10: a miss is loud). ``batch_id`` names the
    batch, ``expected`` the statuses the statement accepted, ``what`` the write.
    """

    def __init__(self, batch_id: str, expected: tuple[str, ...], what: str) -> None:
        super().__init__(f"batch {batch_id}: {what} matched no row (expected status in {list(expected)})")
        self.batch_id = batch_id
        self.expected = expected
        self.what = what


#: Statuses a transition to the key may only take when the batch has no pending row left.
_NEEDS_NO_PENDING = frozenset({"finalizing", "completed"})


def _encode(values: dict[str, Any]) -> dict[str, Any]:
    if "errors" in values:
        errors = values.pop("errors")
        values["errors_json"] = json.dumps(errors) if errors is not None else None
    return values


async def try_transition(
    conn: AsyncConnection, batch_id: str, allowed: tuple[str, ...], to: str, at: int, **values: Any
) -> bool:
    """Move ``batch_id`` to status ``to`` (stamping ``<to>_at``) only if its status is in ``allowed``; one statement.

    ``values`` are further columns to set in the same statement (``errors`` is JSON-encoded). A move to
    ``finalizing`` or ``completed`` also requires that no row of the batch is pending (a stale read can never finish
    a batch with unrun rows). A move to a terminal status writes its webhook events (:func:`~miserver.store.outbox.
    enqueue`) in the same transaction. Returns whether the row changed: for the callers that expect a miss (a
    cancel of a batch that already ended); every other caller uses :func:`transition`.
    """
    cond = [batches.c.id == batch_id, batches.c.status.in_(allowed)]
    if to in _NEEDS_NO_PENDING:
        cond.append(
            ~select(batch_rows.c.line)
            .where(batch_rows.c.batch_id == batch_id, batch_rows.c.state == "pending")
            .exists()
        )
    stmt = update(batches).where(*cond).values(status=to, **{f"{to}_at": at}, **_encode(values))
    moved = (await conn.execute(stmt)).rowcount == 1
    if moved and to in outbox.STATUS_EVENTS:  # its webhook events commit with the status change, or not at all
        owner = (await conn.execute(select(batches.c.owner_key_id).where(batches.c.id == batch_id))).scalar()
        await outbox.enqueue(conn, batch_id=batch_id, owner_key_id=owner, event_type=outbox.STATUS_EVENTS[to], at=at)
    return moved


async def transition(
    conn: AsyncConnection, batch_id: str, allowed: tuple[str, ...], to: str, at: int, **values: Any
) -> None:
    """:func:`try_transition` that raises :class:`StaleStatus` when nothing matched (the status moved on, or a
    move to ``finalizing``/``completed`` found pending rows)."""
    if not await try_transition(conn, batch_id, allowed, to, at, **values):
        raise StaleStatus(batch_id, allowed, f"move to {to!r}")


async def set_fields(conn: AsyncConnection, batch_id: str, allowed: tuple[str, ...], **values: Any) -> None:
    """Set non-status columns (``waiting_reason``, ``total``, ``caller_lease``...) of a batch whose status is in
    ``allowed``, in one statement. Raises :class:`StaleStatus` when the batch is gone or its status moved on."""
    stmt = (
        update(batches).where(batches.c.id == batch_id, batches.c.status.in_(allowed)).values(**_encode(dict(values)))
    )
    if (await conn.execute(stmt)).rowcount != 1:
        raise StaleStatus(batch_id, allowed, "set " + ", ".join(sorted(values)))


async def claim_validation(conn: AsyncConnection, batch_id: str, *, worker: str, now_ms: int, ttl_ms: int) -> bool:
    """Claim (or extend the claim on) a ``validating`` batch's validation for ``worker``, in one statement.

    True when ``worker`` holds it now: the claim was free, already ``worker``'s, or past its deadline (its process
    died); it lasts ``ttl_ms`` milliseconds. False when another live process holds it or the batch's file was
    already validated to its end (:func:`needs_validation`): a stale read can never restart a finished validation.
    """
    unvalidated = (batches.c.status == "validating") | (
        (batches.c.status == "cancelling")
        & batches.c.in_progress_at.is_(None)
        & (batches.c.total == 0)
        & batches.c.errors_json.is_(None)
    )
    stmt = (
        update(batches)
        .where(
            batches.c.id == batch_id,
            unvalidated,
            (batches.c.claimed_by.is_(None)) | (batches.c.claimed_by == worker) | (batches.c.claimed_until < now_ms),
        )
        .values(claimed_by=worker, claimed_until=now_ms + ttl_ms)
    )
    return (await conn.execute(stmt)).rowcount == 1


def needs_validation(batch: BatchRecord) -> bool:
    """Whether ``batch``'s input file was never validated to its end: it is ``validating``, or it was cancelled
    before its validation finished (its lines are read anyway, so that every line is accounted for). The same
    condition guards :func:`claim_validation`."""
    if batch.status == "validating":
        return True
    return batch.status == "cancelling" and batch.in_progress_at is None and batch.total == 0 and batch.errors is None


#: A validation goes on to the end of its file after a cancel, so that every line is accounted for (as invalid or
#: ``batch_cancelled``); it stops once the batch is finished or another process took its claim.
VALIDATION_STATUSES = ("validating", "cancelling")


async def hold_validation(conn: AsyncConnection, batch_id: str, *, worker: str, now_ms: int, ttl_ms: int) -> str:
    """Extend ``worker``'s validation claim and return the batch's status (``validating`` or ``cancelling``).

    Raises :class:`StaleStatus` when the batch left those statuses or another process took the claim over. Called in
    the transaction of every write of a validation, so the write lands only while the claim holds (the row lock on
    the batch keeps it so until commit).
    """
    stmt = (
        update(batches)
        .where(batches.c.id == batch_id, batches.c.status.in_(VALIDATION_STATUSES), batches.c.claimed_by == worker)
        .values(claimed_until=now_ms + ttl_ms)
        .returning(batches.c.status)
    )
    status = (await conn.execute(stmt)).scalar()
    if status is None:
        raise StaleStatus(batch_id, VALIDATION_STATUSES, f"validation claim of {worker}")
    return str(status)


def validation_live(batch: BatchRecord, *, worker: str, now_ms: int) -> bool:
    """Whether another process holds a live validation claim on ``batch`` (its cancel must wait for it)."""
    return batch.claimed_by not in (None, worker) and (batch.claimed_until or 0) >= now_ms
