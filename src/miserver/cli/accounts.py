"""``miserver keys`` and ``miserver usage``: API keys and usage, straight on the database."""

from __future__ import annotations

from typing import Any

import click

from ..protocol.accounts import SCOPES
from .base import _on_store, main, table

_db_url = click.option(
    "--database-url",
    envvar="MISERVER_DATABASE_URL",
    show_envvar=True,
    default=None,
    help="SQLite or PostgreSQL URL (the server's).",
)
_db_dir = click.option(
    "--data-dir", envvar="MISERVER_DATA_DIR", show_envvar=True, default="./var", show_default=True, type=click.Path()
)


def _money(value: int | None) -> str:
    return "unlimited" if value is None else f"{value / 1_000_000:.6f}"


@main.group()
def keys() -> None:
    """API keys: create, list, revoke, top up (on the database directly, so the first admin key can be made
    before the server starts). Money is in micro-units of the price table's currency (1 unit = 1000000)."""


@keys.command("create")
@click.option("--name", required=True, help="A name to recognise the key by.")
@click.option("--admin", is_flag=True, help="An admin key (keys, everyone's usage, model life).")
@click.option("--balance", type=int, default=None, help="Opening balance in micro-units (default: unlimited).")
@click.option("--max-pending-batches", type=int, default=None, help="Queue quota: batches not yet finished.")
@click.option("--max-enqueued-tokens", type=int, default=None, help="Queue quota: input tokens in those batches.")
@click.option(
    "--scope",
    "scopes",
    multiple=True,
    type=click.Choice(SCOPES),
    help="A scope the key may use (repeat for several; none: inference, batches, files).",
)
@_db_url
@_db_dir
def keys_create(
    name: str,
    admin: bool,
    balance: int | None,
    max_pending_batches: int | None,
    max_enqueued_tokens: int | None,
    scopes: tuple[str, ...],
    database_url: str | None,
    data_dir: str,
) -> None:
    """Create a key and print it once (only its SHA-256 digest is stored).

    \b
    Example:
      miserver keys create --name admin --admin
      miserver keys create --name team-a --balance 5000000 --max-pending-batches 3
      miserver keys create --name deployer --scope inference --scope models:write
    """
    from ..services.accounts import keys as accounts

    body: dict[str, Any] = {"name": name, "admin": admin, "balance": balance}
    body.update(max_pending_batches=max_pending_batches, max_enqueued_tokens=max_enqueued_tokens)
    if scopes:
        body["scopes"] = list(scopes)
    from ..errors import APIError

    try:
        spec = accounts.KeySpec.parse(body)
    except APIError as exc:
        raise click.ClickException(exc.message) from None
    record, key = _on_store(database_url, data_dir, lambda store: accounts.create_key(store, spec))
    click.echo(f"{key}")
    shown = ",".join(s for s in SCOPES if s in accounts.scopes_of(record))
    click.echo(
        f"id {record.id}  name {record.name}  admin {record.admin}  scopes {shown}  balance {_money(record.balance)}",
        err=True,
    )
    click.echo("Keep the key now: it is not stored and cannot be shown again.", err=True)


@keys.command("list")
@_db_url
@_db_dir
def keys_list(database_url: str | None, data_dir: str) -> None:
    """List the keys (prefix, name, admin, scopes, balance, quotas, revoked), never the keys themselves.

    \b
    Example:
      miserver keys list
    """
    from ..services.accounts import keys as accounts

    records = _on_store(database_url, data_dir, accounts.list_keys)
    rows = [
        (
            r.id,
            r.prefix,
            r.name,
            str(r.admin),
            ",".join(s for s in SCOPES if s in accounts.scopes_of(r)),
            _money(r.balance),
            f"{r.max_pending_batches or '-'}b/{r.max_enqueued_tokens or '-'}t",
            str(r.revoked_at) if r.revoked_at else "-",
        )
        for r in records
    ]
    header = ("id", "prefix", "name", "admin", "scopes", "balance", "quotas", "revoked")
    for text in table(header, rows, right={5}):
        click.echo(text)


@keys.command("revoke")
@click.argument("key_id")
@_db_url
@_db_dir
def keys_revoke(key_id: str, database_url: str | None, data_dir: str) -> None:
    """Revoke a key: its requests get 401 and its running batches end failed (key_revoked).

    \b
    Example:
      miserver keys revoke key_0192f3a4b5c6d7e8f9a0b1c2
    """
    from ..services.accounts import keys as accounts

    record = _on_store(database_url, data_dir, lambda store: accounts.revoke_key(store, key_id))
    click.echo(f"revoked {record.id} ({record.name})")


@keys.command("top-up")
@click.argument("key_id")
@click.argument("amount", type=int)
@_db_url
@_db_dir
def keys_top_up(key_id: str, amount: int, database_url: str | None, data_dir: str) -> None:
    """Add AMOUNT micro-units to a key's balance (a credit line in the ledger).

    \b
    Example:
      miserver keys top-up key_0192f3a4b5c6d7e8f9a0b1c2 1000000
    """
    from ..services.accounts import keys as accounts

    record = _on_store(database_url, data_dir, lambda store: accounts.top_up(store, key_id, {"amount": amount}))
    click.echo(f"{record.id} balance {_money(record.balance)}")


@main.command()
@click.option("--group-by", type=click.Choice(["day", "model", "key"]), default="day", show_default=True)
@click.option("--start", default=None, help="First day, YYYY-MM-DD (UTC).")
@click.option("--end", default=None, help="Last day, YYYY-MM-DD (UTC).")
@click.option("--key", "key_id", default=None, help="Only this key id.")
@click.option("--model", default=None, help="Only this model.")
@click.option("--kind", type=click.Choice(["realtime", "batch"]), default=None)
@_db_url
@_db_dir
def usage(
    group_by: str,
    start: str | None,
    end: str | None,
    key_id: str | None,
    model: str | None,
    kind: str | None,
    database_url: str | None,
    data_dir: str,
) -> None:
    """Print the usage table (requests, tokens, cost) from the database's usage records.

    \b
    Example:
      miserver usage --group-by model --start 2026-12-01
    """
    from ..services.accounts.rollups import usage_rollup

    async def work(store: Any) -> Any:
        return await usage_rollup(
            store, group_by=group_by, start=start, end=end, key=key_id, model=model, kind=kind, currency=""
        )

    answer = _on_store(database_url, data_dir, work)
    label = "key_id" if group_by == "key" else group_by
    counts = ("requests", "input_tokens", "output_tokens")
    rows = [(str(row[label]), *(str(row[c]) for c in counts), _money(row["cost"])) for row in answer["data"]]
    for text in table((label, "requests", "input", "output", "cost"), rows, right={1, 2, 3, 4}):
        click.echo(text)
