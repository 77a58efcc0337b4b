"""The statements of batch operations: measured throughput, the scheduler's view of pending rows, result
pages of a running batch, the rows a retry takes over, and the counts behind ``/metrics``."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import bindparam, func, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from .schema import TERMINAL_STATUSES, batch_rows, batches, file_chunks, throughput

#: Weight of the newest chunk in the moving averages of :func:`record_rate`.
RATE_ALPHA = 0.3


@dataclass(frozen=True)
class Rate:
    """Measured throughput of a model on an endpoint: rows and tokens per second, over ``samples`` chunks."""

    model: str
    endpoint: str
    rows_per_second: float
    tokens_per_second: float
    samples: int
    updated_at: int


@dataclass(frozen=True)
class ResultRow:
    """A recorded row of a batch: its input line number, custom id, outcome (``ok``/``error``) and result line."""

    line: int
    custom_id: str | None
    outcome: str
    result: str


# Named statements of the scheduler's pass (every runner step), built once.
_RATES = select(throughput)
_PENDING_BY_BATCH = (
    select(batch_rows.c.batch_id, func.count())
    .where(batch_rows.c.batch_id.in_(bindparam("b_ids", expanding=True)), batch_rows.c.state == "pending")
    .group_by(batch_rows.c.batch_id)
)


async def rates(conn: AsyncConnection) -> dict[tuple[str, str], Rate]:
    """Every measured rate, by ``(model, endpoint)``."""
    rows = (await conn.execute(_RATES)).all()
    return {(r.model, r.endpoint): Rate(**dict(r._mapping)) for r in rows}


async def record_rate(
    conn: AsyncConnection, *, model: str, endpoint: str, rows: int, tokens: int, seconds: float, at: int
) -> Rate | None:
    """Fold one chunk (``rows`` rows and ``tokens`` tokens in ``seconds``) into the moving averages of
    ``(model, endpoint)`` (weight :data:`RATE_ALPHA` for the new chunk; the first chunk sets them). Returns the new
    rate; None (nothing written) for a chunk of no row or no time."""
    if rows <= 0 or seconds <= 0:
        return None
    row_rate, token_rate = rows / seconds, tokens / seconds
    old = (
        await conn.execute(select(throughput).where(throughput.c.model == model, throughput.c.endpoint == endpoint))
    ).first()
    if old is not None:
        row_rate = RATE_ALPHA * row_rate + (1 - RATE_ALPHA) * old.rows_per_second
        token_rate = RATE_ALPHA * token_rate + (1 - RATE_ALPHA) * old.tokens_per_second
    samples = (old.samples if old is not None else 0) + 1
    values = {
        "model": model,
        "endpoint": endpoint,
        "rows_per_second": row_rate,
        "tokens_per_second": token_rate,
        "samples": samples,
        "updated_at": at,
    }
    insert = pg_insert if conn.dialect.name == "postgresql" else sqlite_insert
    stmt = insert(throughput).values(**values)
    stmt = stmt.on_conflict_do_update(
        index_elements=[throughput.c.model, throughput.c.endpoint],
        set_={k: v for k, v in values.items() if k not in ("model", "endpoint")},
    )
    await conn.execute(stmt)
    return Rate(**values)  # type: ignore[arg-type]


async def pending_by_batch(conn: AsyncConnection, batch_ids: list[str]) -> dict[str, int]:
    """Pending rows of each batch in ``batch_ids`` (0 for one with none)."""
    if not batch_ids:
        return {}
    found = {str(b): int(n) for b, n in (await conn.execute(_PENDING_BY_BATCH, {"b_ids": batch_ids})).all()}
    return {b: found.get(b, 0) for b in batch_ids}


async def set_estimate(conn: AsyncConnection, batch_id: str, estimated_completion_at: int | None) -> None:
    """Store a batch's ETA (not a status change: no guard beyond the batch not having ended)."""
    await conn.execute(
        update(batches)
        .where(batches.c.id == batch_id, batches.c.status.not_in(TERMINAL_STATUSES))
        .values(estimated_completion_at=estimated_completion_at)
    )


async def first_pending_line(conn: AsyncConnection, batch_id: str) -> int | None:
    """The lowest line of the batch not recorded yet; None when every row is recorded."""
    q = select(func.min(batch_rows.c.line)).where(batch_rows.c.batch_id == batch_id, batch_rows.c.state == "pending")
    value = (await conn.execute(q)).scalar()
    return int(value) if value is not None else None


async def last_line(conn: AsyncConnection, batch_id: str) -> int:
    """The highest line of the batch (0 for a batch with no rows)."""
    value = (await conn.execute(select(func.max(batch_rows.c.line)).where(batch_rows.c.batch_id == batch_id))).scalar()
    return int(value or 0)


async def recorded_rows(
    conn: AsyncConnection,
    batch_id: str,
    *,
    after_line: int,
    through_line: int,
    limit: int,
    outcome: str | None,
    custom_id: str | None,
) -> list[ResultRow]:
    """Recorded rows with ``after_line < line <= through_line``, in line order, at most ``limit``; only those of
    ``outcome`` (``ok``/``error``) and of ``custom_id`` when given."""
    q = select(batch_rows.c.line, batch_rows.c.custom_id, batch_rows.c.outcome, batch_rows.c.result).where(
        batch_rows.c.batch_id == batch_id,
        batch_rows.c.state == "done",
        batch_rows.c.line > after_line,
        batch_rows.c.line <= through_line,
    )
    if outcome is not None:
        q = q.where(batch_rows.c.outcome == outcome)
    if custom_id is not None:
        q = q.where(batch_rows.c.custom_id == custom_id)
    rows = (await conn.execute(q.order_by(batch_rows.c.line).limit(limit))).all()
    return [ResultRow(r.line, r.custom_id, r.outcome, r.result) for r in rows]


async def retryable_rows(conn: AsyncConnection, batch_id: str) -> list[tuple[str, str]]:
    """``(custom_id, body)`` of the valid rows of a batch that did not succeed (failed when run, or never run: cancel
    or expiry), in line order. Rows refused at validation are not among them (their bodies would be refused again)."""
    q = (
        select(batch_rows.c.custom_id, batch_rows.c.body)
        .where(
            batch_rows.c.batch_id == batch_id,
            batch_rows.c.valid,
            (batch_rows.c.state == "pending") | (batch_rows.c.outcome == "error"),
        )
        .order_by(batch_rows.c.line)
    )
    return [(str(r.custom_id), str(r.body)) for r in (await conn.execute(q)).all()]


async def status_counts(conn: AsyncConnection) -> dict[str, int]:
    """Batches by status."""
    q = select(batches.c.status, func.count()).group_by(batches.c.status)
    return {str(s): int(n) for s, n in (await conn.execute(q)).all()}


async def row_totals(conn: AsyncConnection) -> tuple[int, int]:
    """``(completed, failed)`` rows recorded over every stored batch."""
    q = select(func.coalesce(func.sum(batches.c.completed), 0), func.coalesce(func.sum(batches.c.failed), 0))
    completed, failed = (await conn.execute(q)).one()
    return int(completed), int(failed)


async def file_lines(conn: AsyncConnection, file_id: str) -> tuple[int, bytes]:
    """``(lines, first)``: the number of non-empty lines of a stored file (about: a blank line inside a piece is not
    told apart) and its first line (at most 1 MiB), read one stored piece at a time (bounded memory)."""
    lines, first, seq, tail = 0, b"", 0, b""  # tail: the last byte read
    while True:
        q = select(file_chunks.c.data).where(file_chunks.c.file_id == file_id, file_chunks.c.seq == seq)
        data = (await conn.execute(q)).scalar()
        if data is None:
            break
        piece = bytes(data)
        if seq == 0:
            first = piece.removeprefix(b"\xef\xbb\xbf").lstrip(b"\r\n").split(b"\n", 1)[0]
        lines += piece.count(b"\n") - piece.count(b"\n\n")
        tail = piece[-1:]
        seq += 1
    if tail not in (b"", b"\n"):
        lines += 1  # a last line without its newline
    return max(lines, 0), first
