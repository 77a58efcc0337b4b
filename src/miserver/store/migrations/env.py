"""Alembic environment: runs migrations with the synchronous driver given in the config's ``sqlalchemy.url``."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, pool

from miserver.store.schema import metadata

config = context.config


def run_migrations() -> None:
    url = config.get_main_option("sqlalchemy.url")
    if url is None:
        raise RuntimeError("the Alembic config names no sqlalchemy.url (miserver.store.db.alembic_config sets it)")
    engine = create_engine(url, poolclass=pool.NullPool)
    with engine.connect() as connection:
        context.configure(connection=connection, target_metadata=metadata, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


run_migrations()
