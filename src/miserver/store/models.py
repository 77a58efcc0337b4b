"""Durable facts about resident models: the weights-torn flag (DESIGN §3.5, Weights)."""

from __future__ import annotations

from sqlalchemy import insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from .schema import model_state


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
