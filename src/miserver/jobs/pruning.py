"""File pruning (DESIGN §6) as its own background task: the bytes of expired files go, their records stay.

A file that a non-terminal batch still reads is never pruned (the store's statement excludes it).
"""

from __future__ import annotations

import asyncio
import logging

from ..clock import now
from ..store import Store
from ..store import files as store_files

log = logging.getLogger("miserver.batches")


async def prune_once(store: Store) -> list[str]:
    """Delete the bytes of every expired file no running batch needs; returns the ids of the files pruned."""
    async with store.tx() as conn:
        pruned = await store_files.prune_expired_content(conn, now())
    if pruned:
        log.info("pruned the content of %d expired files", len(pruned))
    return pruned


async def prune_forever(store: Store, interval_seconds: float) -> None:
    """:func:`prune_once` every ``interval_seconds`` until cancelled; a failed pass is logged and retried later."""
    while True:
        try:
            await prune_once(store)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("pruning expired files failed")
        await asyncio.sleep(interval_seconds)
