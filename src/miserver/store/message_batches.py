"""The statements Anthropic's Message Batches API needs beyond ``store.batches``: its listing (one endpoint, paged by
``before_id``/``after_id``) and the deletion of an ended batch. A Message Batch is an ordinary batch row."""

from __future__ import annotations

from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncConnection

from .batches import BatchRecord
from .schema import TERMINAL_STATUSES, batch_rows, batches


async def list_for_endpoint(
    conn: AsyncConnection,
    *,
    endpoint: str,
    limit: int,
    after: str | None,
    before: str | None,
    owner: str | None = None,
) -> tuple[list[BatchRecord], bool]:
    """The batches of ``endpoint``, newest first: the page just older than batch ``after`` (or just newer than batch
    ``before``; neither: the newest), at most ``limit``, and whether more follow in that direction. Only the batches
    of ``owner`` (None: every owner's)."""
    q = select(batches).where(batches.c.endpoint == endpoint)
    if owner is not None:
        q = q.where(batches.c.owner_key_id == owner)
    if before is not None:
        q = q.where(batches.c.id > before).order_by(batches.c.id.asc())
    else:
        if after is not None:
            q = q.where(batches.c.id < after)
        q = q.order_by(batches.c.id.desc())
    rows = [BatchRecord.from_row(r) for r in (await conn.execute(q.limit(limit + 1))).all()]
    page = rows[:limit]
    if before is not None:
        page.reverse()
    return page, len(rows) > limit


async def delete_ended(conn: AsyncConnection, batch_id: str) -> bool:
    """Delete a batch that has ended (terminal status) and its rows, in the caller's transaction; False when it is
    gone or has not ended (nothing is deleted then). Its files are the caller's to delete."""
    ended = select(batches.c.id).where(batches.c.id == batch_id, batches.c.status.in_(TERMINAL_STATUSES)).exists()
    await conn.execute(delete(batch_rows).where(batch_rows.c.batch_id == batch_id, ended))
    result = await conn.execute(
        delete(batches).where(batches.c.id == batch_id, batches.c.status.in_(TERMINAL_STATUSES))
    )
    return result.rowcount == 1
