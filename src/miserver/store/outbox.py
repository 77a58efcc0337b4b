"""Webhook endpoints and the outbox of their deliveries.

An event (``batch.completed``...) is written here, one outbox row per subscribed endpoint, in the transaction of the
status change that raised it (:func:`enqueue`, called by :func:`miserver.store.batches.try_transition`), so a status
change and its events commit together or not at all. A delivering process takes due rows with :func:`claim_due`,
which pushes their ``next_attempt_at`` forward first (its claim: a process killed mid-delivery leaves the row due
again after the claim), then records the answer with :func:`delivered` or :func:`attempt_failed`. Delivery is at
least once; the row's ``id`` is the stable ``webhook-id`` a receiver deduplicates on.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass

from sqlalchemy import bindparam, delete, func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from ..ids import ordered_id
from .schema import webhook_outbox, webhooks

#: The event sent while a batch runs (at most every ``MISERVER_WEBHOOK_PROGRESS_SECONDS`` per batch and endpoint).
PROGRESS_EVENT = "batch.progress"
#: Batch statuses that raise an event, and the event's type.
STATUS_EVENTS = {
    "completed": "batch.completed",
    "failed": "batch.failed",
    "expired": "batch.expired",
    "cancelled": "batch.cancelled",
}


@dataclass(frozen=True)
class WebhookRecord:
    """A registered endpoint: ``events`` is the list of event types it receives."""

    id: str
    url: str
    events: list[str]
    secret: str
    owner_key_id: str | None
    created_at: int


@dataclass(frozen=True)
class Delivery:
    """A due outbox row with its endpoint: ``attempts`` counts the attempts made before this one."""

    id: str
    event_id: str
    event_type: str
    batch_id: str
    payload: str
    attempts: int
    url: str
    secret: str
    #: the endpoint's id: a delivering process keeps at most one attempt in flight per endpoint
    webhook_id: str = ""


def _webhook(row: object) -> WebhookRecord:
    m = dict(row._mapping)  # type: ignore[attr-defined]
    m["events"] = json.loads(m.pop("events_json"))
    return WebhookRecord(**m)


async def insert_webhook(
    conn: AsyncConnection, *, url: str, events: list[str], secret: str, owner_key_id: str | None, created_at: int
) -> WebhookRecord:
    """Register an endpoint; returns its record (id ``wh_...``)."""
    webhook_id = ordered_id("wh_")
    await conn.execute(
        insert(webhooks).values(
            id=webhook_id,
            url=url,
            events_json=json.dumps(events),
            secret=secret,
            owner_key_id=owner_key_id,
            created_at=created_at,
        )
    )
    return WebhookRecord(webhook_id, url, events, secret, owner_key_id, created_at)


async def list_webhooks(conn: AsyncConnection) -> list[WebhookRecord]:
    """Every endpoint, oldest first."""
    return [_webhook(r) for r in (await conn.execute(select(webhooks).order_by(webhooks.c.id))).all()]


async def get_webhook(conn: AsyncConnection, webhook_id: str) -> WebhookRecord | None:
    row = (await conn.execute(select(webhooks).where(webhooks.c.id == webhook_id))).first()
    return _webhook(row) if row else None


async def delete_webhook(conn: AsyncConnection, webhook_id: str) -> bool:
    """Delete an endpoint and its undelivered outbox rows; False when there is none."""
    await conn.execute(delete(webhook_outbox).where(webhook_outbox.c.webhook_id == webhook_id))
    return (await conn.execute(delete(webhooks).where(webhooks.c.id == webhook_id))).rowcount == 1


def event_payload(event_id: str, event_type: str, batch_id: str, created_at: int) -> str:
    """OpenAI's webhook event: ``{"id", "object": "event", "created_at", "type", "data": {"id"}}`` (JSON text)."""
    return json.dumps(
        {"id": event_id, "object": "event", "created_at": created_at, "type": event_type, "data": {"id": batch_id}}
    )


async def enqueue(conn: AsyncConnection, *, batch_id: str, owner_key_id: str | None, event_type: str, at: int) -> int:
    """Write one outbox row per endpoint subscribed to ``event_type`` (and allowed to see the batch: registered with
    no key, or by the batch's owner), due now, in the caller's transaction. Returns the rows written."""
    event_id = ordered_id("evt_")
    payload = event_payload(event_id, event_type, batch_id, at)
    values = [
        {
            "id": ordered_id("msg_"),
            "event_id": event_id,
            "webhook_id": w.id,
            "event_type": event_type,
            "batch_id": batch_id,
            "payload": payload,
            "created_at": at,
            "state": "pending",
            "attempts": 0,
            "next_attempt_at": at * 1000,
        }
        for w in await list_webhooks(conn)
        if event_type in w.events and (w.owner_key_id is None or w.owner_key_id == owner_key_id)
    ]
    if values:
        await conn.execute(insert(webhook_outbox), values)
    return len(values)


async def enqueue_progress(
    conn: AsyncConnection, *, batch_id: str, owner_key_id: str | None, at: int, min_interval: float
) -> int:
    """Write a ``batch.progress`` event for each endpoint subscribed to it (and allowed to see the batch) that got no
    progress event of this batch in the last ``min_interval`` seconds; returns the rows written."""
    hooks = [
        w
        for w in await list_webhooks(conn)
        if PROGRESS_EVENT in w.events and (w.owner_key_id is None or w.owner_key_id == owner_key_id)
    ]
    if not hooks:
        return 0
    q = (
        select(webhook_outbox.c.webhook_id, func.max(webhook_outbox.c.created_at))
        .where(webhook_outbox.c.batch_id == batch_id, webhook_outbox.c.event_type == PROGRESS_EVENT)
        .group_by(webhook_outbox.c.webhook_id)
    )
    last = {str(w): int(t) for w, t in (await conn.execute(q)).all()}
    due = [w for w in hooks if w.id not in last or at - last[w.id] >= min_interval]
    if not due:
        return 0
    event_id = ordered_id("evt_")
    payload = event_payload(event_id, PROGRESS_EVENT, batch_id, at)
    values = [
        {
            "id": ordered_id("msg_"),
            "event_id": event_id,
            "webhook_id": w.id,
            "event_type": PROGRESS_EVENT,
            "batch_id": batch_id,
            "payload": payload,
            "created_at": at,
            "state": "pending",
            "attempts": 0,
            "next_attempt_at": at * 1000,
        }
        for w in due
    ]
    await conn.execute(insert(webhook_outbox), values)
    return len(values)


# The delivery loop's poll (every BATCH_POLL_SECONDS in every process), built once.
_DUE = (
    select(webhook_outbox.c.id)
    .where(webhook_outbox.c.state == "pending", webhook_outbox.c.next_attempt_at <= bindparam("b_now"))
    .order_by(webhook_outbox.c.next_attempt_at, webhook_outbox.c.id)
    .limit(bindparam("b_limit"))
)
_DUE_LOCKED = _DUE.with_for_update(skip_locked=True)


async def claim_due(
    conn: AsyncConnection,
    *,
    worker: str,
    now_ms: int,
    claim_ms: int,
    limit: int,
    skip_locked: bool,
    busy: Collection[str] = (),
) -> list[Delivery]:
    """Take up to ``limit`` pending rows due at ``now_ms``, none for an endpoint among ``busy`` (endpoint ids whose
    attempt is in flight): their ``next_attempt_at`` moves to ``now_ms + claim_ms`` in this statement's transaction
    (another process does not take them meanwhile; if this one dies, they are due again then). Returns them with
    their endpoint's URL and secret, oldest first."""
    due = _DUE_LOCKED if skip_locked else _DUE
    if busy:
        due = due.where(webhook_outbox.c.webhook_id.not_in(list(busy)))
    ids = [r[0] for r in (await conn.execute(due, {"b_now": now_ms, "b_limit": limit})).all()]
    if not ids:
        return []
    await conn.execute(
        update(webhook_outbox)
        .where(webhook_outbox.c.id.in_(ids), webhook_outbox.c.state == "pending")
        .values(next_attempt_at=now_ms + claim_ms, claimed_by=worker)
    )
    q = (
        select(webhook_outbox, webhooks.c.url, webhooks.c.secret)
        .join(webhooks, webhooks.c.id == webhook_outbox.c.webhook_id)
        .where(webhook_outbox.c.id.in_(ids))
        .order_by(webhook_outbox.c.id)
    )
    return [
        Delivery(r.id, r.event_id, r.event_type, r.batch_id, r.payload, r.attempts, r.url, r.secret, r.webhook_id)
        for r in (await conn.execute(q)).all()
    ]


async def delivered(conn: AsyncConnection, delivery_id: str, *, at: int) -> None:
    """The endpoint answered 2xx: the row is done."""
    await conn.execute(
        update(webhook_outbox)
        .where(webhook_outbox.c.id == delivery_id, webhook_outbox.c.state == "pending")
        .values(
            state="delivered", delivered_at=at, attempts=webhook_outbox.c.attempts + 1, last_error=None, claimed_by=None
        )
    )


async def attempt_failed(conn: AsyncConnection, delivery_id: str, *, error: str, retry_at_ms: int | None) -> None:
    """An attempt failed with ``error``: due again at ``retry_at_ms``, or given up (``failed``) when None."""
    values: dict[str, object] = {
        "attempts": webhook_outbox.c.attempts + 1,
        "last_error": error[:1000],
        "claimed_by": None,
    }
    if retry_at_ms is None:
        values["state"] = "failed"
    else:
        values["next_attempt_at"] = retry_at_ms
    await conn.execute(
        update(webhook_outbox)
        .where(webhook_outbox.c.id == delivery_id, webhook_outbox.c.state == "pending")
        .values(**values)
    )


async def release_claims(conn: AsyncConnection, *, worker: str | None, now_ms: int) -> int:
    """Make the events claimed by ``worker`` (None: by any process; SQLite's one process at its start) due now: its
    previous life died mid-delivery. Returns how many."""
    q = update(webhook_outbox).where(webhook_outbox.c.state == "pending", webhook_outbox.c.claimed_by.is_not(None))
    if worker is not None:
        q = q.where(webhook_outbox.c.claimed_by == worker)
    return int((await conn.execute(q.values(next_attempt_at=now_ms, claimed_by=None))).rowcount or 0)


async def counts(conn: AsyncConnection) -> dict[str, int]:
    """Outbox rows by state (``pending``, ``delivered``, ``failed``)."""
    q = select(webhook_outbox.c.state, func.count()).group_by(webhook_outbox.c.state)
    found = {str(state): int(n) for state, n in (await conn.execute(q)).all()}
    return {state: found.get(state, 0) for state in ("pending", "delivered", "failed")}
