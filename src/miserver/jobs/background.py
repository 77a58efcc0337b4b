"""The background jobs of a serving process (``miserver serve`` and ``miserver worker``), started and stopped by
the runtime beside the batch runner: file pruning (every ``FILE_PRUNE_INTERVAL_SECONDS``) and webhook delivery
(every ``BATCH_POLL_SECONDS``), each its own task."""

from __future__ import annotations

import asyncio

from ..settings import Settings
from ..store import Store
from . import pruning
from . import webhook_delivery as delivery


class BackgroundJobs:
    """The two jobs' tasks. :meth:`start` once; :meth:`stop` lets a delivery under way end, then cancels both."""

    def __init__(self, store: Store, settings: Settings, *, worker_id: str) -> None:
        self.store = store
        self.settings = settings
        self.worker_id = worker_id
        self._stopping = False
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        """Start pruning and delivery (on the running loop)."""
        self._tasks = [
            asyncio.create_task(
                pruning.prune_forever(self.store, self.settings.file_prune_interval_seconds),
                name="miserver-file-pruning",
            ),
            asyncio.create_task(
                delivery.deliver_forever(
                    self.store, self.settings, worker=self.worker_id, stopping=lambda: self._stopping
                ),
                name="miserver-webhook-delivery",
            ),
        ]

    async def stop(self) -> None:
        """Stop both jobs and wait for their tasks to end."""
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    async def prune(self) -> list[str]:
        """Prune expired files now (DESIGN §6); returns the file ids (:func:`~miserver.jobs.pruning.prune_once`)."""
        return await pruning.prune_once(self.store)
