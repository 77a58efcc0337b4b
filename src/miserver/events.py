"""Live progress over Socket.IO (python-socketio, path ``/socket.io``): the ``batch:progress`` event.

A client joins a batch's room by emitting ``subscribe`` with ``{"batch_id": ...}`` (the batch id is the capability:
only clients that know it hear of it). The server emits ``batch:progress``
``{id, status, request_counts, millm: {waiting_reason}}`` to that room on every change of status or counts: at once
for changes made by this process, and within ``poll_seconds`` for changes made by other processes (workers sharing
PostgreSQL).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import socketio

from .store import Store
from .store import batches as store_batches

log = logging.getLogger("miserver.events")

EVENT = "batch:progress"


def room(batch_id: str) -> str:
    return f"batch:{batch_id}"


class ProgressEvents:
    """The Socket.IO server and a publisher that coalesces notifications."""

    def __init__(self, store: Store | None = None, *, poll_seconds: float = 1.0) -> None:
        self._store = store
        self.poll_seconds = poll_seconds
        self.sio = socketio.AsyncServer(
            async_mode="asgi", cors_allowed_origins="*", logger=False, engineio_logger=False
        )
        self._pending: set[str] = set()
        self._wake = asyncio.Event()
        self._last: dict[str, dict[str, Any]] = {}
        self._task: asyncio.Task[None] | None = None
        self.sio.on("subscribe", self._subscribe)
        self.sio.on("unsubscribe", self._unsubscribe)

    @property
    def store(self) -> Store:
        if self._store is None:
            raise RuntimeError("ProgressEvents.bind(store) was not called")
        return self._store

    def bind(self, store: Store) -> None:
        """Attach the store (it is opened in the application's lifespan, after the Socket.IO server exists)."""
        self._store = store

    async def _subscribe(self, sid: str, data: Any) -> dict[str, Any]:
        batch_id = data.get("batch_id") if isinstance(data, dict) else None
        if not isinstance(batch_id, str):
            return {"ok": False, "error": "send {\"batch_id\": \"batch_...\"}"}
        async with self.store.tx() as conn:
            batch = await store_batches.get_batch(conn, batch_id)
        if batch is None:
            return {"ok": False, "error": f"no batch {batch_id}"}
        await self.sio.enter_room(sid, room(batch_id))
        payload = self.payload(batch)
        if self._last.get(batch_id) == payload:
            await self.sio.emit(EVENT, payload, to=sid)  # the room has seen it; only the newcomer needs it
        else:
            self._last[batch_id] = payload
            await self.sio.emit(EVENT, payload, room=room(batch_id))
        return {"ok": True}

    async def _unsubscribe(self, sid: str, data: Any) -> None:
        if isinstance(data, dict) and isinstance(data.get("batch_id"), str):
            await self.sio.leave_room(sid, room(data["batch_id"]))

    @staticmethod
    def payload(batch: store_batches.BatchRecord) -> dict[str, Any]:
        return {
            "id": batch.id,
            "status": batch.status,
            "request_counts": {"total": batch.total, "completed": batch.completed, "failed": batch.failed},
            "millm": {"waiting_reason": batch.waiting_reason if batch.status == "in_progress" else None},
        }

    def notify(self, batch_id: str) -> None:
        """Note that ``batch_id`` changed (called by the runner; cheap, never blocks)."""
        self._pending.add(batch_id)
        self._wake.set()

    def _watched(self) -> set[str]:
        rooms = self.sio.manager.rooms.get("/", {})
        return {name.removeprefix("batch:") for name in rooms if isinstance(name, str) and name.startswith("batch:")}

    async def _publish(self, batch_id: str) -> None:
        async with self.store.tx() as conn:
            batch = await store_batches.get_batch(conn, batch_id)
        if batch is None:
            return
        payload = self.payload(batch)
        if self._last.get(batch_id) == payload:
            return
        self._last[batch_id] = payload
        await self.sio.emit(EVENT, payload, room=room(batch_id))

    async def run(self) -> None:
        """Publish notified batches at once and re-check watched ones every ``poll_seconds``."""
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.poll_seconds)
            self._wake.clear()
            watched = self._watched()
            due = watched  # notified batches nobody watches need no event
            self._pending.clear()
            for batch_id in set(self._last) - watched:
                del self._last[batch_id]
            for batch_id in sorted(due):
                try:
                    await self._publish(batch_id)
                except Exception:
                    log.exception("batch %s: progress event failed", batch_id)

    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name="miserver-progress-events")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def asgi(self, app: Any) -> socketio.ASGIApp:
        """Wrap the HTTP application so that ``/socket.io`` is served by this server."""
        return socketio.ASGIApp(self.sio, other_asgi_app=app, socketio_path="socket.io")
