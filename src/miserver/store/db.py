"""Database engines, dialect differences and migrations. The only module that knows SQLite from PostgreSQL.

URLs: ``sqlite:///path`` (embedded default, WAL mode, one process) or ``postgresql+psycopg://user@host/db``.
The async driver is picked from the URL (``aiosqlite`` for SQLite, psycopg 3 async for PostgreSQL); Alembic runs
with the synchronous driver of the same database.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.engine.interfaces import DBAPIConnection
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import ConnectionPoolEntry, PoolResetState

MIGRATIONS_DIR = Path(__file__).with_name("migrations")


def sync_url(url: str) -> str:
    """The synchronous driver URL for Alembic: ``sqlite+aiosqlite`` -> ``sqlite``; ``postgresql`` -> psycopg."""
    u = make_url(url)
    if u.get_backend_name() == "sqlite":
        return u.set(drivername="sqlite").render_as_string(hide_password=False)
    if u.get_backend_name() == "postgresql":
        return u.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)
    raise ValueError(f"unsupported database URL {url!r}: use sqlite:///path or postgresql+psycopg://...")


def async_url(url: str) -> str:
    """The asyncio driver URL: ``sqlite`` -> ``sqlite+aiosqlite``; ``postgresql`` -> ``postgresql+psycopg``."""
    u = make_url(sync_url(url))
    if u.get_backend_name() == "sqlite":
        return u.set(drivername="sqlite+aiosqlite").render_as_string(hide_password=False)
    return u.render_as_string(hide_password=False)


def is_sqlite(url: str) -> bool:
    """Whether ``url`` names a SQLite database (any driver)."""
    return make_url(url).get_backend_name() == "sqlite"


def _sqlite_pragmas(dbapi_conn: DBAPIConnection, _record: ConnectionPoolEntry) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.close()


def _sqlite_reset(dbapi_conn: DBAPIConnection, record: ConnectionPoolEntry, state: PoolResetState) -> None:
    """The pool's reset of a SQLite connection given back (SQLAlchemy's custom reset scheme, with
    ``pool_reset_on_return=None``): roll back only a transaction that is still open. SQLAlchemy's default rolls back
    every time, also right after a commit, and each rollback is a round trip to the connection's thread."""
    driver = record.driver_connection  # the aiosqlite connection: in_transaction reads sqlite3's flag, no round trip
    if state.asyncio_safe and not state.transaction_was_reset and (driver is None or driver.in_transaction):
        dbapi_conn.rollback()


def create_engine(url: str) -> AsyncEngine:
    """An async engine for ``url``; SQLite gets WAL, foreign keys and a 30 s busy timeout on every connection."""
    aurl = async_url(url)
    if is_sqlite(url):
        path = make_url(aurl).database
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_async_engine(aurl, connect_args={"timeout": 30}, pool_reset_on_return=None)
        event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
        event.listen(engine.sync_engine, "reset", _sqlite_reset)
        return engine
    return create_async_engine(aurl, pool_size=10, max_overflow=10, pool_pre_ping=True)


def alembic_config(url: str) -> Config:
    """Alembic's configuration for ``url``: this package's migrations, the synchronous driver."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", sync_url(url).replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    """Apply Alembic migrations up to ``revision`` (idempotent). Creates the SQLite file's folder if needed."""
    if is_sqlite(url):
        path = make_url(url).database
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
    command.upgrade(alembic_config(url), revision)


class DatabaseInUseError(RuntimeError):
    """Another process serves this SQLite database (SQLite serves one process; use PostgreSQL for more)."""


class ProcessLock:
    """An exclusive ``flock`` on ``<database>.lock``, held while the process uses the SQLite database.

    The kernel drops it when the process ends, even by ``kill -9``, so a crash never leaves a stale lock.
    """

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.fd = fd

    @classmethod
    def acquire(cls, url: str) -> ProcessLock:
        """Lock the SQLite database of ``url`` for this process; :class:`DatabaseInUseError` when another holds it."""
        database = make_url(url).database or ""
        path = Path(database + ".lock")
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise DatabaseInUseError(
                f"The SQLite database {database} is in use by another miserver process (pid {holder}). SQLite serves "
                "one process: stop the other one, or use PostgreSQL (MISERVER_DATABASE_URL=postgresql+psycopg://...) "
                "to run a server and workers together."
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        return cls(path, fd)

    def release(self) -> None:
        """Unlock and close the lock file (the file itself stays)."""
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
