"""Stored probes (DESIGN §3.5, Probes): insert, get, list and delete by name. They survive restarts.

Weights, bias, classes and the training summary are JSON text; each function takes an open connection.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from .schema import probes


@dataclass(frozen=True)
class ProbeRecord:
    """A probe as stored. ``weights`` is ``[hidden]`` (binary, with a number ``bias``) or ``[K][hidden]`` (with a
    ``[K]`` bias); ``classes`` are strings or integers, as given at creation."""

    id: str
    name: str
    model_id: str
    weights_revision: str
    layer: int
    pooling: str
    hidden_size: int
    classes: list[Any]
    weights: list[Any]
    bias: Any
    training: dict[str, Any] | None
    description: str | None
    created_at: int
    #: the API key that made it (None: made with no keys in the database)
    owner_key_id: str | None = None

    @classmethod
    def from_row(cls, row: Any) -> ProbeRecord:
        m = row._mapping
        return cls(
            id=m["id"],
            name=m["name"],
            model_id=m["model_id"],
            weights_revision=m["weights_revision"],
            layer=m["layer"],
            pooling=m["pooling"],
            hidden_size=m["hidden_size"],
            classes=json.loads(m["classes_json"]),
            weights=json.loads(m["weights_json"]),
            bias=json.loads(m["bias_json"]),
            training=json.loads(m["training_json"]) if m["training_json"] else None,
            description=m["description"],
            created_at=m["created_at"],
            owner_key_id=m["owner_key_id"],
        )


async def insert_probe(conn: AsyncConnection, record: ProbeRecord) -> bool:
    """Insert ``record``; False (nothing written) when a probe of that name exists."""
    values = {
        "id": record.id,
        "name": record.name,
        "model_id": record.model_id,
        "weights_revision": record.weights_revision,
        "layer": record.layer,
        "pooling": record.pooling,
        "hidden_size": record.hidden_size,
        "classes_json": json.dumps(record.classes),
        "weights_json": json.dumps(record.weights),
        "bias_json": json.dumps(record.bias),
        "training_json": json.dumps(record.training) if record.training is not None else None,
        "description": record.description,
        "created_at": record.created_at,
        "owner_key_id": record.owner_key_id,
    }
    dialect_insert = pg_insert if conn.dialect.name == "postgresql" else sqlite_insert
    stmt = dialect_insert(probes).values(**values).on_conflict_do_nothing(index_elements=[probes.c.name])
    return (await conn.execute(stmt.returning(probes.c.id))).first() is not None


async def get_probe(conn: AsyncConnection, name: str) -> ProbeRecord | None:
    row = (await conn.execute(select(probes).where(probes.c.name == name))).first()
    return ProbeRecord.from_row(row) if row is not None else None


async def list_probes(conn: AsyncConnection, owner: str | None = None) -> list[ProbeRecord]:
    """Every probe of ``owner`` (None: every owner's), oldest first (ids are time-ordered)."""
    q = select(probes) if owner is None else select(probes).where(probes.c.owner_key_id == owner)
    return [ProbeRecord.from_row(r) for r in (await conn.execute(q.order_by(probes.c.id))).all()]


async def delete_probe(conn: AsyncConnection, name: str, owner: str | None = None) -> ProbeRecord | None:
    """Delete the probe named ``name`` of ``owner`` (None: any owner's); returns what was deleted, or None when there
    was none (or it is another owner's)."""
    record = await get_probe(conn, name)
    if record is not None and owner is not None and record.owner_key_id != owner:
        return None
    if record is not None:
        await conn.execute(delete(probes).where(probes.c.id == record.id))
    return record
