"""Chunks of batches on the resident model: claim a chunk of rows (or a packing window), take one admission slot at
batch priority, check that the batch's model is still resident and its weights unchanged, run the rows through the
one row loop (:func:`~miserver.batches.chunks.run_chunk`) under the claim's heartbeat, release the claim, and fold
the chunk into the measured rate (the ETA) and the ``batch.progress`` webhooks. The claim charges its rows to the
batch's fair share in the database, and the release takes back the rows it gives back unrecorded
(:mod:`~miserver.store.fair_share`), so every worker's next plan sees the chunk.
"""

from __future__ import annotations

import secrets
import time

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
    seconds of, the last chunk (the batch share reads them)."""

    def __init__(self, state: RunState) -> None:
        self.state = state
        self.last_chunk_rows = 0
        self.last_chunk_seconds = 0.0

    async def claim_and_run(self, batch: BatchRecord, ready: Readiness) -> bool:
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
                return False  # another worker holds the remaining rows
        if not claimed:
            self.state.on_change(batch.id)
            return True
        try:
            async with (
                self.state.ctx.gate.hold(Priority.BATCH) as slot,
                self.state.heartbeat(batch.id, token, ready.lease),
            ):
                if not self._model_resident(batch):
                    # the model was unloaded or swapped while this chunk waited for the slot: run nothing
                    await self.state.set_waiting(batch, "model_not_resident", None)
                    return True
                blocked = weights_block(self.state.ctx, batch)
                if blocked is not None:
                    # a weight write or commit happened while this chunk waited for the slot: run nothing
                    await self.state.set_waiting(batch, blocked, None)
                    return True
                await self.state.set_waiting(batch, None, ready.holder)
                started = time.monotonic()
                with accounts.acting_as(accounts.owner_principal(batch.owner_key_id)):
                    report = await self._chunk(batch, token, claimed, slot, ready)
                await self._measured(batch, report, time.monotonic() - started)
        finally:
            async with self.state.store.tx() as conn:
                released = await store_rows.release_claim(conn, batch_id=batch.id, token=token)
                if released:
                    await store_fair.give_back(conn, owner=owner, batch_id=batch.id, rows=released)
        return True

    async def _chunk(
        self, batch: BatchRecord, token: str, claimed: list[store_rows.ClaimedRow], slot: Slot, ready: Readiness
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
            time_limit=self.state.settings.batch_chunk_seconds,
            stopping=lambda: self.state.stopping,
            on_change=self.state.on_change,
            owner=batch.owner_key_id,
            prices=batch.prices,
            deadline=batch.expires_at,
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
