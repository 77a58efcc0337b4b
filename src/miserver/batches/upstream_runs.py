"""Batches whose rows go to upstream pools (gateway mode, issue 12): chunks that run beside each other.

A batch whose model is served by an upstream pool (a multi-model file whose models are all upstream ones, too) takes
no resident slot, no lease and no residency: its rows pass the pool gates one by one (interactive first there).
To keep a pool's ``max_in_flight`` requests really in flight, the runner keeps several chunks of such a batch
running as tasks (:func:`chunks_for`): while one chunk's last rows are in flight, the next chunk's rows already
take the freed places (continuous feeding; the engine never idles while a chunk drains). Each chunk is the one row
loop (:func:`~miserver.batches.chunks.run_chunk`) under its own claim, heartbeat and fencing token, so every row is
recorded once. A pool with no live upstream leaves its rows pending and the batch waits with ``waiting_reason:
upstream_unavailable``; at ``expires_at`` no further attempt starts and the runner expires the batch once its chunks
have ended (recorded rows stay, the rest become ``batch_expired``).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import TYPE_CHECKING

from ..ids import now, now_ms
from ..services.registry import SERVICES
from ..store import batches as store_batches
from ..store import rows as store_rows
from ..store.batches import BatchRecord
from . import chunks

if TYPE_CHECKING:
    from .runner import BatchRunner

log = logging.getLogger("miserver.batches")

#: Chunks of one upstream batch running at once in one process: one per this many slots of its pool's gate (at
#: least 2, at most :data:`MAX_CHUNKS`). Each chunk records its rows one transaction after another, so on a loaded
#: machine one chunk records about 20-50 rows/s; several chunks record side by side (measured: bench/gateway.py).
SLOTS_PER_CHUNK = 2
MAX_CHUNKS = 8
#: A chunk claims this many rows per slot of its pool's gate (at least ``BATCH_CHUNK_ROWS``).
ROWS_PER_SLOT = 2
UNAVAILABLE = "upstream_unavailable"


def chunks_for(slots: int) -> int:
    """Chunks of one batch kept running for a pool gate of ``slots`` slots."""
    return min(MAX_CHUNKS, max(2, slots // SLOTS_PER_CHUNK))


class UpstreamRuns:
    """The upstream chunks of one runner: which batches they serve, and their tasks."""

    def __init__(self, runner: BatchRunner) -> None:
        self.runner = runner
        self._tasks: dict[str, set[asyncio.Task[None]]] = {}
        self._not_before: dict[str, float] = {}

    def serves(self, batch: BatchRecord) -> bool:
        """Whether ``batch`` runs on upstream pools: its model is an upstream pool's (not the resident one), or
        unknown while some upstream is down (it may serve it once it answers)."""
        ctx = self.runner.ctx
        if ctx.gateway is None or batch.model is None:
            return False
        if ctx.upstream_pool(batch.model) is not None:
            return True
        resident = ctx.engine is not None and ctx.engine.info.model_id == batch.model
        return not resident and not ctx.gateway.all_live

    def running(self, batch_id: str) -> bool:
        """Whether chunks of the batch run here now (its finish waits for them)."""
        tasks = self._tasks.get(batch_id)
        if tasks is None:
            return False
        tasks -= {t for t in tasks if t.done()}
        if not tasks:
            del self._tasks[batch_id]
        return bool(tasks)

    async def advance(self, batch: BatchRecord) -> bool:
        """Start one more chunk of ``batch`` when its pool is live and fewer than :func:`chunks_for` run;
        move it to ``finalizing`` when every row is recorded. True when it started or finished something."""
        runner = self.runner
        pool = runner.ctx.upstream_pool(batch.model)
        live = self.running(batch.id)
        if pool is None or not pool.live:
            if not live:
                await runner._set_waiting(batch, UNAVAILABLE, None)
            return False
        if time.monotonic() < self._not_before.get(batch.id, 0.0):
            return False  # its last chunk found a pool of the file down: wait a poll before claiming again
        if live and len(self._tasks[batch.id]) >= chunks_for(pool.gate.slots):
            return False
        token = secrets.token_hex(16)
        limit = max(runner.settings.batch_chunk_rows, ROWS_PER_SLOT * pool.gate.slots)
        async with runner.store.tx() as conn:
            claimed = await store_rows.claim(
                conn,
                batch_id=batch.id,
                limit=limit,
                worker=runner.worker_id,
                token=token,
                now_ms=now_ms(),
                ttl_ms=runner.claim_ttl_ms,
                skip_locked=runner.store.skip_locked,
            )
            if not claimed:
                if live or await store_rows.count_pending(conn, batch.id) > 0:
                    return False  # rows are claimed here or by another worker
                await store_batches.transition(conn, batch.id, ("in_progress",), "finalizing", now())
        if not claimed:
            runner.on_change(batch.id)
            return True
        await runner._set_waiting(batch, None, None)
        task = asyncio.create_task(self._run(batch, token, claimed), name=f"miserver-upstream-{batch.id}")
        self._tasks.setdefault(batch.id, set()).add(task)
        return True

    async def _run(self, batch: BatchRecord, token: str, claimed: list[store_rows.ClaimedRow]) -> None:
        runner = self.runner
        try:
            async with runner._heartbeat(batch.id, token, None):
                report = await chunks.run_chunk(
                    ctx=runner.ctx,
                    store=runner.store,
                    service=SERVICES[batch.endpoint],
                    endpoint=batch.endpoint,
                    batch_id=batch.id,
                    token=token,
                    rows=claimed,
                    plan=None,
                    slot=None,
                    lease=None,
                    time_limit=float("inf"),  # rows pass the pool gates one by one: nothing is held for long
                    stopping=lambda: runner._stopping or now() >= batch.expires_at,
                    on_change=runner.on_change,
                    deadline=batch.expires_at,
                    yield_to_interactive=False,
                    owner=batch.owner_key_id,
                    prices=batch.prices,
                )
            if report.engine_unavailable:
                self._not_before[batch.id] = time.monotonic() + runner.settings.batch_poll_seconds
                async with runner.store.tx() as conn:
                    await store_batches.set_fields(conn, batch.id, ("in_progress",), waiting_reason=UNAVAILABLE)
                runner.on_change(batch.id)
        except store_batches.StaleStatus as exc:
            log.info("%s", exc)
        except Exception:
            log.exception("batch %s: upstream chunk failed", batch.id)
        finally:
            try:
                async with runner.store.tx() as conn:
                    await store_rows.release_claim(conn, batch_id=batch.id, token=token)
            finally:
                runner.wake()

    async def drain(self) -> None:
        """Wait for every running chunk (at a graceful stop they start nothing new and finish what is in flight)."""
        tasks = [t for ts in self._tasks.values() for t in ts]
        await asyncio.gather(*tasks, return_exceptions=True)
