"""Each running batch's ETA, stored where it moved (``millm.estimated_completion_at``)."""

from __future__ import annotations

from collections.abc import Callable

from ..scheduling import policy as scheduling
from ..store import Store
from ..store import operations as store_operations
from ..store.batches import BatchRecord

#: Seconds an ETA must move by before it is written again.
MOVED_SECONDS = 2


async def store_estimates(
    store: Store,
    running: list[BatchRecord],
    decision: scheduling.Decision,
    pending: dict[str, int],
    clock: float,
    on_upstream: Callable[[BatchRecord], bool],
) -> None:
    """Store each running batch's ETA where it moved by :data:`MOVED_SECONDS` or more since it was stored: the
    plan's (the resident engine's measured rate, shared in the plan's order), and for a batch that runs on upstream
    pools (``on_upstream``), which run side by side and do not share that engine, its own rate so far
    (:func:`scheduling.eta_from_progress`). ``pending`` holds each batch's pending rows, ``clock`` is now in Unix
    seconds."""
    changed = []
    for b in running:
        eta = decision.eta.get(b.id)
        if b.id not in decision.waiting and on_upstream(b):
            eta = scheduling.eta_from_progress(
                recorded=b.completed + b.failed, pending=pending.get(b.id, 0), since=b.in_progress_at, now=clock
            )
        new = int(eta) if eta is not None else None
        old = b.estimated_completion_at
        if (new is None) != (old is None) or (new is not None and old is not None and abs(new - old) >= MOVED_SECONDS):
            changed.append((b.id, new))
    if changed:
        async with store.tx() as conn:
            for batch_id, value in changed:
                await store_operations.set_estimate(conn, batch_id, value)
