"""Stored files: records in ``files``, bytes in ``file_chunks`` (1 MiB each), read and written with bounded memory.

Every function takes an open connection so that callers can join file writes to other writes in one transaction
(a batch's output files are created in the same transaction as its final status).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from .schema import TERMINAL_STATUSES, batches, file_chunks, files

CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class FileRecord:
    """A file's record: ``bytes`` is the content length, times are Unix seconds (``expires_at`` None: never),
    ``content_deleted_at`` is set once pruning removed the bytes (the record stays)."""

    id: str
    purpose: str
    filename: str
    bytes: int
    created_at: int
    expires_at: int | None
    status: str
    status_details: str | None
    content_deleted_at: int | None
    #: the API key that owns the file (None: made with no keys in the database)
    owner_key_id: str | None = None

    @classmethod
    def from_row(cls, row: Any) -> FileRecord:
        """The record of a ``files`` row (a SQLAlchemy ``Row``)."""
        m = row._mapping
        return cls(**{k: m[k] for k in cls.__dataclass_fields__})


async def insert_file(
    conn: AsyncConnection,
    *,
    file_id: str,
    purpose: str,
    filename: str,
    created_at: int,
    expires_at: int | None,
    chunks: Iterable[bytes],
    owner_key_id: str | None,
) -> FileRecord:
    """Insert a file record (owned by ``owner_key_id``: always named, None only on a server without keys, so that
    no caller can forget it and make a file its own key cannot see) and its bytes. ``chunks`` may be of any size;
    they are re-cut to 1 MiB rows."""
    await conn.execute(
        insert(files).values(
            id=file_id,
            purpose=purpose,
            filename=filename,
            bytes=0,
            created_at=created_at,
            expires_at=expires_at,
            owner_key_id=owner_key_id,
        )
    )
    total = 0
    seq = 0
    pending = bytearray()
    for piece in chunks:
        pending += piece
        while len(pending) >= CHUNK_BYTES:
            await conn.execute(insert(file_chunks).values(file_id=file_id, seq=seq, data=bytes(pending[:CHUNK_BYTES])))
            total += CHUNK_BYTES
            seq += 1
            del pending[:CHUNK_BYTES]
    if pending:
        await conn.execute(insert(file_chunks).values(file_id=file_id, seq=seq, data=bytes(pending)))
        total += len(pending)
    await conn.execute(update(files).where(files.c.id == file_id).values(bytes=total))
    record = await get_file(conn, file_id)
    assert record is not None
    return record


class ChunkWriter:
    """Appends bytes to a new file inside a transaction, 1 MiB rows at a time (for output files built row by row)."""

    def __init__(self, conn: AsyncConnection, file_id: str) -> None:
        self.conn = conn
        self.file_id = file_id
        self.seq = 0
        self.total = 0
        self.pending = bytearray()

    async def write(self, data: bytes) -> None:
        """Append ``data``; full 1 MiB rows are inserted as they fill."""
        self.pending += data
        while len(self.pending) >= CHUNK_BYTES:
            await self._flush(bytes(self.pending[:CHUNK_BYTES]))
            del self.pending[:CHUNK_BYTES]

    async def _flush(self, data: bytes) -> None:
        await self.conn.execute(insert(file_chunks).values(file_id=self.file_id, seq=self.seq, data=data))
        self.seq += 1
        self.total += len(data)

    async def close(self) -> int:
        """Flush the tail, set the record's ``bytes``, and return it."""
        if self.pending:
            await self._flush(bytes(self.pending))
            self.pending.clear()
        await self.conn.execute(update(files).where(files.c.id == self.file_id).values(bytes=self.total))
        return self.total


async def create_empty(
    conn: AsyncConnection,
    *,
    file_id: str,
    purpose: str,
    filename: str,
    created_at: int,
    expires_at: int | None,
    owner_key_id: str | None = None,
) -> ChunkWriter:
    """Insert an empty file record (owned by ``owner_key_id``) and return a writer for its bytes."""
    await conn.execute(
        insert(files).values(
            id=file_id,
            purpose=purpose,
            filename=filename,
            bytes=0,
            created_at=created_at,
            expires_at=expires_at,
            owner_key_id=owner_key_id,
        )
    )
    return ChunkWriter(conn, file_id)


async def get_file(conn: AsyncConnection, file_id: str, *, lock: bool = False) -> FileRecord | None:
    """The record of ``file_id`` (also after its content was pruned); None when there is none.

    ``lock`` takes the row's write lock until the transaction ends, before reading it: a batch create that reads its
    input file and a delete of that file then run one after the other, so a file is never deleted under a batch
    created at the same moment. On PostgreSQL that is ``FOR UPDATE``. SQLite has no row locks and starts a
    transaction only at its first write (a read before it sees the database as it is at that moment, and another
    connection may commit a delete before this one writes), so there the read follows an update that changes
    nothing: it takes the database's one write lock, which the other writer then waits for.
    """
    q = select(files).where(files.c.id == file_id)
    if lock and conn.dialect.name == "sqlite":
        await conn.execute(update(files).where(files.c.id == file_id).values(purpose=files.c.purpose))
    row = (await conn.execute(q.with_for_update() if lock else q)).first()
    return FileRecord.from_row(row) if row else None


async def list_files(
    conn: AsyncConnection, *, purpose: str | None, limit: int, order: str, after: str | None, owner: str | None = None
) -> tuple[list[FileRecord], bool]:
    """One page, ordered by id (creation order) ``desc`` or ``asc``, of the files of ``owner`` (None: every
    owner's); returns the page and ``has_more``."""
    q = select(files)
    if owner is not None:
        q = q.where(files.c.owner_key_id == owner)
    if purpose:
        q = q.where(files.c.purpose == purpose)
    if after:
        q = q.where(files.c.id < after if order == "desc" else files.c.id > after)
    q = q.order_by(files.c.id.desc() if order == "desc" else files.c.id.asc()).limit(limit + 1)
    rows = [FileRecord.from_row(r) for r in (await conn.execute(q)).all()]
    return rows[:limit], len(rows) > limit


@dataclass(frozen=True)
class ReadingBatch:
    """A batch that reads a file: its id and the key that owns it (None on a server with no keys)."""

    id: str
    owner_key_id: str | None


async def referencing_active_batch(conn: AsyncConnection, file_id: str) -> ReadingBatch | None:
    """A non-terminal batch that reads ``file_id`` as its input, if any."""
    q = (
        select(batches.c.id, batches.c.owner_key_id)
        .where(batches.c.input_file_id == file_id, batches.c.status.not_in(TERMINAL_STATUSES))
        .limit(1)
    )
    row = (await conn.execute(q)).first()
    return None if row is None else ReadingBatch(row.id, row.owner_key_id)


async def delete_file(conn: AsyncConnection, file_id: str) -> bool:
    """Delete the record and its bytes; False when there was no such file."""
    await conn.execute(delete(file_chunks).where(file_chunks.c.file_id == file_id))
    result = await conn.execute(delete(files).where(files.c.id == file_id))
    return result.rowcount > 0


async def read_piece(engine: AsyncEngine, file_id: str, seq: int) -> bytes | None:
    """Piece ``seq`` (from 0) of a file's bytes, in one short read of its own; None past the last piece (or for no
    such file).

    Outside ``store/`` call :meth:`miserver.store.Store.file_content`, which owns the engine and reads every piece.
    """
    async with engine.connect() as conn:
        piece = select(file_chunks.c.data).where(file_chunks.c.file_id == file_id, file_chunks.c.seq == seq)
        data = (await conn.execute(piece)).scalar()
    return None if data is None else bytes(data)


async def prune_expired_content(conn: AsyncConnection, now: int) -> list[str]:
    """Delete the bytes of every expired file that no non-terminal batch reads; keep the records.

    Returns the ids pruned. A pruned file's record gets ``content_deleted_at`` (its content answers 404
    ``file_expired``); an input file of a batch that has not finished is never pruned, even past its expiry.
    """
    in_use = select(batches.c.input_file_id).where(batches.c.status.not_in(TERMINAL_STATUSES))
    due = (
        select(files.c.id)
        .where(files.c.expires_at <= now, files.c.content_deleted_at.is_(None), files.c.id.not_in(in_use))
        .order_by(files.c.id)
    )
    ids = list((await conn.execute(due)).scalars())
    for file_id in ids:
        await conn.execute(delete(file_chunks).where(file_chunks.c.file_id == file_id))
        await conn.execute(update(files).where(files.c.id == file_id).values(content_deleted_at=now))
    return ids
