"""The Alembic migrations build exactly the schema that ``store/schema.py`` declares, on SQLite and PostgreSQL."""

from __future__ import annotations

import re
from typing import Any

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import CheckConstraint, Connection, create_engine, inspect, text

from miserver.store.db import sync_url, upgrade
from miserver.store.schema import metadata


def _normalise(sql: str) -> str:
    return re.sub(r"\s+", " ", sql).strip().lower()


def _autogenerate_diffs(conn: Connection) -> list[Any]:
    """Tables, columns (types, nullability, server defaults), indexes, unique constraints and foreign keys."""
    context = MigrationContext.configure(conn, opts={"compare_type": True, "compare_server_default": True})
    return [
        diff
        for diff in compare_metadata(context, metadata)
        if not (diff[0] == "remove_table" and diff[1].name == "alembic_version")
    ]


def _check_constraints(conn: Connection) -> None:
    """Autogenerate does not compare CHECKs: their names everywhere, their text where the database keeps it as
    written (SQLite; PostgreSQL rewrites it into a canonical form of its own)."""
    inspector = inspect(conn)
    for table in metadata.sorted_tables:
        declared = {
            str(c.name): _normalise(str(c.sqltext)) for c in table.constraints if isinstance(c, CheckConstraint)
        }
        built = {str(c["name"]): _normalise(c["sqltext"]) for c in inspector.get_check_constraints(table.name)}
        assert set(built) == set(declared), f"CHECK constraints of {table.name}"
        if conn.dialect.name == "sqlite":
            assert built == declared, f"CHECK constraints of {table.name}"


def _partial_indexes(conn: Connection) -> None:
    """Autogenerate does not compare a partial index's WHERE: present on both sides, and the same text on SQLite."""
    dialect = conn.dialect.name
    inspector = inspect(conn)
    for table in metadata.sorted_tables:
        indexes = inspector.get_indexes(table.name)
        built = {ix["name"]: ix.get("dialect_options", {}).get(f"{dialect}_where") for ix in indexes}
        for index in table.indexes:
            where = index.dialect_kwargs.get(f"{dialect}_where")
            assert (built[index.name] is None) == (where is None), f"WHERE of index {index.name}"
            if where is not None and dialect == "sqlite":
                declared = where.compile(
                    dialect=conn.dialect, compile_kwargs={"literal_binds": True, "include_table": False}
                )
                assert _normalise(str(built[index.name])) == _normalise(str(declared)), f"WHERE of index {index.name}"


def test_migrations_at_head_build_the_declared_schema(database_url: str) -> None:
    upgrade(database_url)
    engine = create_engine(sync_url(database_url))
    try:
        with engine.connect() as conn:
            diffs = _autogenerate_diffs(conn)
            assert diffs == [], f"the migrations and store/schema.py differ: {diffs}"
            _check_constraints(conn)
            _partial_indexes(conn)
    finally:
        engine.dispose()


def test_0008_gives_rows_still_to_run_their_batchs_model(database_url: str) -> None:
    """Rows validated before rows named their model: the pending ones take their batch's (so a claim by model still
    finds them); recorded and invalid rows keep none."""
    upgrade(database_url, "0007")
    engine = create_engine(sync_url(database_url))
    try:
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO files (id, purpose, filename, bytes, created_at) VALUES ('file-1', 'batch', 'a', 1, 1)"
                )
            )
            conn.execute(
                text(
                    "INSERT INTO batches (id, endpoint, input_file_id, completion_window, status, created_at, "
                    "expires_at, model) VALUES ('batch_1', '/v1/chat/completions', 'file-1', '24h', 'in_progress', 1, "
                    "86401, 'm')"
                )
            )
            conn.execute(
                text(
                    "INSERT INTO batch_rows (batch_id, line, custom_id, valid, body, state, outcome, result) VALUES "
                    "('batch_1', 1, 'a', :yes, '{}', 'done', 'ok', '{}'), "
                    "('batch_1', 2, 'b', :yes, '{}', 'pending', NULL, NULL), "
                    "('batch_1', 3, NULL, :no, NULL, 'done', 'error', '{}')"
                ),
                {"yes": True, "no": False},
            )
        upgrade(database_url)
        with engine.connect() as conn:
            models = conn.execute(text("SELECT line, model FROM batch_rows ORDER BY line")).all()
        assert [tuple(r) for r in models] == [(1, None), (2, "m"), (3, None)]
    finally:
        engine.dispose()
