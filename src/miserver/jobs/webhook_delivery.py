"""Webhook delivery: a background job (:mod:`miserver.jobs.background`) that sends the outbox's due events.

Each event is POSTed as JSON to its endpoint, signed as Standard Webhooks says (the ``standardwebhooks`` library:
``webhook-id`` is the outbox row's stable id, ``webhook-timestamp`` the attempt's Unix seconds, ``webhook-signature``
``v1,<base64 HMAC-SHA256>``). A 2xx answer delivers it; anything else (another status, a timeout, a refused
connection, a destination no longer allowed) is retried after ``MISERVER_WEBHOOK_RETRY_SECONDS`` x 4^(n-1) for the
n-th failure, up to :data:`MAX_ATTEMPTS` attempts (with the default of 10 s: 10 s, 40 s, 160 s, 11 min, 43 min, 2.8 h,
so six attempts in the first hour), then it is marked ``failed``. Endpoints are independent: up to
:data:`MAX_IN_FLIGHT` attempts are in flight at once, at most one per endpoint, so an endpoint that never answers
holds back only its own events. Delivery is at least once: a process killed after sending but before recording
sends again later, under the same ``webhook-id``.
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
#: Attempts one process keeps in flight at once (at most one per endpoint).
MAX_IN_FLIGHT = 16
#: A delivering process holds a claimed event this long (ms, one attempt's timeout and a margin) before another
#: process may retry it.
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


async def send_and_record(store: Store, settings: Settings, client: httpx.AsyncClient, delivery: Delivery) -> None:
    """One attempt of a claimed delivery, and its answer recorded: delivered, or due again after the backoff of
    :func:`retry_delay` (given up after :data:`MAX_ATTEMPTS`)."""
    error = await attempt(client, delivery, allow_private=settings.webhook_allow_private)
    async with store.tx() as conn:
        if error is None:
            await store_outbox.delivered(conn, delivery.id, at=now())
            STATS.delivered += 1
            return
        delay = retry_delay(delivery.attempts + 1, settings.webhook_retry_seconds)
        retry_at = None if delay is None else now_ms() + int(delay * 1000)
        await store_outbox.attempt_failed(conn, delivery.id, error=error, retry_at_ms=retry_at)
    STATS.failed_attempts += 1
    STATS.given_up += delay is None
    log.info("webhook %s to %s: attempt %d failed: %s", delivery.id, delivery.url, delivery.attempts + 1, error)


class Deliverer:
    """The delivering loop of one process: up to :data:`MAX_IN_FLIGHT` attempts at once, at most one per endpoint,
    so an endpoint that is slow or down holds back only its own events (each attempt ends within
    :data:`ATTEMPT_TIMEOUT_SECONDS`), and an endpoint's events go out in order."""

    def __init__(self, store: Store, settings: Settings, client: httpx.AsyncClient, *, worker: str) -> None:
        self.store = store
        self.settings = settings
        self.client = client
        self.worker = worker
        self.running: dict[asyncio.Task[None], str] = {}  # attempt -> its endpoint id

    async def start_due(self) -> int:
        """Claim and start the due events that fit (free places, endpoints not busy); returns how many started."""
        started = 0
        while len(self.running) < MAX_IN_FLIGHT:
            async with self.store.tx() as conn:
                due = await store_outbox.claim_due(
                    conn,
                    worker=self.worker,
                    now_ms=now_ms(),
                    claim_ms=CLAIM_MS,
                    limit=1,
                    skip_locked=self.store.skip_locked,
                    busy=set(self.running.values()),
                )
            if not due:
                break
            delivery = due[0]
            task = asyncio.create_task(send_and_record(self.store, self.settings, self.client, delivery))
            self.running[task] = delivery.webhook_id
            started += 1
        return started

    async def settle(self, timeout: float) -> None:
        """Wait until an attempt ends or ``timeout`` seconds pass; a failed attempt's fault is logged."""
        if not self.running:
            await asyncio.sleep(timeout)
            return
        done, _ = await asyncio.wait(self.running, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            self.running.pop(task)
            if not task.cancelled() and task.exception() is not None:
                log.error("webhook delivery failed", exc_info=task.exception())

    async def close(self) -> None:
        """Cancel the attempts in flight (their claims run out and they are due again, here or elsewhere)."""
        for task in self.running:
            task.cancel()
        await asyncio.gather(*self.running, return_exceptions=True)
        self.running.clear()


async def deliver_forever(store: Store, settings: Settings, *, worker: str, stopping: Callable[[], bool]) -> None:
    """Deliver due events until ``stopping()``, looking every ``BATCH_POLL_SECONDS`` and whenever an attempt ends
    (:class:`Deliverer`). First makes the events this process (``worker``; on SQLite, any process) claimed in a
    previous life due at once. A fault of one pass is logged and the next pass goes on."""
    async with store.tx() as conn:
        await store_outbox.release_claims(conn, worker=None if store.is_sqlite else worker, now_ms=now_ms())
    async with httpx.AsyncClient(timeout=ATTEMPT_TIMEOUT_SECONDS, follow_redirects=False) as client:
        deliverer = Deliverer(store, settings, client, worker=worker)
        try:
            while not stopping():
                try:
                    await deliverer.start_due()
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("webhook delivery pass failed")
                await deliverer.settle(settings.batch_poll_seconds)
        finally:
            await deliverer.close()
