"""Live progress over Socket.IO (python-socketio, path ``/socket.io``): the ``batch:progress`` event.

A client joins a batch's room by emitting ``subscribe`` with ``{"batch_id": ...}``. Once the database holds API keys
a client connects with one (Socket.IO ``auth={"api_key": "sk-..."}``, or an ``Authorization: Bearer`` header) and
may subscribe only to its own key's batches (an admin key: to any); another key's batch answers "no batch", as the
HTTP routes answer 404, so its events never reach the client. A subscribe needs the scope that reading the batch over
HTTP needs (``batches``; the answer names it, as the API's 403 ``insufficient_scope`` does), and the key is re-read
at each subscribe, so a key revoked since the connection hears nothing more. The server emits ``batch:progress``
``{id, status, request_counts, millm: {waiting_reason}}`` to that room on every change of status or counts: at once
for changes made by this process, and within ``poll_seconds`` for changes made by other processes (workers sharing
PostgreSQL).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import socketio

from .errors import APIError
from .services.accounts import keys as accounts
from .services.accounts.scopes import check_scopes, needed_scopes
from .store import Store
from .store import batches as store_batches

log = logging.getLogger("miserver.events")

EVENT = "batch:progress"
#: The event of a model load's progress (``services/model_life/residency.py``).
MODEL_LOADING = "model:loading"
#: The API route whose scopes a client needs to subscribe to a batch's events (reading the batch: ``batches``).
SUBSCRIBE_TWIN = ("GET", "/v1/batches/{batch_id}")


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
        self._emits: set[asyncio.Task[None]] = set()
        #: the web console's sign-in (a ``Cookie`` header -> its session's caller, None without one): a browser
        #: connects with its HttpOnly session cookie instead of a key
        self.cookie_principal: Callable[[str], Awaitable[accounts.Principal | None]] | None = None
        self.sio.on("connect", self._connect)
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

    async def _connect(self, sid: str, environ: dict[str, Any], auth: Any = None) -> None:
        """Authenticate the client (its key from ``auth.api_key`` or the ``Authorization`` header) and keep who it
        is in its session; a missing, unknown or revoked key while keys exist refuses the connection."""
        key = auth.get("api_key") if isinstance(auth, dict) and isinstance(auth.get("api_key"), str) else None
        if key is None:
            scheme, _, value = str(environ.get("HTTP_AUTHORIZATION", "")).partition(" ")
            key = value.strip() if scheme.lower() == "bearer" and value.strip() else None
        cookie = str(environ.get("HTTP_COOKIE", ""))
        if key is None and cookie and self.cookie_principal is not None:
            from_cookie = await self.cookie_principal(cookie)
            if from_cookie is not None:
                await self.sio.save_session(sid, {"principal": from_cookie})
                return
        try:
            principal = await accounts.principal_for(self.store, key)
        except APIError as exc:
            raise socketio.exceptions.ConnectionRefusedError(exc.message) from None
        await self.sio.save_session(sid, {"principal": principal})

    async def _principal(self, sid: str) -> accounts.Principal:
        session = await self.sio.get_session(sid)
        principal = session.get("principal") if isinstance(session, dict) else None
        return principal if isinstance(principal, accounts.Principal) else accounts.SYSTEM

    async def _subscribe(self, sid: str, data: Any) -> dict[str, Any]:
        """Join the room of ``{"batch_id"}`` -> ``{"ok": true}``, or ``{"ok": false, "error"}`` (with ``"code":
        "insufficient_scope"`` for a key without the scope that reading the batch over HTTP needs)."""
        batch_id = data.get("batch_id") if isinstance(data, dict) else None
        if not isinstance(batch_id, str):
            return {"ok": False, "error": 'send {"batch_id": "batch_..."}'}
        principal = await self._principal(sid)
        if principal.key_id is not None:  # the key as it is now: revoked since the connection, it hears nothing
            now = await accounts.principal_by_id(self.store, principal.key_id)
            if now is None:
                return {"ok": False, "error": "The API key of this connection is revoked.", "code": "invalid_api_key"}
            principal = now
        try:
            check_scopes(principal.scopes, needed_scopes(*SUBSCRIBE_TWIN, {}))
        except APIError as exc:
            return {"ok": False, "error": exc.message, "code": exc.code}
        async with self.store.tx() as conn:
            batch = await store_batches.get_batch(conn, batch_id)
        scope = principal.scope
        if batch is None or (scope is not None and batch.owner_key_id != scope):
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

    def model_loading(self, payload: dict[str, Any]) -> None:
        """Broadcast ``model:loading`` (``{model, stage: "loading" | "loaded" | "failed", ...}``) to every
        connected client: a load's progress (called from the event loop; never blocks)."""
        task = asyncio.get_running_loop().create_task(self.sio.emit(MODEL_LOADING, payload))
        self._emits.add(task)
        task.add_done_callback(self._emits.discard)

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
