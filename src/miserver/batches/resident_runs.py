"""Chunks of batches on the resident model: claim a chunk of rows (or a packing window), take one admission slot at
batch priority, check that the batch's model is still resident and its weights unchanged, run the rows through the
one row loop (:func:`~miserver.batches.chunks.run_chunk`) under the claim's heartbeat, release the claim, and fold
the chunk into the measured rate (the ETA) and the ``batch.progress`` webhooks. The claim charges its rows to the
batch's fair share in the database, and the release takes back the rows it gives back unrecorded
(:mod:`~miserver.store.fair_share`), so every worker's next plan sees the chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import secrets
import time
from collections.abc import Callable

from ..clock import now, now_ms
from ..scheduling.admission import Priority, Slot
from ..services.accounts import keys as accounts
from ..services.inference.registry import SERVICES
from ..store import fair_share as store_fair
from ..store import operations as store_operations
from ..store import outbox
from ..store import rows as store_rows
from ..store.batches import BatchRecord
from . import chunks, packing
from .readiness import Readiness, weights_block
from .run_state import RunState, finalize_if_recorded


class ResidentRuns:
    """The resident chunks of one runner. ``last_chunk_rows`` and ``last_chunk_seconds``: rows recorded by, and
    seconds of, the last chunk (the batch share reads them).

    A chunk run in the foreground ends at its time bound (``BATCH_CHUNK_SECONDS``): it starts no further row once it
    recorded one, and its rows in flight finish. With ``overlap`` (:meth:`claim_and_run`) the bound hands the
    engine back to the runner's plan instead: the chunk goes on in the background, and the runner plans again. When
    the plan picks the same batch, its next chunk starts beside the running one (its rows queue behind those of the
    first in the engine, so the batch slots stay full across the boundary); before any other batch's chunk starts,
    the background chunk is *closed*, which ends it as its time bound would, and waited for (:meth:`settle`). One
    chunk runs in the background at a time: a second one past its bound closes the first and waits for it."""

    def __init__(self, state: RunState) -> None:
        self.state = state
        self.last_chunk_rows = 0
        self.last_chunk_seconds = 0.0
        #: (batch id, task, closed) of the chunk running in the background past its time bound, or None
        self._draining: tuple[str, asyncio.Task[None], asyncio.Event] | None = None
        #: when the last chunk ended (monotonic seconds): a chunk's measured time starts no earlier
        self._last_end = float("-inf")

    def running(self, batch_id: str) -> bool:
        """Whether a chunk of the batch runs here in the background (its finish waits)."""
        return self._draining is not None and self._draining[0] == batch_id and not self._draining[1].done()

    def background(self) -> str | None:
        """The batch whose chunk runs in the background now, or None."""
        return self._draining[0] if self._draining is not None and not self._draining[1].done() else None

    def closed(self) -> bool:
        """Whether the chunk running in the background (if any) was closed."""
        return self._draining is not None and self._draining[2].is_set()

    def close(self) -> None:
        """Close the chunk running in the background (if any): it starts no further row; its rows in flight finish
        and are recorded."""
        if self._draining is not None:
            self._draining[2].set()

    async def settle(self, keep: str | None = None) -> None:
        """Close the chunk running in the background (if any, and unless it is a running chunk of batch ``keep``)
        and wait until it ended; re-raises what it raised (a store fault, as a chunk run in the foreground does)."""
        if self._draining is None or self.running(keep or ""):
            return
        self.close()
        task = self._draining[1]
        try:
            await task
        finally:
            if self._draining is not None and self._draining[1] is task:
                self._draining = None

    async def claim_and_run(self, batch: BatchRecord, ready: Readiness, *, overlap: bool = False) -> bool:
        """Claim a chunk of ``batch`` (a packing window for a packed batch) and run it; False when none was
        claimable and the batch is not finished (another worker, or a chunk of this one, holds its rows). Returns
        once the chunk ended, or with ``overlap`` once it is past its time bound (it then finishes in the
        background; see the class)."""
        await self.settle(keep=batch.id if overlap else None)
        token = secrets.token_hex(16)
        owner = store_fair.owner_key(batch.owner_key_id, batch.id)
        async with self.state.store.tx() as conn:
            claimed = await store_rows.claim(
                conn,
                batch_id=batch.id,
                limit=packing.claim_limit(self.state.settings, batch),  # a packed batch claims a packing window
                worker=self.state.worker_id,
                token=token,
                now_ms=now_ms(),
                ttl_ms=self.state.claim_ttl_ms,
                skip_locked=self.state.store.skip_locked,
            )
            if claimed:  # ShareNotKept (the batch left in_progress under the plan) rolls the claim back
                await store_fair.charge(conn, owner=owner, batch_id=batch.id, rows=len(claimed))
            elif not await finalize_if_recorded(conn, batch.id):
                return False  # another worker (or this one's finishing chunk) holds the remaining rows
        if not claimed:
            self.state.on_change(batch.id)
            return True
        bound = self.state.settings.batch_chunk_seconds
        # only a packed window goes on past its bound: rows that do not pack keep running one at a time, in file order
        overlap = overlap and packing.packs(batch)
        closed = asyncio.Event()
        run = asyncio.create_task(
            self._run(batch, token, owner, claimed, ready, math.inf if overlap else bound, closed.is_set),
            name=f"miserver-chunk-{batch.id}",
        )
        try:
            if overlap:
                await asyncio.wait({run}, timeout=bound)
                if not run.done():  # past its time bound: on in the background while the runner plans again
                    await self.settle()
                    self._draining = (batch.id, run, closed)
                    run.add_done_callback(lambda _task: self.state.wake())
                    return True
            await run
        except asyncio.CancelledError:
            run.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await run
            raise
        return True

    async def _run(
        self,
        batch: BatchRecord,
        token: str,
        owner: str,
        claimed: list[store_rows.ClaimedRow],
        ready: Readiness,
        time_limit: float,
        closed: Callable[[], bool],
    ) -> None:
        """Run the claimed chunk under a batch slot and its heartbeat, then release the claim (the rows not recorded
        go back to pending, uncharged); it ends at ``time_limit`` seconds or once ``closed()``."""
        try:
            async with (
                self.state.ctx.gate.hold(Priority.BATCH) as slot,
                self.state.heartbeat(batch.id, token, ready.lease),
            ):
                if not self._model_resident(batch):
                    # the model was unloaded or swapped while this chunk waited for the slot: run nothing
                    await self.state.set_waiting(batch, "model_not_resident", None)
                    return
                blocked = weights_block(self.state.ctx, batch)
                if blocked is not None:
                    # a weight write or commit happened while this chunk waited for the slot: run nothing
                    await self.state.set_waiting(batch, blocked, None)
                    return
                await self.state.set_waiting(batch, None, ready.holder)
                started = time.monotonic()
                with accounts.acting_as(accounts.owner_principal(batch.owner_key_id)):
                    report = await self._chunk(batch, token, claimed, slot, ready, time_limit, closed)
                end = time.monotonic()
                seconds = end - max(started, self._last_end)  # a chunk that overlapped the last one counts from its end
                self._last_end = end
                await self._measured(batch, report, seconds)
        finally:
            async with self.state.store.tx() as conn:
                released = await store_rows.release_claim(conn, batch_id=batch.id, token=token)
                if released:
                    await store_fair.give_back(conn, owner=owner, batch_id=batch.id, rows=released)

    async def _chunk(
        self,
        batch: BatchRecord,
        token: str,
        claimed: list[store_rows.ClaimedRow],
        slot: Slot,
        ready: Readiness,
        time_limit: float,
        closed: Callable[[], bool],
    ) -> chunks.ChunkReport:
        """One chunk of ``batch``'s claimed rows through the one row loop, billed to its owner at its prices."""
        return await chunks.run_chunk(
            ctx=self.state.ctx,
            store=self.state.store,
            service=SERVICES[batch.endpoint],
            endpoint=batch.endpoint,
            batch_id=batch.id,
            token=token,
            rows=claimed,
            plan=packing.batch_plan(self.state.settings, batch),
            slot=slot,
            lease=ready.lease,
            time_limit=time_limit,
            stopping=lambda: self.state.stopping,
            on_change=self.state.on_change,
            owner=batch.owner_key_id,
            prices=batch.prices,
            deadline=batch.expires_at,
            closed=closed,
        )

    async def _measured(self, batch: BatchRecord, report: chunks.ChunkReport, seconds: float) -> None:
        """Fold a chunk into the measured rate of its model and endpoint (the ETA's input, persisted), and write the
        batch's ``batch.progress`` webhook events that are due."""
        self.last_chunk_rows, self.last_chunk_seconds = report.recorded, seconds
        if report.recorded == 0:
            return
        async with (
            self.state.store.tx() as conn
        ):  # batch.progress webhooks, at most every MISERVER_WEBHOOK_PROGRESS_SECONDS
            await outbox.enqueue_progress(
                conn,
                batch_id=batch.id,
                owner_key_id=batch.owner_key_id,
                at=now(),
                min_interval=self.state.settings.webhook_progress_seconds,
            )
        if batch.model is None:
            return
        async with self.state.store.tx() as conn:
            await store_operations.record_rate(
                conn,
                model=batch.model,
                endpoint=batch.endpoint,
                rows=report.recorded,
                tokens=report.tokens,
                seconds=seconds,
                at=now(),
            )

    def _model_resident(self, batch: BatchRecord) -> bool:
        engine = self.state.ctx.engine
        return engine is not None and not self.state.ctx.loading and engine.info.model_id == batch.model
