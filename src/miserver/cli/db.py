"""``miserver db``: database administration."""

from __future__ import annotations

from pathlib import Path

import click

from ..settings import Settings
from .base import main


@main.group()
def db() -> None:
    """Database administration."""


@db.command("upgrade")
@click.option(
    "--database-url", envvar="MISERVER_DATABASE_URL", show_envvar=True, default=None, help="SQLite or PostgreSQL URL."
)
@click.option(
    "--data-dir", envvar="MISERVER_DATA_DIR", show_envvar=True, default="./var", show_default=True, type=click.Path()
)
def db_upgrade(database_url: str | None, data_dir: str) -> None:
    """Apply the schema migrations (serve does this at start too).

    \b
    Example:
      miserver db upgrade --database-url postgresql+psycopg://postgres@127.0.0.1/test
    """
    from sqlalchemy.exc import OperationalError

    from ..store.db import upgrade

    settings = Settings(data_dir=Path(data_dir), database_url=database_url)
    try:
        upgrade(settings.resolved_database_url())
    except OperationalError as exc:
        raise cannot_open(exc) from None
    click.echo("database at head")


def cannot_open(exc: Exception) -> click.ClickException:
    """The one-line error for a database that cannot be opened (SQLAlchemy's ``OperationalError``)."""
    orig = getattr(exc, "orig", None)
    reason = str(orig if orig is not None else exc).strip().splitlines()[-1]
    return click.ClickException(
        f"cannot open the database: {reason} (a PostgreSQL database must exist first: createdb NAME)"
    )


def check_reachable(url: str) -> None:
    """Open the PostgreSQL database at ``url`` once (SQLite opens its file as it starts); raises
    :func:`cannot_open`'s error when it cannot."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.exc import OperationalError

    from ..store.db import is_sqlite

    if is_sqlite(url):
        return
    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            connection.execute(text("SELECT 1"))
    except OperationalError as exc:
        raise cannot_open(exc) from None
    finally:
        engine.dispose()
