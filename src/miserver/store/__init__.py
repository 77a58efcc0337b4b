"""The durable store: the only package that speaks SQL (SQLAlchemy 2 Core; SQLite embedded, PostgreSQL in production).

:class:`Store` owns the units of work: :meth:`Store.tx` (one transaction), :meth:`Store.read` (reads that write
nothing) and :meth:`Store.file_content` (a file's bytes streamed in short reads). The modules ``files``,
``batches`` and ``rows`` (and the others beside them, such as ``upstreams``: remembered gateway discovery) hold the
named statements, each a function of an open connection. Code outside ``store/`` never touches the engine.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from . import db, files


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

    def file_content(self, file_id: str) -> AsyncIterator[bytes]:
        """The bytes of file ``file_id`` in its stored pieces (1 MiB), one short read per piece: bounded memory and
        no transaction held between pieces (a slow reader never blocks writers). Yields nothing for no such file."""
        return files.iter_content(self.engine, file_id)

    @property
    def skip_locked(self) -> bool:
        """Whether row claims use ``FOR UPDATE SKIP LOCKED`` (PostgreSQL)."""
        return not self.is_sqlite

    async def close(self) -> None:
        """Dispose of the engine's connections and release the SQLite process lock, if held."""
        await self.engine.dispose()
        if self._lock is not None:
            self._lock.release()
            self._lock = None
