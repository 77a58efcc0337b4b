"""Throwaway databases for tests: a SQLite file, or a PostgreSQL database created for the test and dropped after.

PostgreSQL is on 127.0.0.1:5432 with trust auth (``MISERVER_TEST_PG`` overrides the server URL); ``.ci/run`` starts
it when it is down, so a missing server is a test failure, not a skip.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg

PG_SERVER = os.environ.get("MISERVER_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")


@contextmanager
def postgres_database() -> Iterator[str]:
    """Create ``miserver_test_<random>`` and yield its SQLAlchemy URL; drop it (forcing connections off) after."""
    name = f"miserver_test_{secrets.token_hex(6)}"
    with psycopg.connect(PG_SERVER, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base = PG_SERVER.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://", 1)
    try:
        yield f"{base}/{name}"
    finally:
        with psycopg.connect(PG_SERVER, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextmanager
def database(kind: str, tmp_path: Path) -> Iterator[str]:
    """A fresh database URL of ``kind`` (``"sqlite"`` or ``"postgresql"``)."""
    if kind == "sqlite":
        yield f"sqlite:///{tmp_path / 'miserver.db'}"
    elif kind == "postgresql":
        with postgres_database() as url:
            yield url
    else:
        raise ValueError(kind)
