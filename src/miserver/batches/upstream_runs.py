"""Batches whose rows go to upstream pools (gateway mode): chunks that run beside each other.

A batch whose model is served by an upstream pool (a multi-model file whose models are all upstream ones, too) takes
no resident slot, no lease and no residency: its rows pass the pool gates one by one (interactive first there).
Each chunk holds the rows of one pool (claimed by the model the rows name, ``batch_rows.model``), so the pools of a
batch run side by side, each at its own ``max_in_flight``. To keep a pool's ``max_in_flight`` requests really in
flight, the runner keeps two chunks per pool of such a batch running as tasks (:data:`CHUNKS_PER_POOL`): while one
chunk's last rows are in flight, the next chunk's rows already take the freed places (continuous feeding; the engine
never idles while a chunk drains). A chunk records what finished while its previous record ran in one transaction
(``read_ahead``: group commit), so one chunk keeps up with a wide pool. Each chunk is the one row loop
(:func:`~miserver.batches.chunks.run_chunk`) under its own claim, heartbeat and fencing token, so every row is
recorded once. A pool with no live upstream leaves its rows pending (unclaimed) while the rows of live pools behind
them run; the batch waits with ``waiting_reason: upstream_unavailable`` once no row of it can run; at ``expires_at``
no further attempt starts and the runner expires the batch once its chunks have ended (recorded rows stay, the rest
become ``batch_expired``).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time

from ..clock import now, now_ms
from ..services.inference.registry import SERVICES
from ..store import batches as store_batches
from ..store import rows as store_rows
from ..store.batches import BatchRecord
from . import chunks
from .run_state import RunState, finalize_if_recorded

log = logging.getLogger("miserver.batches")

#: Chunks of one upstream batch per pool running at once in one process: one feeds the pool while the other's last
#: rows are in flight. (Each records in groups, so more chunks would only make smaller groups.)
CHUNKS_PER_POOL = 2
#: A chunk claims this many rows per slot of its pool's gate (at least ``BATCH_CHUNK_ROWS``): each claim, its release
#: and the runner's pass after it cost a few statements, shared by the chunk's rows.
ROWS_PER_SLOT = 8
UNAVAILABLE = "upstream_unavailable"


class UpstreamRuns:
    """The upstream chunks of one runner: which batches they serve, and their tasks (each chunk serves one pool)."""

    def __init__(self, state: RunState) -> None:
        self.state = state
        #: the running chunks of each batch, each with the model (pool) whose rows it runs
        self._tasks: dict[str, dict[asyncio.Task[None], str]] = {}
        #: (batch, model): no claim before this monotonic time (a chunk found the pool down)
        self._not_before: dict[tuple[str, str], float] = {}
        #: the models each batch's rows name (fixed once it is validated)
        self._models: dict[str, list[str]] = {}

    def serves(self, batch: BatchRecord) -> bool:
        """Whether ``batch`` runs on upstream pools: its model is an upstream pool's (not the resident one), or
        unknown while some upstream is down (it may serve it once it answers)."""
        ctx = self.state.ctx
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
        for task in [t for t in tasks if t.done()]:
            del tasks[task]
        if not tasks:
            del self._tasks[batch_id]
        return bool(tasks)

    def forget(self, batch_id: str) -> None:
        """Drop what is kept about a finished batch."""
        self._models.pop(batch_id, None)
        for key in [k for k in self._not_before if k[0] == batch_id]:
            del self._not_before[key]

    async def _models_of(self, batch: BatchRecord) -> list[str]:
        models = self._models.get(batch.id)
        if models is None:
            async with self.state.store.read() as conn:
                models = await store_rows.row_models(conn, batch.id)
            self._models[batch.id] = models = models or ([batch.model] if batch.model else [])
        return models

    async def advance(self, batch: BatchRecord) -> bool:
        """Start more chunks of ``batch``: for each model its rows name whose pool is live, one more chunk of that
        pool's rows (claimed by model, lowest line first) while fewer than :data:`CHUNKS_PER_POOL` of that pool run, so
        the rows of a pool that is down wait without holding back those of live pools behind them. Move the batch
        to ``finalizing`` when every row is recorded; mark it ``upstream_unavailable`` only when no row of it runs
        here and none can be claimed (every pending row is of a pool that is down). True when it started or
        finished something."""
        state = self.state
        clock = time.monotonic()
        ready: list[str] = []  # models whose pool is live and was not just found down by a chunk
        started = False
        for model in await self._models_of(batch):
            pool = state.ctx.upstream_pool(model)
            if pool is None or not pool.live or clock < self._not_before.get((batch.id, model), 0.0):
                continue
            ready.append(model)
            if sum(1 for m in self._tasks.get(batch.id, {}).values() if m == model) >= CHUNKS_PER_POOL:
                continue
            limit = max(state.settings.batch_chunk_rows, ROWS_PER_SLOT * pool.gate.slots)
            started |= await self._start(batch, model, limit)
        if self.running(batch.id):
            await state.set_waiting(batch, None, None)
            return started
        async with state.store.tx() as conn:
            finished = await finalize_if_recorded(conn, batch.id)
            runnable = not finished and bool(ready) and await store_rows.count_pending(conn, batch.id, models=ready) > 0
        if finished:
            state.on_change(batch.id)
            return True
        if not runnable:
            await state.set_waiting(batch, UNAVAILABLE, None)
        return False  # else its runnable rows are claimed by another worker

    async def _start(self, batch: BatchRecord, model: str, limit: int) -> bool:
        """Claim up to ``limit`` rows of ``batch`` naming ``model`` and run them as a chunk task; False when none
        was claimable."""
        state = self.state
        token = secrets.token_hex(16)
        async with state.store.tx() as conn:
            claimed = await store_rows.claim(
                conn,
                batch_id=batch.id,
                limit=limit,
                worker=state.worker_id,
                token=token,
                now_ms=now_ms(),
                ttl_ms=state.claim_ttl_ms,
                skip_locked=state.store.skip_locked,
                models=[model],
            )
        if not claimed:
            return False
        task = asyncio.create_task(self._run(batch, model, token, claimed), name=f"miserver-upstream-{batch.id}")
        self._tasks.setdefault(batch.id, {})[task] = model
        return True

    async def _run(self, batch: BatchRecord, model: str, token: str, claimed: list[store_rows.ClaimedRow]) -> None:
        state = self.state
        try:
            async with state.heartbeat(batch.id, token, None):
                report = await chunks.run_chunk(
                    ctx=state.ctx,
                    store=state.store,
                    service=SERVICES[batch.endpoint],
                    endpoint=batch.endpoint,
                    batch_id=batch.id,
                    token=token,
                    rows=claimed,
                    plan=None,
                    slot=None,
                    lease=None,
                    time_limit=float("inf"),  # rows pass the pool gates one by one: nothing is held for long
                    stopping=lambda: state.stopping or now() >= batch.expires_at,
                    on_change=state.on_change,
                    deadline=batch.expires_at,
                    owner=batch.owner_key_id,
                    prices=batch.prices,
                    read_ahead=True,  # rows run concurrently: record what finished meanwhile together
                )
            if report.engine_unavailable:
                # the pool went down under the chunk: its rows wait a poll before they are claimed again (the next
                # step marks the batch upstream_unavailable when no other pool's rows can run)
                self._not_before[(batch.id, model)] = time.monotonic() + state.settings.batch_poll_seconds
        except store_batches.StaleStatus as exc:
            log.info("%s", exc)
        except Exception:
            log.exception("batch %s: upstream chunk failed", batch.id)
        finally:
            try:
                async with state.store.tx() as conn:
                    await store_rows.release_claim(conn, batch_id=batch.id, token=token)
            finally:
                state.wake()

    async def drain(self) -> None:
        """Wait for every running chunk (at a graceful stop they start nothing new and finish what is in flight)."""
        tasks = [t for ts in self._tasks.values() for t in ts]
        await asyncio.gather(*tasks, return_exceptions=True)
