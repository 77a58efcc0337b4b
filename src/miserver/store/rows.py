"""Batch rows: insert after validation, claim in chunks, record results exactly once.

Exactly once (DESIGN §4): a claim stamps rows with a fresh ``claim_token`` (the fencing token) and a deadline; a
result is recorded by ``UPDATE ... WHERE state = 'pending' AND claim_token = :token`` in the same transaction as the
batch's counters, so a row with a recorded result can never be recorded (or claimed, hence run) again, and a
worker whose claim was taken over cannot record. On PostgreSQL the claim is one statement with
``FOR UPDATE SKIP LOCKED``; SQLite serialises writers, so the same statement without the lock clause is safe.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import bindparam, func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from .schema import TERMINAL_STATUSES, batch_rows, batches

PAGE_ROWS = 1000
#: A row's result may be recorded only while its batch has one of these statuses (a running row finishes and is
#: recorded after a cancel arrives, DESIGN §4).
RECORDING_STATUSES = ("in_progress", "cancelling")


@dataclass(frozen=True)
class ClaimedRow:
    line: int
    custom_id: str
    body: str


@dataclass(frozen=True)
class StoredRow:
    line: int
    custom_id: str | None
    state: str
    outcome: str | None
    result: str | None


async def insert_rows(conn: AsyncConnection, batch_id: str, rows: list[dict[str, Any]]) -> None:
    """Insert validated rows: each dict has ``line``, ``custom_id``, ``valid``, and ``body`` and ``model`` (valid:
    the model the line names, as validation resolved it) or ``result`` (invalid: the error line, recorded at
    once)."""
    if not rows:
        return
    values = []
    for r in rows:
        valid = bool(r["valid"])
        values.append(
            {
                "batch_id": batch_id,
                "line": r["line"],
                "custom_id": r.get("custom_id"),
                "valid": valid,
                "body": r.get("body") if valid else None,
                "model": r.get("model") if valid else None,
                "state": "pending" if valid else "done",
                "outcome": None if valid else "error",
                "result": None if valid else r["result"],
            }
        )
    await conn.execute(insert(batch_rows), values)


async def delete_rows(conn: AsyncConnection, batch_id: str, *, worker: str) -> int:
    """Forget a batch's rows (a validation restarting after a crash), in one statement guarded by the validation
    claim: rows are deleted only while ``worker`` holds the claim of a batch that never reached ``in_progress`` (so
    none of its rows ever ran), so recorded rows can never be deleted by a stale validation. Returns the number of
    rows deleted."""
    holder = (
        select(batches.c.id)
        .where(
            batches.c.id == batch_id,
            batches.c.status.in_(("validating", "cancelling")),
            batches.c.in_progress_at.is_(None),
            batches.c.claimed_by == worker,
        )
        .exists()
    )
    result = await conn.execute(batch_rows.delete().where(batch_rows.c.batch_id == batch_id, holder))
    return int(result.rowcount or 0)


@functools.cache
def _claim_statement(by_model: bool, skip_locked: bool) -> Any:
    """The claim's one statement (built once per form): pending rows, unclaimed or past their claim's deadline,
    lowest line first, of an ``in_progress`` batch; ``by_model`` keeps the rows naming one of ``b_models``."""
    inner = (
        select(batch_rows.c.line)
        .where(
            batch_rows.c.batch_id == bindparam("b_id"),
            batch_rows.c.state == "pending",
            (batch_rows.c.claimed_until.is_(None)) | (batch_rows.c.claimed_until < bindparam("b_now")),
        )
        .order_by(batch_rows.c.line)
        .limit(bindparam("b_limit"))
    )
    if by_model:
        inner = inner.where(batch_rows.c.model.in_(bindparam("b_models", expanding=True)))
    if skip_locked:
        inner = inner.with_for_update(skip_locked=True)
    # A CTE is evaluated once (PostgreSQL materialises a locking CTE); an ``IN (subquery)`` may be re-run per row,
    # and with SKIP LOCKED each run would pick further rows past the LIMIT.
    picked = inner.cte("picked")
    running = select(batches.c.id).where(batches.c.id == bindparam("b_id"), batches.c.status == "in_progress")
    return (
        update(batch_rows)
        .where(batch_rows.c.batch_id == bindparam("b_id"), batch_rows.c.line == picked.c.line)
        .where(running.exists())
        .values(claim_token=bindparam("b_token"), claimed_by=bindparam("b_worker"), claimed_until=bindparam("b_until"))
        .returning(batch_rows.c.line, batch_rows.c.custom_id, batch_rows.c.body)
    )


async def claim(
    conn: AsyncConnection,
    *,
    batch_id: str,
    limit: int,
    worker: str,
    token: str,
    now_ms: int,
    ttl_ms: int,
    skip_locked: bool,
    models: Sequence[str] | None = None,
) -> list[ClaimedRow]:
    """Claim up to ``limit`` pending rows of an ``in_progress`` batch, lowest line first, in one statement.

    A row is claimable when it is pending and unclaimed or its claim's deadline passed. ``models`` (gateway mode:
    the models whose upstream pools are live) limits the claim to rows naming one of them, so the rows of a pool that
    is down wait without holding back the rows of live pools behind them; None claims rows of any model. Returns the
    rows claimed (ordered by line) with the token now on them.
    """
    params: dict[str, Any] = {
        "b_id": batch_id,
        "b_now": now_ms,
        "b_limit": limit,
        "b_token": token,
        "b_worker": worker,
        "b_until": now_ms + ttl_ms,
    }
    if models is not None:
        params["b_models"] = list(models)
    rows = (await conn.execute(_claim_statement(models is not None, skip_locked), params)).all()
    return sorted((ClaimedRow(r.line, r.custom_id, r.body) for r in rows), key=lambda r: r.line)


_HELD = (batch_rows.c.batch_id == bindparam("b_id"), batch_rows.c.claim_token == bindparam("b_token"))
_EXTEND_CLAIM = (
    update(batch_rows).where(*_HELD, batch_rows.c.state == "pending").values(claimed_until=bindparam("b_until"))
)
_RELEASE_CLAIM = (
    update(batch_rows)
    .where(*_HELD, batch_rows.c.state == "pending")
    .values(claim_token=None, claimed_by=None, claimed_until=None)
)


async def extend_claim(conn: AsyncConnection, *, batch_id: str, token: str, until_ms: int) -> None:
    """Heartbeat: push the deadline of the rows still held under ``token``."""
    await conn.execute(_EXTEND_CLAIM, {"b_id": batch_id, "b_token": token, "b_until": until_ms})


async def release_claim(conn: AsyncConnection, *, batch_id: str, token: str) -> int:
    """Give back the unrecorded rows of a claim (stop, cancel) so that they can be claimed at once; returns how
    many rows it gave back (none once a finish fenced the claim off)."""
    return int((await conn.execute(_RELEASE_CLAIM, {"b_id": batch_id, "b_token": token})).rowcount or 0)


async def release_claims_of(conn: AsyncConnection, worker: str) -> None:
    """Forget the claims of ``worker`` (its previous life: a restarted process resumes at its first unrecorded row
    at once instead of waiting for its own claims to time out)."""
    await conn.execute(
        update(batch_rows)
        .where(batch_rows.c.state == "pending", batch_rows.c.claimed_by == worker)
        .values(claim_token=None, claimed_by=None, claimed_until=None)
    )


async def release_all_claims(conn: AsyncConnection) -> None:
    """Forget every claim (SQLite start-up: one process, so any claim is from a previous life)."""
    await conn.execute(
        update(batch_rows)
        .where(batch_rows.c.state == "pending", batch_rows.c.claimed_until.is_not(None))
        .values(claim_token=None, claimed_by=None, claimed_until=None)
    )


@dataclass(frozen=True)
class RowResult:
    """One row's result to record: its ``line``, whether it succeeded (``ok``: an output line, else an error line),
    the ``result`` line itself, and its tokens (0 and 0 for a failure: usage counts only rows that succeeded)."""

    line: int
    ok: bool
    result: str
    input_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Recorded:
    """What :func:`record_many` did: the ``lines`` it recorded, and the batch's ``status`` and whether it is
    ``paused``, read in the same statement as its counters (``status`` None: no such batch)."""

    lines: frozenset[int]
    status: str | None
    paused: bool


# Named statements of the record, built once (building a Core statement costs more than running it on SQLite).
_RECORDING = (
    select(batches.c.id).where(batches.c.id == bindparam("b_id"), batches.c.status.in_(RECORDING_STATUSES)).exists()
)
#: One row pending -> done, only under the claim's token and while its batch is running.
_RECORD_ROW = (
    update(batch_rows)
    .where(
        batch_rows.c.batch_id == bindparam("b_id"),
        batch_rows.c.line == bindparam("b_line"),
        batch_rows.c.state == "pending",
        batch_rows.c.claim_token == bindparam("b_token"),
        _RECORDING,
    )
    .values(
        state="done",
        outcome=bindparam("b_outcome"),
        result=bindparam("b_result"),
        input_tokens=bindparam("b_input_tokens"),
        output_tokens=bindparam("b_output_tokens"),
        claimed_until=None,
    )
)
#: The batch's counters moved by the rows just recorded; returns what the runner asks after every record.
_COUNT_ROWS = (
    update(batches)
    .where(batches.c.id == bindparam("b_id"))
    .values(
        completed=batches.c.completed + bindparam("b_completed"),
        failed=batches.c.failed + bindparam("b_failed"),
        input_tokens=batches.c.input_tokens + bindparam("b_input_tokens"),
        output_tokens=batches.c.output_tokens + bindparam("b_output_tokens"),
    )
    .returning(batches.c.status, batches.c.paused_at)
)
_RUN_STATE = select(batches.c.status, batches.c.paused_at).where(batches.c.id == bindparam("b_id"))


async def record_many(conn: AsyncConnection, *, batch_id: str, token: str, results: Sequence[RowResult]) -> Recorded:
    """Record each row's result line and bump the batch's counters once for them all, in the caller's transaction
    (one statement per row, then one for the counters that also reads the batch's status and pause).

    A row is recorded only while it is pending under ``token`` and its batch is running (``in_progress`` or
    ``cancelling``): a row already recorded, one whose claim was taken over or fenced off by a finish
    (:func:`fence_unrun`), or any row of a batch no longer running is left as it is and is not in
    ``Recorded.lines``. The caller sees which rows it recorded, so it charges and counts only those.
    """
    lines: set[int] = set()
    completed = failed = input_tokens = output_tokens = 0
    for r in results:
        changed = await conn.execute(
            _RECORD_ROW,
            {
                "b_id": batch_id,
                "b_line": r.line,
                "b_token": token,
                "b_outcome": "ok" if r.ok else "error",
                "b_result": r.result,
                "b_input_tokens": r.input_tokens,
                "b_output_tokens": r.output_tokens,
            },
        )
        if changed.rowcount != 1:
            continue
        lines.add(r.line)
        if r.ok:
            completed += 1
            input_tokens += r.input_tokens
            output_tokens += r.output_tokens
        else:
            failed += 1
    if lines:
        state = (
            await conn.execute(
                _COUNT_ROWS,
                {
                    "b_id": batch_id,
                    "b_completed": completed,
                    "b_failed": failed,
                    "b_input_tokens": input_tokens,
                    "b_output_tokens": output_tokens,
                },
            )
        ).first()
    else:
        state = (await conn.execute(_RUN_STATE, {"b_id": batch_id})).first()
    if state is None:
        return Recorded(frozenset(lines), None, False)
    return Recorded(frozenset(lines), str(state.status), state.paused_at is not None)


async def fence_unrun(conn: AsyncConnection, batch_id: str) -> int:
    """Drop every claim on the batch's pending rows (a finish, in its own transaction, before it writes the files).

    A worker still running one of those rows can no longer record it (its token is gone; on PostgreSQL this
    statement holds the rows' locks until the finish commits), so a row written to the files as never run is never
    also recorded and counted. Returns the number of rows fenced."""
    result = await conn.execute(
        update(batch_rows)
        .where(batch_rows.c.batch_id == batch_id, batch_rows.c.state == "pending")
        .values(claim_token=None, claimed_by=None, claimed_until=None)
    )
    return int(result.rowcount or 0)


_PENDING = (
    select(func.count())
    .select_from(batch_rows)
    .where(batch_rows.c.batch_id == bindparam("b_id"), batch_rows.c.state == "pending")
)
_PENDING_OF_MODELS = _PENDING.where(batch_rows.c.model.in_(bindparam("b_models", expanding=True)))


async def count_pending(conn: AsyncConnection, batch_id: str, *, models: Sequence[str] | None = None) -> int:
    """Rows of the batch not yet recorded (claimed or not); with ``models``, only those naming one of them."""
    if models is None:
        value = (await conn.execute(_PENDING, {"b_id": batch_id})).scalar()
    else:
        value = (await conn.execute(_PENDING_OF_MODELS, {"b_id": batch_id, "b_models": list(models)})).scalar()
    return int(value or 0)


async def row_models(conn: AsyncConnection, batch_id: str) -> list[str]:
    """The distinct models that the batch's valid rows name (sorted)."""
    q = (
        select(batch_rows.c.model)
        .where(batch_rows.c.batch_id == batch_id, batch_rows.c.valid, batch_rows.c.model.is_not(None))
        .distinct()
    )
    return sorted(str(m) for m in (await conn.execute(q)).scalars())


async def iter_rows(conn: AsyncConnection, batch_id: str) -> AsyncIterator[StoredRow]:
    """Every row of a batch in line order, read in pages of 1,000 (bounded memory)."""
    last = 0
    while True:
        q = (
            select(
                batch_rows.c.line, batch_rows.c.custom_id, batch_rows.c.state, batch_rows.c.outcome, batch_rows.c.result
            )
            .where(batch_rows.c.batch_id == batch_id, batch_rows.c.line > last)
            .order_by(batch_rows.c.line)
            .limit(PAGE_ROWS)
        )
        page = (await conn.execute(q)).all()
        if not page:
            return
        for r in page:
            yield StoredRow(r.line, r.custom_id, r.state, r.outcome, r.result)
        last = page[-1].line


async def backlog_rows(conn: AsyncConnection) -> int:
    """Rows not yet run across every non-terminal batch (``inference.batch_backlog_rows``)."""
    q = (
        select(func.count())
        .select_from(batch_rows.join(batches, batch_rows.c.batch_id == batches.c.id))
        .where(batch_rows.c.state == "pending", batches.c.status.not_in(TERMINAL_STATUSES))
    )
    return int((await conn.execute(q)).scalar() or 0)
