"""The durable store: the only package that speaks SQL (SQLAlchemy 2 Core; SQLite embedded, PostgreSQL in production).

Use :class:`Store` for the engine and transactions; the modules ``files``, ``batches`` and ``rows`` hold the named
statements, each a function of an open connection.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from . import db


class Store:
    """An async engine over one database, with its dialect facts.

    ``Store.open(url)`` applies migrations (Alembic, idempotent) and connects.
    """

    def __init__(self, url: str, engine: AsyncEngine, lock: db.ProcessLock | None = None) -> None:
        self.url = url
        self.engine = engine
        self.is_sqlite = db.is_sqlite(url)
        self._lock = lock

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

    @property
    def skip_locked(self) -> bool:
        """Whether row claims use ``FOR UPDATE SKIP LOCKED`` (PostgreSQL)."""
        return not self.is_sqlite

    async def close(self) -> None:
        await self.engine.dispose()
        if self._lock is not None:
            self._lock.release()
            self._lock = None
