"""Remembered gateway discovery (DESIGN §8, Upstream): per upstream name, its base URL and the models it listed.

A gateway writes an upstream's list after a probe that found it changed (and after its first successful probe), and
reads every upstream's at start, so an upstream that is down when the gateway (re)starts still has its pools: its
rows wait (``upstream_unavailable``) and synchronous requests get 503, instead of 404 ``model_not_found``.

Several processes (``miserver serve`` and ``miserver worker`` on one PostgreSQL) may write the same upstream's list at
once: :func:`replace_models` first upserts the upstream's row, which locks it until the transaction ends, so the
writers of one upstream take turns and the last one wins, without a unique violation. Each function takes an open
connection; :func:`replace_models` must run in one transaction (``Store.tx``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import delete, insert, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from .schema import upstream_models, upstreams

#: Longest model id kept (the column's length; a longer one could not name a batch's model either).
MAX_MODEL_ID = 512
#: Context lengths at or above this are stored as unknown (NULL): the column is a 32-bit integer.
MAX_CONTEXT_LENGTH = 2**31


@dataclass(frozen=True)
class StoredModel:
    """One model an upstream listed: its id, its context length in tokens (None: not said), and ``last_seen_at``
    (Unix seconds: when a probe last wrote the upstream's list with it)."""

    id: str
    context_length: int | None
    last_seen_at: int


@dataclass(frozen=True)
class StoredUpstream:
    """An upstream as remembered: its name, the base URL it had then (as configured, ending in ``/v1``), when its
    list was last written (Unix seconds) and its models, by id."""

    name: str
    base_url: str
    updated_at: int
    models: tuple[StoredModel, ...]


async def replace_models(
    conn: AsyncConnection, name: str, base_url: str, models: Sequence[tuple[str, int | None]], at: int
) -> None:
    """Make ``models`` (``(id, context length in tokens or None)`` pairs, in any order; a repeated id counts once, the
    first wins) upstream ``name``'s whole list, seen at ``at`` (Unix seconds), with ``base_url``.

    Three statements in the caller's transaction: an upsert of the upstream's row (its row lock makes concurrent
    writers of the same upstream take turns on PostgreSQL; SQLite has one writer), a delete of its old models and
    one insert of the new ones. Ids longer than :data:`MAX_MODEL_ID` are left out; a context length out of the
    column's range is stored as None.
    """
    dialect_insert = pg_insert if conn.dialect.name == "postgresql" else sqlite_insert
    upsert = dialect_insert(upstreams).values(name=name, base_url=base_url, updated_at=at)
    upsert = upsert.on_conflict_do_update(
        index_elements=[upstreams.c.name], set_={"base_url": upsert.excluded.base_url, "updated_at": at}
    )
    await conn.execute(upsert)
    await conn.execute(delete(upstream_models).where(upstream_models.c.upstream == name))
    rows: dict[str, int | None] = {}
    for model_id, length in models:
        if len(model_id) <= MAX_MODEL_ID and model_id not in rows:
            rows[model_id] = length if length is not None and 0 < length < MAX_CONTEXT_LENGTH else None
    if rows:
        await conn.execute(
            insert(upstream_models),
            [
                {"upstream": name, "model": m, "context_length": length, "last_seen_at": at}
                for m, length in rows.items()
            ],
        )


async def list_upstreams(conn: AsyncConnection) -> list[StoredUpstream]:
    """Every remembered upstream, by name, each with its models by id (an upstream that listed none has none).
    One statement (an outer join), so an upstream's URL and models are always of the same write."""
    query = (
        select(upstreams, upstream_models.c.model, upstream_models.c.context_length, upstream_models.c.last_seen_at)
        .select_from(upstreams.outerjoin(upstream_models, upstream_models.c.upstream == upstreams.c.name))
        .order_by(upstreams.c.name, upstream_models.c.model)
    )
    heads: dict[str, tuple[str, int]] = {}
    models: dict[str, list[StoredModel]] = {}
    for r in await conn.execute(query):
        heads.setdefault(r.name, (r.base_url, r.updated_at))
        listed = models.setdefault(r.name, [])
        if r.model is not None:
            listed.append(StoredModel(r.model, r.context_length, r.last_seen_at))
    return [StoredUpstream(n, url, at, tuple(models[n])) for n, (url, at) in heads.items()]
