"""Webhook delivery: a background job (:mod:`miserver.jobs.background`) that sends the outbox's due events.

Each event is POSTed as JSON to its endpoint, signed as Standard Webhooks says (the ``standardwebhooks`` library:
``webhook-id`` is the outbox row's stable id, ``webhook-timestamp`` the attempt's Unix seconds, ``webhook-signature``
``v1,<base64 HMAC-SHA256>``). A 2xx answer delivers it; anything else (another status, a timeout, a refused
connection, a destination no longer allowed) is retried after ``MISERVER_WEBHOOK_RETRY_SECONDS`` x 4^(n-1) for the
n-th failure, up to :data:`MAX_ATTEMPTS` attempts (with the default of 10 s: 10 s, 40 s, 160 s, 11 min, 43 min, 2.8 h,
so six attempts in the first hour), then it is marked ``failed``. Delivery is at least once: a process killed after
sending but before recording sends again later, under the same ``webhook-id``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import UTC, datetime

import httpx
from standardwebhooks.webhooks import Webhook

from ..clock import now, now_ms
from ..services.batch_api.webhooks import DestinationRefused, check_destination
from ..settings import Settings
from ..store import Store
from ..store import outbox as store_outbox
from ..store.outbox import Delivery

log = logging.getLogger("miserver.webhooks")

#: Attempts before an event is given up.
MAX_ATTEMPTS = 7
#: Seconds one attempt may take (connect, send, answer).
ATTEMPT_TIMEOUT_SECONDS = 10.0
#: Events sent per pass, one claim each: a delivering process holds an event this long (ms, one attempt's timeout
#: and a margin) before another process may retry it.
BATCH_SIZE = 20
CLAIM_MS = int(ATTEMPT_TIMEOUT_SECONDS * 1000) + 5_000


class DeliveryStats:
    """Counts of this process's delivery attempts, by result (``/metrics``)."""

    def __init__(self) -> None:
        self.delivered = 0
        self.failed_attempts = 0
        self.given_up = 0


#: The process's counters (one delivery task per process).
STATS = DeliveryStats()


def retry_delay(attempts: int, base_seconds: float) -> float | None:
    """Seconds to wait after the ``attempts``-th failed attempt; None once :data:`MAX_ATTEMPTS` were made."""
    if attempts >= MAX_ATTEMPTS:
        return None
    return float(base_seconds * 4 ** (attempts - 1))


def signed_headers(delivery: Delivery, at: datetime) -> dict[str, str]:
    """The Standard Webhooks headers of one attempt (signed with the endpoint's secret)."""
    signature = Webhook(delivery.secret).sign(delivery.id, at, delivery.payload)
    return {
        "content-type": "application/json",
        "webhook-id": delivery.id,
        "webhook-timestamp": str(int(at.timestamp())),
        "webhook-signature": signature,
    }


async def attempt(client: httpx.AsyncClient, delivery: Delivery, *, allow_private: bool) -> str | None:
    """Send one attempt; None when delivered (2xx), else the reason it failed."""
    try:
        await check_destination(delivery.url, allow_private=allow_private)
    except DestinationRefused as exc:
        return str(exc)
    headers = signed_headers(delivery, datetime.fromtimestamp(now(), UTC))
    try:
        answer = await client.post(delivery.url, content=delivery.payload.encode(), headers=headers)
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"
    if 200 <= answer.status_code < 300:
        return None
    return f"HTTP {answer.status_code}"


async def deliver_due(store: Store, settings: Settings, client: httpx.AsyncClient, *, worker: str) -> int:
    """One pass: send the due events (at most :data:`BATCH_SIZE`, each claimed just before its attempt) and record
    each answer; returns how many were attempted."""
    sent = 0
    while sent < BATCH_SIZE:
        async with store.tx() as conn:
            due = await store_outbox.claim_due(
                conn, worker=worker, now_ms=now_ms(), claim_ms=CLAIM_MS, limit=1, skip_locked=store.skip_locked
            )
        if not due:
            return sent
        sent += 1
        delivery = due[0]
        error = await attempt(client, delivery, allow_private=settings.webhook_allow_private)
        async with store.tx() as conn:
            if error is None:
                await store_outbox.delivered(conn, delivery.id, at=now())
                STATS.delivered += 1
                continue
            delay = retry_delay(delivery.attempts + 1, settings.webhook_retry_seconds)
            retry_at = None if delay is None else now_ms() + int(delay * 1000)
            await store_outbox.attempt_failed(conn, delivery.id, error=error, retry_at_ms=retry_at)
        STATS.failed_attempts += 1
        STATS.given_up += delay is None
        log.info("webhook %s to %s: attempt %d failed: %s", delivery.id, delivery.url, delivery.attempts + 1, error)
    return sent


async def deliver_forever(store: Store, settings: Settings, *, worker: str, stopping: Callable[[], bool]) -> None:
    """Deliver due events until ``stopping()``, looking every ``BATCH_POLL_SECONDS`` (at once again after a full
    pass). First makes the events this process (``worker``; on SQLite, any process) claimed in a previous life due
    at once. A fault of one pass is logged and the next pass goes on."""
    async with store.tx() as conn:
        await store_outbox.release_claims(conn, worker=None if store.is_sqlite else worker, now_ms=now_ms())
    async with httpx.AsyncClient(timeout=ATTEMPT_TIMEOUT_SECONDS, follow_redirects=False) as client:
        while not stopping():
            sent = 0
            try:
                sent = await deliver_due(store, settings, client, worker=worker)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("webhook delivery pass failed")
            if sent < BATCH_SIZE:
                await asyncio.sleep(settings.batch_poll_seconds)
