"""Durable facts about resident models (DESIGN §3.5, §10 model life): the weights-torn flag, checkpoints, and the
catalogue entries added at run time."""

from __future__ import annotations

import json
from dataclasses import dataclass

from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from .schema import TERMINAL_STATUSES, batches, catalogue_models, checkpoints, model_state


async def weights_torn(conn: AsyncConnection, model_id: str) -> bool:
    """Whether ``model_id``'s resident weights were left mid-write (no row runs until they are whole)."""
    value = (await conn.execute(select(model_state.c.weights_torn).where(model_state.c.model_id == model_id))).scalar()
    return bool(value)


async def set_weights_torn(conn: AsyncConnection, model_id: str, torn: bool, at: int) -> None:
    """Set or clear the flag (an upsert that works on SQLite and PostgreSQL)."""
    changed = await conn.execute(
        update(model_state).where(model_state.c.model_id == model_id).values(weights_torn=torn, updated_at=at)
    )
    if changed.rowcount == 0:
        await conn.execute(insert(model_state).values(model_id=model_id, weights_torn=torn, updated_at=at))


@dataclass(frozen=True)
class CheckpointRecord:
    """A saved checkpoint: ``path`` is its transformers folder, ``bytes`` its size on disk, times Unix seconds."""

    model_id: str
    path: str
    base_model: str
    weights_revision: str
    bytes: int
    created_at: int

    def as_json(self) -> dict[str, object]:
        return {
            "id": self.model_id,
            "object": "checkpoint",
            "base_model": self.base_model,
            "weights_revision": self.weights_revision,
            "bytes": self.bytes,
            "created_at": self.created_at,
        }


async def insert_checkpoint(conn: AsyncConnection, record: CheckpointRecord) -> None:
    """Record a checkpoint (the primary key refuses a second one of the same id: ``IntegrityError``)."""
    await conn.execute(
        insert(checkpoints).values(
            model_id=record.model_id,
            path=record.path,
            base_model=record.base_model,
            weights_revision=record.weights_revision,
            bytes=record.bytes,
            created_at=record.created_at,
        )
    )


async def list_checkpoints(conn: AsyncConnection) -> list[CheckpointRecord]:
    """Every checkpoint, oldest first."""
    rows = await conn.execute(select(checkpoints).order_by(checkpoints.c.created_at, checkpoints.c.model_id))
    return [CheckpointRecord(**dict(r._mapping)) for r in rows]


async def get_checkpoint(conn: AsyncConnection, model_id: str) -> CheckpointRecord | None:
    row = (await conn.execute(select(checkpoints).where(checkpoints.c.model_id == model_id))).first()
    return CheckpointRecord(**dict(row._mapping)) if row else None


async def delete_checkpoint(conn: AsyncConnection, model_id: str) -> bool:
    """Delete the record unless a non-terminal batch names the model (one guarded statement); True when deleted."""
    in_use = (
        select(func.count())
        .select_from(batches)
        .where(batches.c.model == model_id, batches.c.status.not_in(TERMINAL_STATUSES))
        .scalar_subquery()
    )
    gone = await conn.execute(delete(checkpoints).where(checkpoints.c.model_id == model_id, in_use == 0))
    return bool(gone.rowcount)


async def batches_naming(conn: AsyncConnection, model_id: str) -> list[str]:
    """Ids of the non-terminal batches whose model is ``model_id`` (at most 10)."""
    rows = await conn.execute(
        select(batches.c.id)
        .where(batches.c.model == model_id, batches.c.status.not_in(TERMINAL_STATUSES))
        .order_by(batches.c.id)
        .limit(10)
    )
    return [str(r[0]) for r in rows]


@dataclass(frozen=True)
class CatalogueRecord:
    """A catalogue entry added at run time (``miserver models add``)."""

    model_id: str
    source: str
    aliases: tuple[str, ...]
    created_at: int


async def add_catalogue_model(conn: AsyncConnection, record: CatalogueRecord) -> None:
    """Add or replace the entry ``record.model_id``."""
    await conn.execute(delete(catalogue_models).where(catalogue_models.c.model_id == record.model_id))
    await conn.execute(
        insert(catalogue_models).values(
            model_id=record.model_id,
            source=record.source,
            aliases_json=json.dumps(list(record.aliases)),
            created_at=record.created_at,
        )
    )


async def list_catalogue_models(conn: AsyncConnection) -> list[CatalogueRecord]:
    """The entries added at run time, oldest first."""
    rows = await conn.execute(select(catalogue_models).order_by(catalogue_models.c.created_at))
    return [CatalogueRecord(r.model_id, r.source, tuple(json.loads(r.aliases_json)), r.created_at) for r in rows]
