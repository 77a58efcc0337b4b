"""Whether a batch may run its next chunk now, and if not why (``millm.waiting_reason``, DESIGN §4).

A batch never loads, unloads or swaps a model: it waits. It runs only when its model is the resident one, the
resident weights are whole, and it holds the model lease: its own (holder ``millm-batch:<id>``, taken and renewed
here) or the live lease its caller handed it (renewed here, never released).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..model_lease import BATCH_HOLDER_PREFIX, LeaseManager, shown_holder
from ..services.inference.context import ServiceContext
from ..store.batches import BatchRecord


@dataclass(frozen=True)
class Readiness:
    """``waiting_reason`` is None when the batch may run; ``holder`` names the lease it runs under."""

    waiting_reason: str | None
    holder: str | None = None
    lease: str | None = None


def own_holder(batch_id: str) -> str:
    return BATCH_HOLDER_PREFIX + batch_id


def readiness(
    ctx: ServiceContext, batch: BatchRecord, *, weights_torn: bool, lease_ttl_seconds: float, take_over: bool = False
) -> Readiness:
    """Decide, and take or renew the lease when the batch may run.

    Waiting reasons: ``model_not_resident`` (no engine, or another model is resident), ``weights_torn`` (a weight
    write is open, or a crash left one open), ``weights_changed`` (the batch is pinned to a weights revision that is
    not the resident one),
    ``queued`` (another batch holds the lease: its turn comes after), ``lease_unavailable`` (another holder).
    With ``take_over`` (the scheduler picked this batch: batches share the engine chunk by chunk) the batch takes
    the lease from another batch that holds its own between chunks; never a caller's or another holder's lease.
    """
    engine = ctx.engine
    if engine is None or engine.info.model_id != batch.model:
        return Readiness("model_not_resident")
    if weights_torn:  # the persisted flag (a write open here, or left open by a crash; shared by workers)
        return Readiness("weights_torn")
    if batch.weights_revision is not None and engine.info.weights_revision != batch.weights_revision:
        return Readiness("weights_changed")
    leases: LeaseManager = ctx.leases
    live = leases.current()
    if live is not None and batch.caller_lease is not None and live.lease == batch.caller_lease:
        renewed = leases.renew(live.lease)
        return Readiness(None, renewed.holder, renewed.lease)
    own = own_holder(batch.id)
    if live is None or live.holder == own:
        lease = leases.acquire(own, lease_ttl_seconds, batch.owner_key_id)
        return Readiness(None, lease.holder, lease.lease)
    if live.holder.startswith(BATCH_HOLDER_PREFIX):
        if take_over:
            leases.release(live.lease)
            lease = leases.acquire(own, lease_ttl_seconds, batch.owner_key_id)
            return Readiness(None, lease.holder, lease.lease)
        return Readiness("queued")
    return Readiness("lease_unavailable")


def weights_block(ctx: ServiceContext, batch: BatchRecord) -> str | None:
    """``weights_changed`` when the batch is pinned to a weights revision that is no longer resident, checked again
    once a chunk holds the admission slot (a weight commit may have happened while it waited; a write is never open
    then, since ``begin`` holds the slot until its commit or abort), else None."""
    engine = ctx.engine
    if engine is not None and batch.weights_revision not in (None, engine.info.weights_revision):
        return "weights_changed"
    return None


def release_own_lease(ctx: ServiceContext, batch_id: str) -> None:
    """Release the batch's own lease if it holds it (a caller's lease is never released by the batch)."""
    live = ctx.leases.current()
    if live is not None and live.holder == own_holder(batch_id):
        ctx.leases.release(live.lease)


def foreign_lease_holder(ctx: ServiceContext, batch: BatchRecord) -> str | None:
    """The holder of a live lease that is neither a batch's nor the one this batch's caller handed it, as the
    batch's owner may read it (another tenant's holder is a neutral word, :func:`shown_holder`)."""
    live = ctx.leases.current()
    if live is None or live.holder.startswith(BATCH_HOLDER_PREFIX) or live.lease == batch.caller_lease:
        return None
    return shown_holder(live, batch.owner_key_id)


def release_lease_of_finished(ctx: ServiceContext, active: set[str]) -> None:
    """Release a batch's own lease when that batch is no longer active (another process finished it: with several
    workers, each holds its own lease of its resident model, and only the finishing one releases at the finish)."""
    live = ctx.leases.current()
    if (
        live is not None
        and live.holder.startswith(BATCH_HOLDER_PREFIX)
        and live.holder.removeprefix(BATCH_HOLDER_PREFIX) not in active
    ):
        ctx.leases.release(live.lease)
