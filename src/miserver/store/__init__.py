"""The durable store: the only package that speaks SQL (SQLAlchemy 2 Core; SQLite embedded, PostgreSQL in production).

:class:`Store` owns the units of work: :meth:`Store.tx` (one transaction), :meth:`Store.read` (reads that write
nothing) and :meth:`Store.file_content` (a file's bytes streamed in short reads). The modules ``files``,
``batches`` and ``rows`` (and the others beside them, such as ``upstreams``: remembered gateway discovery) hold the
named statements, each a function of an open connection. Code outside ``store/`` never touches the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from . import db, files

T = TypeVar("T")


class Store:
    """An async engine over one database, with its dialect facts.

    ``Store.open(url)`` applies migrations (Alembic, idempotent) and connects.
    """

    def __init__(self, url: str, engine: AsyncEngine, lock: db.ProcessLock | None = None) -> None:
        self.url = url
        #: The async engine: for ``store/`` itself and store tests. Everything else goes through the methods below.
        self.engine = engine
        self.is_sqlite = db.is_sqlite(url)
        self._lock = lock
        #: Set once this process has seen an API key in the database. Keys are never deleted (a revoked key stays),
        #: so it never goes back to False and authentication need not ask again (``services.accounts``).
        self.keys_exist = False
        self._finishing: set[asyncio.Task[Any]] = set()

    @classmethod
    async def open(cls, url: str, *, migrate: bool = True, lock: bool = False) -> Store:
        """Open ``url``. With ``lock``, a SQLite database is locked to this process
        (:class:`~miserver.store.db.DatabaseInUseError` if another process holds it)."""
        import asyncio

        process_lock = db.ProcessLock.acquire(url) if lock and db.is_sqlite(url) else None
        try:
            if migrate:
                await asyncio.to_thread(db.upgrade, url)
            return cls(url, db.create_engine(url), process_lock)
        except BaseException:
            if process_lock is not None:
                process_lock.release()
            raise

    @asynccontextmanager
    async def tx(self) -> AsyncIterator[AsyncConnection]:
        """A connection inside one transaction, committed on exit, rolled back on error."""
        async with self.engine.begin() as conn:
            yield conn

    @asynccontextmanager
    async def read(self) -> AsyncIterator[AsyncConnection]:
        """A connection for reads that write nothing (health, counters); rolled back on exit."""
        async with self.engine.connect() as conn:
            yield conn

    async def finish(self, work: Coroutine[Any, Any, T]) -> T:
        """Run ``work`` (a unit of work on this store) to its end even when the caller is cancelled meanwhile, and
        return its result; a cancelled caller gets ``CancelledError`` at once while ``work`` goes on.

        For store work in code that a cancellation can interrupt: a streamed response whose client disconnects
        (Starlette cancels its task), a heartbeat stopped when its chunk ends. A statement cut by a cancellation
        makes SQLAlchemy invalidate the connection (and, on aiosqlite, leave a closing task that asyncio reports as
        destroyed); a write cut there is lost. :meth:`close` waits for the work still running."""
        task = asyncio.ensure_future(work)
        self._finishing.add(task)
        task.add_done_callback(self._finishing.discard)
        return await asyncio.shield(task)

    async def file_content(self, file_id: str) -> AsyncIterator[bytes]:
        """The bytes of file ``file_id`` in its stored pieces (1 MiB), one short read per piece: bounded memory and
        no transaction held between pieces (a slow reader never blocks writers). Yields nothing for no such file.
        Each read runs to its end (:meth:`finish`) when the reader goes away in the middle (a download cut off)."""
        seq = 0
        while (piece := await self.finish(files.read_piece(self.engine, file_id, seq))) is not None:
            yield piece
            seq += 1

    @property
    def skip_locked(self) -> bool:
        """Whether row claims use ``FOR UPDATE SKIP LOCKED`` (PostgreSQL)."""
        return not self.is_sqlite

    async def close(self) -> None:
        """Wait for the work of :meth:`finish` still running, dispose of the engine's connections and release the
        SQLite process lock, if held."""
        if self._finishing:
            await asyncio.gather(*self._finishing, return_exceptions=True)
        await self.engine.dispose()
        if self._lock is not None:
            self._lock.release()
            self._lock = None
