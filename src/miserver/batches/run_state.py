"""What the batch runner and its upstream chunks share: the store and the services' context, who this worker is,
the claim's time to live, whether the process is stopping, the nudge that wakes the runner's loop, a batch's
waiting reason, the heartbeat of a claimed chunk, and the step that moves a batch whose every row is recorded to
``finalizing``.

One object (:class:`RunState`) held by both :class:`~miserver.batches.runner.BatchRunner` and
:class:`~miserver.batches.upstream_runs.UpstreamRuns`, so that neither needs the other.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from sqlalchemy.ext.asyncio import AsyncConnection

from ..clock import now, now_ms
from ..errors import APIError
from ..services.inference.context import ServiceContext
from ..settings import Settings
from ..store import Store
from ..store import batches as store_batches
from ..store import rows as store_rows
from ..store.batches import BatchRecord


@dataclass
class RunState:
    """``wake`` asks the runner's loop to look at the batches now; ``on_change(batch_id)`` announces a change of a
    batch (progress events); ``stopping`` turns true once at a graceful stop. ``claim_ttl_ms`` is how long a claim
    lives without a heartbeat (milliseconds)."""

    store: Store
    ctx: ServiceContext
    settings: Settings
    worker_id: str
    on_change: Callable[[str], None]
    wake: Callable[[], None]
    stopping: bool = False
    claim_ttl_ms: int = field(init=False)

    def __post_init__(self) -> None:
        self.claim_ttl_ms = int(self.settings.batch_claim_ttl_seconds * 1000)

    async def set_waiting(self, batch: BatchRecord, reason: str | None, holder: str | None) -> None:
        """Record why ``batch`` (in progress) is not running now (``millm.waiting_reason``; None: it runs) and the
        lease holder it runs under, when either changed."""
        if (batch.waiting_reason, batch.lease_holder) != (reason, holder):
            async with self.store.tx() as conn:
                await store_batches.set_fields(
                    conn, batch.id, ("in_progress",), waiting_reason=reason, lease_holder=holder
                )
            self.on_change(batch.id)

    @contextlib.asynccontextmanager
    async def heartbeat(self, batch_id: str, token: str, lease: str | None) -> AsyncIterator[None]:
        """Every third of the claim TTL while the chunk runs (even within a long row): extend the chunk's claim, and
        renew the lease the batch runs under, so that a chunk longer than the lease's TTL (a slow or loaded machine)
        does not let the lease lapse and another batch take the model between two of this batch's chunks."""

        async def extend() -> None:
            async with self.store.tx() as conn:
                until = now_ms() + self.claim_ttl_ms
                await store_rows.extend_claim(conn, batch_id=batch_id, token=token, until_ms=until)

        async def beat() -> None:
            while True:
                await asyncio.sleep(self.claim_ttl_ms / 3000)
                await self.store.finish(extend())  # the chunk's end cancels the beat; an extend under way completes
                if lease is not None:
                    with contextlib.suppress(APIError):  # released or taken meanwhile: the next pass decides
                        self.ctx.leases.renew(lease)

        task = asyncio.create_task(beat())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def finalize_if_recorded(conn: AsyncConnection, batch_id: str) -> bool:
    """Move the batch (in progress) to ``finalizing`` when every row is recorded (the transition's guard re-checks
    that in the statement itself); False, and nothing changed, while a row is pending."""
    if await store_rows.count_pending(conn, batch_id) > 0:
        return False
    await store_batches.transition(conn, batch_id, ("in_progress",), "finalizing", now())
    return True
