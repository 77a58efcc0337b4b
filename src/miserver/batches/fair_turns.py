"""Fair share as every worker on one database counts it: the stored counts (:mod:`~miserver.store.fair_share`)
turned into the scheduling policy's :class:`~miserver.scheduling.policy.FairShare`, newcomers admitted once for
the whole fleet."""

from __future__ import annotations

from ..clock import now_ms
from ..scheduling import policy as scheduling
from ..store import Store
from ..store import fair_share as store_fair


async def shared_counts(
    store: Store, candidates: list[scheduling.Candidate], *, worker_id: str, credit_rows: int
) -> scheduling.FairShare:
    """The shared counts, with the newcomers among ``candidates`` admitted and the entries of owners and batches no
    longer ``in_progress`` dropped. A newcomer's head start over the least-served owner is ``credit_rows`` for each
    worker running chunks now (``worker_id`` and those holding claims): two chunks of the whole fleet's time, as one
    runner gives two of its engine's. A newcomer that another worker admitted first keeps that worker's count."""
    async with store.tx() as conn:
        await store_fair.forget_departed(conn)
        workers = await store_fair.claiming_workers(conn, now_ms=now_ms()) | {worker_id}
        credit = credit_rows * len(workers)
        fair = _fair_of(await store_fair.read(conn), credit)
        new = fair.admit(candidates)
        if new.owners or new.batches:
            written = await store_fair.admit(
                conn,
                owners={k: int(v) for k, v in new.owners.items()},
                batches={k: int(v) for k, v in new.batches.items()},
            )
            if written < len(new.owners) + len(new.batches):  # another worker was first: read its counts
                fair = _fair_of(await store_fair.read(conn), credit)
    return fair


def _fair_of(stored: store_fair.Shares, credit_rows: int) -> scheduling.FairShare:
    return scheduling.FairShare(
        credit_rows=credit_rows,
        owners={k: float(v) for k, v in stored.owners.items()},
        batches={k: float(v) for k, v in stored.batches.items()},
    )
