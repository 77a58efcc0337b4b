"""API keys and their credits. Only the SHA-256 digest of a key and a display prefix are stored.

A key's ``balance`` (integer micro-units; None: unlimited) is kept equal to the sum of its credits
(:data:`~miserver.store.schema.key_credits`) minus the sum of its usage costs
(:data:`~miserver.store.schema.usage_records`): a credit and its balance change are one transaction here, a charge and
its usage record one transaction in :mod:`miserver.store.usage`. :func:`ledger` recomputes both sides for an audit.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sqlalchemy import bindparam, func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from .schema import TERMINAL_STATUSES, api_keys, batches, key_credits, usage_records


@dataclass(frozen=True)
class KeyRecord:
    """A stored key (never the key itself): ``prefix`` is what lists show (``sk-`` + 8 characters); ``balance`` in
    micro-units or None (unlimited); quotas None when the key has none; times in Unix seconds."""

    id: str
    name: str
    prefix: str
    admin: bool
    balance: int | None
    max_pending_batches: int | None
    max_enqueued_tokens: int | None
    created_at: int
    revoked_at: int | None
    #: the scopes it was made with (None: the member default, which every key made before scopes has)
    scopes: tuple[str, ...] | None = None

    @property
    def active(self) -> bool:
        return self.revoked_at is None

    @classmethod
    def from_row(cls, row: Any) -> KeyRecord:
        m = row._mapping
        values = {k: m[k] for k in cls.__dataclass_fields__}
        values["admin"] = bool(values["admin"])
        values["scopes"] = None if values["scopes"] is None else tuple(json.loads(values["scopes"]))
        return cls(**values)


_COLUMNS = [api_keys.c[name] for name in KeyRecord.__dataclass_fields__]


class KeyNotFound(Exception):
    """A key write matched no key (unknown id, or already revoked where that matters)."""


async def insert_key(
    conn: AsyncConnection,
    *,
    key_id: str,
    name: str,
    digest: str,
    prefix: str,
    admin: bool,
    balance: int | None,
    max_pending_batches: int | None,
    max_enqueued_tokens: int | None,
    created_at: int,
    scopes: tuple[str, ...] | None = None,
) -> KeyRecord:
    """Insert a key (``scopes`` None: the member default); an opening ``balance`` above zero is also written as its
    first credit."""
    await conn.execute(
        insert(api_keys).values(
            id=key_id,
            name=name,
            digest=digest,
            prefix=prefix,
            admin=admin,
            balance=balance,
            max_pending_batches=max_pending_batches,
            max_enqueued_tokens=max_enqueued_tokens,
            created_at=created_at,
            scopes=None if scopes is None else json.dumps(list(scopes)),
        )
    )
    if balance is not None and balance > 0:
        await conn.execute(insert(key_credits).values(key_id=key_id, amount=balance, created_at=created_at))
    record = await get_key(conn, key_id)
    assert record is not None
    return record


# Named statements of authentication (every request runs one) and of the runner's key checks, built once.
_BY_ID = select(*_COLUMNS).where(api_keys.c.id == bindparam("b_id"))
_BY_DIGEST = select(*_COLUMNS).where(api_keys.c.digest == bindparam("b_digest"))
_ANY_KEY = select(api_keys.c.id).limit(1)


async def get_key(conn: AsyncConnection, key_id: str) -> KeyRecord | None:
    """The key with id ``key_id`` (revoked or not); None when there is none."""
    row = (await conn.execute(_BY_ID, {"b_id": key_id})).first()
    return KeyRecord.from_row(row) if row else None


async def find_by_digest(conn: AsyncConnection, digest: str) -> KeyRecord | None:
    """The key whose SHA-256 hex digest is ``digest`` (revoked or not); None when there is none."""
    row = (await conn.execute(_BY_DIGEST, {"b_digest": digest})).first()
    return KeyRecord.from_row(row) if row else None


async def any_key(conn: AsyncConnection) -> bool:
    """Whether the database holds at least one key. Keys are never deleted (a revoked key stays, and keeps the server
    closed), so once this is true it stays true."""
    return (await conn.execute(_ANY_KEY)).first() is not None


async def list_keys(conn: AsyncConnection) -> list[KeyRecord]:
    """Every key, oldest first."""
    return [KeyRecord.from_row(r) for r in (await conn.execute(select(*_COLUMNS).order_by(api_keys.c.id))).all()]


async def revoke(conn: AsyncConnection, key_id: str, at: int) -> KeyRecord:
    """Revoke an active key (one guarded statement). Raises :class:`KeyNotFound` for an unknown or revoked key."""
    stmt = update(api_keys).where(api_keys.c.id == key_id, api_keys.c.revoked_at.is_(None)).values(revoked_at=at)
    if (await conn.execute(stmt)).rowcount != 1:
        raise KeyNotFound(key_id)
    record = await get_key(conn, key_id)
    assert record is not None
    return record


async def top_up(conn: AsyncConnection, key_id: str, amount: int, at: int) -> KeyRecord:
    """Add ``amount`` (> 0 micro-units) to an active key with a balance: the credit line and the balance change in
    one transaction. Raises :class:`KeyNotFound` for an unknown, revoked or unlimited key."""
    stmt = (
        update(api_keys)
        .where(api_keys.c.id == key_id, api_keys.c.revoked_at.is_(None), api_keys.c.balance.is_not(None))
        .values(balance=api_keys.c.balance + amount)
    )
    if (await conn.execute(stmt)).rowcount != 1:
        raise KeyNotFound(key_id)
    await conn.execute(insert(key_credits).values(key_id=key_id, amount=amount, created_at=at))
    record = await get_key(conn, key_id)
    assert record is not None
    return record


@dataclass(frozen=True)
class Ledger:
    """Both sides of a key's account, recomputed from the lines: ``credits`` and ``charges`` (micro-units), the
    stored ``balance`` (None: unlimited), and ``records`` (usage records). ``consistent`` when the stored balance
    equals credits minus charges (always true of an unlimited key)."""

    key_id: str
    credits: int
    charges: int
    balance: int | None
    records: int

    @property
    def consistent(self) -> bool:
        return self.balance is None or self.balance == self.credits - self.charges


async def ledger(conn: AsyncConnection, key_id: str) -> Ledger:
    """Recompute ``key_id``'s account from its credit lines and usage records. Raises :class:`KeyNotFound`."""
    record = await get_key(conn, key_id)
    if record is None:
        raise KeyNotFound(key_id)
    credits = (
        await conn.execute(
            select(func.coalesce(func.sum(key_credits.c.amount), 0)).where(key_credits.c.key_id == key_id)
        )
    ).scalar_one()
    charges, count = (
        await conn.execute(
            select(func.coalesce(func.sum(usage_records.c.cost), 0), func.count()).where(
                usage_records.c.key_id == key_id
            )
        )
    ).one()
    return Ledger(key_id, int(credits), int(charges), record.balance, int(count))


@dataclass(frozen=True)
class QueueUse:
    """What a key has in the queue now: batches not terminal, and their input tokens counted at validation."""

    pending_batches: int
    enqueued_tokens: int


async def queue_use(conn: AsyncConnection, key_id: str) -> QueueUse:
    """The key's non-terminal batches and the sum of their ``enqueued_tokens`` (the quota reservations; a batch
    releases its reservation by reaching a terminal status)."""
    count, tokens = (
        await conn.execute(
            select(func.count(), func.coalesce(func.sum(batches.c.enqueued_tokens), 0)).where(
                batches.c.owner_key_id == key_id, batches.c.status.not_in(TERMINAL_STATUSES)
            )
        )
    ).one()
    return QueueUse(int(count), int(tokens))
