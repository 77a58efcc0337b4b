"""Usage records and their rollups.

:func:`record_usage` is called inside the transaction that records a result (a batch row's record, or right after a
synchronous request), so the charge and the result commit together or not at all. It inserts with ``ON CONFLICT DO
NOTHING`` on the unique keys (per request id, per batch line) and takes the cost off the key's balance only when the
line was new: a row recorded twice can never be charged twice.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection

from .schema import api_keys, usage_records

#: ``group_by`` values of :func:`rollup`.
GROUPS = ("day", "model", "key")


def day_of(at: int) -> str:
    """The UTC day (``YYYY-MM-DD``) of Unix second ``at``: the key of the per-day rollup."""
    return datetime.datetime.fromtimestamp(at, datetime.UTC).strftime("%Y-%m-%d")


@dataclass(frozen=True)
class Usage:
    """One usage line: who (``key_id``), what (``model``, ``kind`` ``realtime``/``batch``, ``endpoint``), how much
    (tokens; ``cost`` in micro-units), and its unique source (``request_id``, or ``batch_id`` + ``line``)."""

    key_id: str
    model: str
    kind: str
    endpoint: str
    input_tokens: int
    output_tokens: int
    cost: int
    created_at: int
    request_id: str | None = None
    batch_id: str | None = None
    line: int | None = None


async def record_usage(conn: AsyncConnection, usage: Usage) -> bool:
    """Insert ``usage`` and charge its cost to the key's balance (an unlimited key's stays None), in the caller's
    transaction. Returns False, charging nothing, when a line for the same request id or batch line exists."""
    values = {
        "key_id": usage.key_id,
        "model": usage.model,
        "kind": usage.kind,
        "endpoint": usage.endpoint,
        "input_tokens": usage.input_tokens,
        "output_tokens": usage.output_tokens,
        "cost": usage.cost,
        "request_id": usage.request_id,
        "batch_id": usage.batch_id,
        "line": usage.line,
        "created_at": usage.created_at,
        "day": day_of(usage.created_at),
    }
    dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
    stmt = dialect.insert(usage_records).values(**values).on_conflict_do_nothing().returning(usage_records.c.id)
    if (await conn.execute(stmt)).first() is None:  # (rowcount is not reliable for an INSERT on every driver)
        return False
    if usage.cost:
        await conn.execute(
            update(api_keys)
            .where(api_keys.c.id == usage.key_id, api_keys.c.balance.is_not(None))
            .values(balance=api_keys.c.balance - usage.cost)
        )
    return True


async def balance_of(conn: AsyncConnection, key_id: str) -> int | None:
    """The key's balance now (None: unlimited or no such key)."""
    value = (await conn.execute(select(api_keys.c.balance).where(api_keys.c.id == key_id))).scalar()
    return int(value) if value is not None else None


async def rollup(
    conn: AsyncConnection,
    *,
    group_by: str,
    start: str | None = None,
    end: str | None = None,
    key_id: str | None = None,
    model: str | None = None,
    kind: str | None = None,
) -> list[dict[str, Any]]:
    """Sums of requests, tokens and cost per ``group_by`` (``day``, ``model`` or ``key``), over the days ``start``
    to ``end`` inclusive (``YYYY-MM-DD``, either may be None), filtered by key, model and kind; ordered by the group.
    Each item: ``{<group>, requests, input_tokens, output_tokens, cost}``."""
    column = {"day": usage_records.c.day, "model": usage_records.c.model, "key": usage_records.c.key_id}[group_by]
    q = select(
        column.label("group"),
        func.count().label("requests"),
        func.coalesce(func.sum(usage_records.c.input_tokens), 0).label("input_tokens"),
        func.coalesce(func.sum(usage_records.c.output_tokens), 0).label("output_tokens"),
        func.coalesce(func.sum(usage_records.c.cost), 0).label("cost"),
    )
    if start is not None:
        q = q.where(usage_records.c.day >= start)
    if end is not None:
        q = q.where(usage_records.c.day <= end)
    if key_id is not None:
        q = q.where(usage_records.c.key_id == key_id)
    if model is not None:
        q = q.where(usage_records.c.model == model)
    if kind is not None:
        q = q.where(usage_records.c.kind == kind)
    rows = (await conn.execute(q.group_by(column).order_by(column))).all()
    return [
        {
            ("key_id" if group_by == "key" else group_by): r.group,
            "requests": int(r.requests),
            "input_tokens": int(r.input_tokens),
            "output_tokens": int(r.output_tokens),
            "cost": int(r.cost),
        }
        for r in rows
    ]


async def batch_charges(conn: AsyncConnection, batch_id: str) -> tuple[int, int]:
    """``(records, cost)`` of a batch's usage lines (for audits and tests)."""
    count, cost = (
        await conn.execute(
            select(func.count(), func.coalesce(func.sum(usage_records.c.cost), 0)).where(
                usage_records.c.batch_id == batch_id
            )
        )
    ).one()
    return int(count), int(cost)
