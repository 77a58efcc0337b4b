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

    def __init__(self, url: str, engine: AsyncEngine) -> None:
        self.url = url
        self.engine = engine
        self.is_sqlite = db.is_sqlite(url)

    @classmethod
    async def open(cls, url: str, *, migrate: bool = True) -> Store:
        if migrate:
            import asyncio

            await asyncio.to_thread(db.upgrade, url)
        return cls(url, db.create_engine(url))

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
