"""Fair share in the database: rows served per owner and per batch, the one count every process on it reads.

The scheduling policy (:class:`miserver.scheduling.policy.FairShare`) ranks batches of equal urgency by these counts.
They live here, not in a process, so that several ``miserver worker`` processes on one PostgreSQL share the engine's
time between tenants as one runner would: a chunk that one worker claims is counted at once in every worker's next
plan.

The count's life, each step one statement:

- :func:`admit` starts an owner or batch that has no entry (the policy computes its head start); when two processes
  admit the same newcomer at once, the first insert wins and both read it back;
- :func:`charge` adds a claim's rows, in the claim's transaction, to its owner and its batch;
- :func:`give_back` takes away the rows a claim releases unrecorded (a chunk ended by its time bound, a stop), in
  the release's transaction, so ``served`` is rows recorded plus rows in flight;
- :func:`forget_departed` drops the entries of owners and batches with no ``in_progress`` batch left (a tenant that
  comes back is a newcomer again, as one runner would treat it).

A charge that finds no entry raises :class:`ShareNotKept` (a :class:`~miserver.store.batches.StaleStatus`), and its
claim is rolled back with it: a claim is always planned, hence admitted, first, so the miss means the batch left
``in_progress`` under the plan (a cancel) and another process dropped its entries; the runner reads the batch again.
A give-back that finds no entry changes nothing: the batch left ``in_progress`` meanwhile, and nothing is owed to it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from sqlalchemy import and_, bindparam, case, delete, exists, or_, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from .batches import StaleStatus
from .schema import batch_rows, batches, fair_share

OWNER = "owner"
BATCH = "batch"


class ShareNotKept(StaleStatus):
    """A claim's charge matched no fair-share entry of its owner or batch: the batch was never admitted, or it left
    ``in_progress`` under the plan and its entries were dropped."""

    def __init__(self, batch_id: str, owner: str) -> None:
        super().__init__(batch_id, ("in_progress",), f"fair-share charge (owner {owner!r})")


@dataclass(frozen=True)
class Shares:
    """Rows served (recorded plus in flight) by owner key and by batch id, as stored now."""

    owners: dict[str, int]
    batches: dict[str, int]


def owner_key(owner_key_id: str | None, batch_id: str) -> str:
    """What fair share is counted per: the batch's API key, or the batch itself on a server without keys."""
    return owner_key_id if owner_key_id is not None else batch_id


# Named statements, built once.
_READ = select(fair_share.c.scope, fair_share.c.key, fair_share.c.served)
_CLAIMING = (
    select(batch_rows.c.claimed_by)
    .where(batch_rows.c.claimed_until.is_not(None), batch_rows.c.claimed_until > bindparam("b_now"))
    .distinct()
)
_LIVE = batches.c.status == "in_progress"
_OWNER_LIVE = exists().where(
    _LIVE,
    or_(
        batches.c.owner_key_id == fair_share.c.key,
        and_(batches.c.owner_key_id.is_(None), batches.c.id == fair_share.c.key),
    ),
)
_BATCH_LIVE = exists().where(_LIVE, batches.c.id == fair_share.c.key)
_FORGET = delete(fair_share).where(
    or_(
        and_(fair_share.c.scope == OWNER, ~_OWNER_LIVE),
        and_(fair_share.c.scope == BATCH, ~_BATCH_LIVE),
    )
)
_BOTH = or_(
    and_(fair_share.c.scope == OWNER, fair_share.c.key == bindparam("b_owner")),
    and_(fair_share.c.scope == BATCH, fair_share.c.key == bindparam("b_batch")),
)
_CHARGE = update(fair_share).where(_BOTH).values(served=fair_share.c.served + bindparam("b_rows"))
_GIVE_BACK = (
    update(fair_share)
    .where(_BOTH)
    .values(
        served=case((fair_share.c.served >= bindparam("b_rows"), fair_share.c.served - bindparam("b_rows")), else_=0)
    )
)


async def claiming_workers(conn: AsyncConnection, *, now_ms: int) -> set[str]:
    """The workers holding a live claim on rows now (``now_ms``: Unix milliseconds), read through the index of the
    claims in flight: the workers running chunks side by side."""
    return {str(w) for w in (await conn.execute(_CLAIMING, {"b_now": now_ms})).scalars() if w is not None}


async def read(conn: AsyncConnection) -> Shares:
    """Every stored count."""
    owners: dict[str, int] = {}
    found: dict[str, int] = {}
    for scope, key, served in (await conn.execute(_READ)).all():
        (owners if scope == OWNER else found)[str(key)] = int(served)
    return Shares(owners, found)


async def forget_departed(conn: AsyncConnection) -> int:
    """Drop the entries of owners and batches that have no ``in_progress`` batch left (a tenant that comes back is a
    newcomer again); one statement over the batches as they are now, not as a caller read them. Returns the number
    of entries dropped."""
    return int((await conn.execute(_FORGET)).rowcount or 0)


async def admit(conn: AsyncConnection, *, owners: Mapping[str, int], batches: Mapping[str, int]) -> int:
    """Start each owner key and batch id given with its count (rows), unless it has an entry already: another
    process admitted it first, and its count stands. One statement; returns the number of entries written."""
    # in key order: two processes admitting the same newcomers at once take their row locks in one order
    values = [{"scope": OWNER, "key": k, "served": int(v)} for k, v in sorted(owners.items())]
    values += [{"scope": BATCH, "key": k, "served": int(v)} for k, v in sorted(batches.items())]
    if not values:
        return 0
    insert = pg_insert if conn.dialect.name == "postgresql" else sqlite_insert
    stmt = (
        insert(fair_share)
        .values(values)
        .on_conflict_do_nothing(index_elements=["scope", "key"])
        .returning(fair_share.c.key)  # (a multi-row insert's rowcount is not kept on every driver)
    )
    return len((await conn.execute(stmt)).all())


async def charge(conn: AsyncConnection, *, owner: str, batch_id: str, rows: int) -> None:
    """Add ``rows`` (claimed now, in the caller's transaction) to the counts of ``owner`` and ``batch_id``, in one
    statement. Raises :class:`ShareNotKept` when either has no entry (the caller's claim must roll back with it)."""
    changed = await conn.execute(_CHARGE, {"b_owner": owner, "b_batch": batch_id, "b_rows": rows})
    if changed.rowcount != 2:
        raise ShareNotKept(batch_id, owner)


async def give_back(conn: AsyncConnection, *, owner: str, batch_id: str, rows: int) -> int:
    """Take ``rows`` (released unrecorded, in the caller's transaction) off the counts of ``owner`` and
    ``batch_id``, in one statement, never below zero; an entry that is gone (the batch left ``in_progress``) stays
    gone. Returns the number of entries changed (2, or fewer after such a departure)."""
    return int((await conn.execute(_GIVE_BACK, {"b_owner": owner, "b_batch": batch_id, "b_rows": rows})).rowcount or 0)
