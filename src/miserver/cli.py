"""The ``miserver`` command line: a thin click layer over the library (DESIGN §3.6)."""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import click

from .protocol.batches import TERMINAL
from .settings import Settings

DEFAULT_URL = "http://127.0.0.1:8000"
P = ParamSpec("P")
R = TypeVar("R")


def client_errors(command: Callable[P, R]) -> Callable[P, R]:
    """Turn the ``openai`` client's errors into one-line messages (exit status 1) instead of tracebacks."""

    @functools.wraps(command)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        import openai

        try:
            return command(*args, **kwargs)
        except openai.APIStatusError as exc:
            error = exc.body.get("error", exc.body) if isinstance(exc.body, dict) else {}
            message = error.get("message") if isinstance(error, dict) else None
            code = error.get("code") if isinstance(error, dict) else None
            text = f"{exc.status_code} {code or ''}: {message or exc.message}".replace(" :", ":")
            raise click.ClickException(text) from None
        except openai.APIConnectionError:
            url = kwargs.get("url", DEFAULT_URL)
            raise click.ClickException(
                f"cannot reach a server at {url} (is `miserver serve` running? see --url)"
            ) from None

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="miserver")
def main() -> None:
    """miServer: an OpenAI-compatible inference server with a durable Batch API."""


def upstream_options(command: Callable[P, R]) -> Callable[P, R]:
    """``--upstream NAME=URL`` (repeatable) and ``--no-model``, shared by ``serve`` and ``worker``."""
    command = click.option(
        "--no-model",
        is_flag=True,
        default=None,
        help="Start without a resident model: a pure gateway to the upstreams (env MISERVER_NO_MODEL).",
    )(command)
    return click.option(
        "--upstream",
        multiple=True,
        metavar="NAME=URL[;max_in_flight=N][;api_key_env=VAR][;total_timeout=S]",
        help="An OpenAI-compatible server to send requests for its models to (repeatable; env MISERVER_UPSTREAMS "
        "as name=url,name=url). The API key is read from the variable api_key_env names.",
    )(command)


def _upstream_overrides(upstream: tuple[str, ...], no_model: bool | None) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    if upstream:
        overrides["upstreams"] = ",".join(upstream)
    if no_model:
        overrides["no_model"] = True
    return overrides


@main.command()
@click.option("--host", envvar="MISERVER_HOST", default="127.0.0.1", show_default=True, help="Bind address.")
@click.option("--port", envvar="MISERVER_PORT", default=8000, show_default=True, type=int, help="TCP port.")
@click.option("--database-url", envvar="MISERVER_DATABASE_URL", default=None, help="SQLite or PostgreSQL URL.")
@click.option("--data-dir", envvar="MISERVER_DATA_DIR", default="./var", show_default=True, type=click.Path())
@click.option("--model", envvar="MISERVER_MODEL", default=None, help="Catalogue id, transformers dir or .gguf file.")
@click.option("--served-model-name", envvar="MISERVER_SERVED_MODEL_NAME", default=None, help="Id to serve it under.")
@click.option(
    "--catalogue", envvar="MISERVER_CATALOGUE", default=None, type=click.Path(), help="Catalogue file (TOML or YAML)."
)
@click.option("--log-level", envvar="MISERVER_LOG_LEVEL", default="info", show_default=True)
@click.option(
    "--insecure-no-auth",
    envvar="MISERVER_INSECURE_NO_AUTH",
    is_flag=True,
    help="Serve a non-loopback address with no API key in the database (open to anyone who reaches the port).",
)
@upstream_options
def serve(
    host: str,
    port: int,
    database_url: str | None,
    data_dir: str,
    model: str | None,
    served_model_name: str | None,
    catalogue: str | None,
    log_level: str,
    insecure_no_auth: bool,
    upstream: tuple[str, ...],
    no_model: bool | None,
) -> None:
    """Run the HTTP server, the resident model and the batch runner.

    \b
    Example:
      miserver serve --port 8000 --data-dir ./var
      MISERVER_DATABASE_URL=postgresql+psycopg://postgres@127.0.0.1/test miserver serve
      miserver serve --catalogue models.toml --model smollm2   # an id or alias of the catalogue
      miserver serve --no-model --upstream vllm=http://127.0.0.1:8001 --upstream b=http://10.0.0.7:8000
    The server is ready when GET /api/health answers 200.
    """
    import logging

    import uvicorn

    from .app import create_asgi

    overrides: dict[str, Any] = {"host": host, "port": port, "data_dir": Path(data_dir), "log_level": log_level}
    if database_url:
        overrides["database_url"] = database_url
    if model:
        overrides["model"] = model
    if served_model_name:
        overrides["served_model_name"] = served_model_name
    if catalogue:
        overrides["catalogue"] = Path(catalogue)
    if insecure_no_auth:
        overrides["insecure_no_auth"] = True
    overrides |= _upstream_overrides(upstream, no_model)
    settings = Settings(**overrides)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _check_sqlite_free(settings)
    _check_exposure(settings)
    uvicorn.run(create_asgi(settings), host=host, port=port, log_level=log_level, timeout_graceful_shutdown=30)


@main.command()
@click.option(
    "--database-url", envvar="MISERVER_DATABASE_URL", default=None, help="PostgreSQL URL shared with the server."
)
@click.option("--data-dir", envvar="MISERVER_DATA_DIR", default="./var", show_default=True, type=click.Path())
@click.option("--model", envvar="MISERVER_MODEL", default=None, help="Catalogue id, transformers dir or .gguf file.")
@click.option("--served-model-name", envvar="MISERVER_SERVED_MODEL_NAME", default=None, help="Id to serve it under.")
@click.option("--worker-id", default=None, help="Name in row claims (default: worker-<random>).")
@click.option("--log-level", envvar="MISERVER_LOG_LEVEL", default="info", show_default=True)
@upstream_options
def worker(
    database_url: str | None,
    data_dir: str,
    model: str | None,
    served_model_name: str | None,
    worker_id: str | None,
    log_level: str,
    upstream: tuple[str, ...],
    no_model: bool | None,
) -> None:
    """Run the batch runner and a resident model without the HTTP API.

    Workers share batches with the server through PostgreSQL: each claims chunks of rows with FOR UPDATE SKIP
    LOCKED and heartbeats its claims; the chunk of a worker that dies is reclaimed after BATCH_CLAIM_TTL_SECONDS.
    SIGTERM stops it gracefully (the row in progress is recorded first).

    \b
    Example:
      MISERVER_DATABASE_URL=postgresql+psycopg://postgres@127.0.0.1/miserver miserver worker
      miserver worker --no-model --upstream vllm=http://10.0.0.5:8000  # rows of upstream models only
    """
    import asyncio
    import logging
    import signal

    from .runtime import start_runtime
    from .store.db import DatabaseInUseError

    overrides: dict[str, Any] = {"data_dir": Path(data_dir), "log_level": log_level}
    for key, value in (("database_url", database_url), ("model", model), ("served_model_name", served_model_name)):
        if value:
            overrides[key] = value
    overrides |= _upstream_overrides(upstream, no_model)
    settings = Settings(**overrides)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    async def run() -> None:
        runtime = await start_runtime(settings, worker_id=worker_id, role="worker")
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, runtime.runner.stop)
        logging.getLogger("miserver").info("worker %s ready", runtime.runner.worker_id)
        try:
            await runtime.runner.run()
        finally:
            await runtime.close()

    try:
        asyncio.run(run())
    except DatabaseInUseError as exc:
        raise click.ClickException(str(exc)) from None


def _check_exposure(settings: Settings) -> None:
    """Refuse, with one clear line, to serve a non-loopback address with no API key (unless --insecure-no-auth)."""
    from .services import accounts

    if settings.insecure_no_auth or accounts.is_loopback(settings.host):
        return

    async def check(store: Any) -> None:
        await accounts.refuse_open_exposure(store, settings.host, settings.insecure_no_auth)

    try:
        _on_store(settings.database_url, str(settings.data_dir), check)
    except accounts.OpenExposureError as exc:
        raise click.ClickException(str(exc)) from None


def _check_sqlite_free(settings: Settings) -> None:
    """Fail early, with the store's clear message, when another process serves the same SQLite database."""
    from .store.db import DatabaseInUseError, ProcessLock, is_sqlite

    url = settings.resolved_database_url()
    if is_sqlite(url):
        try:
            ProcessLock.acquire(url).release()
        except DatabaseInUseError as exc:
            raise click.ClickException(str(exc)) from None


@main.group()
def db() -> None:
    """Database administration."""


@db.command("upgrade")
@click.option("--database-url", envvar="MISERVER_DATABASE_URL", default=None, help="SQLite or PostgreSQL URL.")
@click.option("--data-dir", envvar="MISERVER_DATA_DIR", default="./var", show_default=True, type=click.Path())
def db_upgrade(database_url: str | None, data_dir: str) -> None:
    """Apply the schema migrations (serve does this at start too).

    \b
    Example:
      miserver db upgrade --database-url postgresql+psycopg://postgres@127.0.0.1/test
    """
    from sqlalchemy.exc import OperationalError

    from .store.db import upgrade

    settings = Settings(data_dir=Path(data_dir), database_url=database_url)
    try:
        upgrade(settings.resolved_database_url())
    except OperationalError as exc:
        reason = str(exc.orig).strip().splitlines()[-1] if exc.orig is not None else str(exc)
        raise click.ClickException(
            f"cannot open the database: {reason} (a PostgreSQL database must exist first: createdb NAME)"
        ) from None
    click.echo("database at head")


def _client(url: str) -> Any:
    from openai import OpenAI

    # a server with API keys needs one: OPENAI_API_KEY, as the OpenAI SDK reads it (any value on a server without)
    api_key = os.environ.get("OPENAI_API_KEY") or "miserver"
    client = OpenAI(base_url=url.rstrip("/") + "/v1", api_key=api_key, max_retries=2)
    # closed with the command's context, on success and on error alike, so no connection outlives the command
    # (in-process callers, such as tests with click's CliRunner, would otherwise leak its sockets)
    ctx = click.get_current_context(silent=True)
    return ctx.with_resource(client) if ctx is not None else client


@main.group(invoke_without_command=True)
@click.option("--url", envvar="MISERVER_URL", default=DEFAULT_URL, show_default=True, help="Server base URL.")
@click.pass_context
@client_errors
def models(ctx: click.Context, url: str) -> None:
    """List the models a running server serves, ids exactly as requests must name them.

    \b
    Example:
      miserver models --url http://127.0.0.1:8000
      miserver models add my-model /models/my-model --alias mine   # add to the catalogue
    """
    ctx.obj = url
    if ctx.invoked_subcommand is None:
        for m in _client(url).models.list():
            click.echo(m.id)


@models.command("add")
@click.argument("model_id")
@click.argument("source")
@click.option("--alias", "aliases", multiple=True, help="A name that resolves to MODEL_ID (any case); repeatable.")
@click.option("--url", envvar="MISERVER_URL", default=None, help="Server base URL (default: the group's --url).")
@click.pass_context
def models_add(ctx: click.Context, model_id: str, source: str, aliases: tuple[str, ...], url: str | None) -> None:
    """Add a model the server may load: SOURCE is a transformers folder, a .gguf file or the embedded id.

    The entry is kept in the server's database; load it with POST /api/models/load {"model": MODEL_ID}.

    \b
    Example:
      miserver models add org/Model-GGUF:Q4_K_M /models/model.Q4_K_M.gguf --alias model
    """
    import httpx

    base = (url or ctx.obj or DEFAULT_URL).rstrip("/")
    body = {"id": model_id, "source": source, "aliases": list(aliases)}
    try:
        answer = httpx.post(base + "/api/models", json=body, timeout=60.0)
    except httpx.HTTPError:
        raise click.ClickException(
            f"cannot reach a server at {base} (is `miserver serve` running? see --url)"
        ) from None
    if answer.status_code != 200:
        error = (
            answer.json().get("error", {})
            if answer.headers.get("content-type", "").startswith("application/json")
            else {}
        )
        raise click.ClickException(
            f"{answer.status_code} {error.get('code') or ''}: {error.get('message') or answer.text}"
        )
    click.echo(json.dumps(answer.json()))


@main.group()
def batch() -> None:
    """Submit and watch batches on a running server (a client of the HTTP API)."""


def _submit(url: str, path: str, endpoint: str, window: str) -> Any:
    client = _client(url)
    with open(path, "rb") as fh:
        uploaded = client.files.create(file=(Path(path).name, fh), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window=window)


@batch.command("submit")
@click.argument("path", type=click.Path(exists=True, dir_okay=False))
@click.option("--endpoint", default="/v1/chat/completions", show_default=True)
@click.option("--window", default="24h", show_default=True, help="completion_window, 1h-168h.")
@click.option("--url", envvar="MISERVER_URL", default=DEFAULT_URL, show_default=True)
@client_errors
def batch_submit(path: str, endpoint: str, window: str, url: str) -> None:
    """Upload PATH (JSONL) and create a batch; prints the batch id.

    \b
    Example:
      miserver batch submit examples/topics.jsonl --endpoint /v1/chat/completions
    """
    click.echo(_submit(url, path, endpoint, window).id)


@batch.command("status")
@click.argument("batch_id")
@click.option("--url", envvar="MISERVER_URL", default=DEFAULT_URL, show_default=True)
@client_errors
def batch_status(batch_id: str, url: str) -> None:
    """Print a batch object as JSON.

    \b
    Example:
      miserver batch status batch_0193...
    """
    click.echo(json.dumps(_client(url).batches.retrieve(batch_id).model_dump(), indent=2))


def _eta_text(b: Any) -> str:
    """`` eta 14:05:09 (in 3m12s)`` from ``millm.estimated_completion_at``, or a reason it waits; empty if neither."""
    millm = (b.model_extra or {}).get("millm") or {}
    parts = ""
    eta = millm.get("estimated_completion_at")
    if isinstance(eta, int) and b.status not in TERMINAL:
        left = max(0, eta - int(time.time()))
        parts += f" eta {time.strftime('%H:%M:%S', time.localtime(eta))} (in {left // 60}m{left % 60:02d}s)"
    if millm.get("waiting_reason"):
        parts += f" waiting={millm['waiting_reason']}"
    return parts


def wait_for_batch(client: Any, batch_id: str, *, poll: float = 0.5, show: bool = True) -> Any:
    """Poll until the batch is terminal, with a tqdm progress bar over ``request_counts``."""
    from tqdm import tqdm

    bar = tqdm(total=0, unit="row", disable=not show, file=sys.stderr, dynamic_ncols=True)
    try:
        while True:
            b = client.batches.retrieve(batch_id)
            counts = b.request_counts
            if counts is not None:
                bar.total = counts.total
                bar.n = counts.completed + counts.failed
                bar.set_postfix_str(f"{b.status} failed={counts.failed}{_eta_text(b)}")
                bar.refresh()
            if b.status in TERMINAL:
                return b
            time.sleep(poll)
    finally:
        bar.close()


@batch.command("run")
@click.argument("path", type=click.Path(exists=True, dir_okay=False))
@click.option("--endpoint", default="/v1/chat/completions", show_default=True)
@click.option("--window", default="24h", show_default=True)
@click.option("--output", "-o", type=click.Path(dir_okay=False), default=None, help="Write the output lines here.")
@click.option("--errors", "-e", type=click.Path(dir_okay=False), default=None, help="Write the error lines here.")
@click.option("--url", envvar="MISERVER_URL", default=DEFAULT_URL, show_default=True)
@client_errors
def batch_run(path: str, endpoint: str, window: str, output: str | None, errors: str | None, url: str) -> None:
    """Submit PATH, show progress until the batch ends, then save its output (and its error lines).

    Exits 0 when the batch completed, even if some rows failed (they are counted, and are in the error file);
    1 when the batch failed, expired or was cancelled.

    \b
    Example:
      miserver batch run examples/topics.jsonl -o results.jsonl -e errors.jsonl
    """
    client = _client(url)
    created = _submit(url, path, endpoint, window)
    final = wait_for_batch(client, created.id)
    counts = final.request_counts
    done = f"{counts.completed} completed, {counts.failed} failed of {counts.total}" if counts else "no rows"
    click.echo(f"{final.id}: {final.status}, {done}")
    for error in (final.errors.data or [])[:5] if final.errors else []:
        where = f"line {error.line}: " if error.line else ""
        click.echo(f"  {where}{error.code}: {error.message}", err=True)
    files = [(output, final.output_file_id, "output", "--output")]
    files.append((errors, final.error_file_id, "error lines", "--errors"))
    for target, file_id, what, option in files:
        if file_id is None:
            if target:  # no such lines: an empty file, so that a file from an earlier run is not taken for this one
                Path(target).write_bytes(b"")
                click.echo(f"no {what}: {target} is empty")
            continue
        if target:
            Path(target).write_bytes(client.files.content(file_id).content)
            click.echo(f"{what} written to {target}")
        else:
            click.echo(f"{what}: file {file_id} (save it with {option} PATH)")
    if final.status != "completed":
        raise SystemExit(1)


if __name__ == "__main__":
    main()


# -- accounts (issue 13): keys and usage, straight on the database ---------------------------------------------------

_db_url = click.option(
    "--database-url", envvar="MISERVER_DATABASE_URL", default=None, help="SQLite or PostgreSQL URL (the server's)."
)
_db_dir = click.option("--data-dir", envvar="MISERVER_DATA_DIR", default="./var", show_default=True, type=click.Path())


@batch.command("watch")
@click.argument("batch_id")
@click.option("--url", envvar="MISERVER_URL", default=DEFAULT_URL, show_default=True)
@client_errors
def batch_watch(batch_id: str, url: str) -> None:
    """Show a batch's live progress bar with its ETA until it ends; exits 0 when it completed, else 1.

    \b
    Example:
      miserver batch watch batch_0193...
    """
    final = wait_for_batch(_client(url), batch_id)
    counts = final.request_counts
    done = f"{counts.completed} completed, {counts.failed} failed of {counts.total}" if counts else "no rows"
    click.echo(f"{final.id}: {final.status}, {done}")
    if final.status != "completed":
        raise SystemExit(1)


@batch.command("list")
@click.option("--limit", default=20, show_default=True, type=click.IntRange(1, 100), help="How many, newest first.")
@click.option("--url", envvar="MISERVER_URL", default=DEFAULT_URL, show_default=True)
@client_errors
def batch_list(limit: int, url: str) -> None:
    """List batches, newest first: id, status, rows done of total, failed, and the ETA or why it waits.

    \b
    Example:
      miserver batch list --limit 50
    """
    page = _client(url).batches.list(limit=limit)
    for b in page.data:
        counts = b.request_counts
        done = f"{counts.completed + counts.failed}/{counts.total} failed={counts.failed}" if counts else "-"
        click.echo(f"{b.id}  {b.status:<11} {done}{_eta_text(b)}")


def _post(url: str, path: str) -> Any:
    """POST an extension route of ``/v1`` with the SDK's client (errors become one-line messages)."""
    return _client(url).post(path, cast_to=object)


@batch.command("cancel")
@click.argument("batch_id")
@click.option("--url", envvar="MISERVER_URL", default=DEFAULT_URL, show_default=True)
@client_errors
def batch_cancel(batch_id: str, url: str) -> None:
    """Cancel a batch (recorded rows stay; the rest become batch_cancelled error lines); prints its status.

    \b
    Example:
      miserver batch cancel batch_0193...
    """
    b = _client(url).batches.cancel(batch_id)
    click.echo(f"{b.id}: {b.status}")


@batch.command("pause")
@click.argument("batch_id")
@click.option("--url", envvar="MISERVER_URL", default=DEFAULT_URL, show_default=True)
@client_errors
def batch_pause(batch_id: str, url: str) -> None:
    """Pause a batch at its next row boundary (its window keeps running).

    \b
    Example:
      miserver batch pause batch_0193...
    """
    b = _post(url, f"/batches/{batch_id}/pause")
    click.echo(f"{b['id']}: {b['status']}, paused")


@batch.command("resume")
@click.argument("batch_id")
@click.option("--url", envvar="MISERVER_URL", default=DEFAULT_URL, show_default=True)
@client_errors
def batch_resume(batch_id: str, url: str) -> None:
    """Resume a paused batch from its first unrecorded row.

    \b
    Example:
      miserver batch resume batch_0193...
    """
    b = _post(url, f"/batches/{batch_id}/resume")
    click.echo(f"{b['id']}: {b['status']}, resumed")


@batch.command("retry")
@click.argument("batch_id")
@click.option("--url", envvar="MISERVER_URL", default=DEFAULT_URL, show_default=True)
@client_errors
def batch_retry(batch_id: str, url: str) -> None:
    """Create a new batch of an ended batch's failed, cancelled and expired rows; prints the new batch's id.

    \b
    Example:
      miserver batch retry batch_0193... && miserver batch watch <the new id>
    """
    click.echo(_post(url, f"/batches/{batch_id}/retry")["id"])


@batch.command("download")
@click.argument("batch_id")
@click.option("--output", "-o", type=click.Path(dir_okay=False), default=None, help="Write the output lines here.")
@click.option("--errors", "-e", type=click.Path(dir_okay=False), default=None, help="Write the error lines here.")
@click.option("--url", envvar="MISERVER_URL", default=DEFAULT_URL, show_default=True)
@client_errors
def batch_download(batch_id: str, output: str | None, errors: str | None, url: str) -> None:
    """Save an ended batch's output file (-o) and error file (-e); a file the batch has not is written empty.

    \b
    Example:
      miserver batch download batch_0193... -o results.jsonl -e errors.jsonl
    """
    client = _client(url)
    b = client.batches.retrieve(batch_id)
    if b.status not in TERMINAL:
        raise click.ClickException(f"{batch_id} is {b.status}: its files exist once it has ended")
    if output is None and errors is None:
        raise click.UsageError("give --output and/or --errors")
    for target, file_id, what in ((output, b.output_file_id, "output"), (errors, b.error_file_id, "error lines")):
        if target is None:
            continue
        data = client.files.content(file_id).content if file_id else b""
        Path(target).write_bytes(data)
        click.echo(f"{what}: {len(data.splitlines())} lines written to {target}")


def _on_store(database_url: str | None, data_dir: str, work: Callable[[Any], Any]) -> Any:
    """Run ``await work(store)`` on the server's database (migrated first); errors become one-line messages."""
    import asyncio

    from .errors import APIError
    from .store import Store

    settings = Settings(data_dir=Path(data_dir), database_url=database_url)
    settings.data_dir.mkdir(parents=True, exist_ok=True)

    async def run() -> Any:
        store = await Store.open(settings.resolved_database_url())
        try:
            return await work(store)
        finally:
            await store.close()

    try:
        return asyncio.run(run())
    except APIError as exc:
        raise click.ClickException(exc.message) from None


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
@_db_url
@_db_dir
def keys_create(
    name: str,
    admin: bool,
    balance: int | None,
    max_pending_batches: int | None,
    max_enqueued_tokens: int | None,
    database_url: str | None,
    data_dir: str,
) -> None:
    """Create a key and print it once (only its SHA-256 digest is stored).

    \b
    Example:
      miserver keys create --name admin --admin
      miserver keys create --name team-a --balance 5000000 --max-pending-batches 3
    """
    from .services import accounts

    body: dict[str, Any] = {"name": name, "admin": admin, "balance": balance}
    body.update(max_pending_batches=max_pending_batches, max_enqueued_tokens=max_enqueued_tokens)
    from .errors import APIError

    try:
        spec = accounts.KeySpec.parse(body)
    except APIError as exc:
        raise click.ClickException(exc.message) from None
    record, key = _on_store(database_url, data_dir, lambda store: accounts.create_key(store, spec))
    click.echo(f"{key}")
    click.echo(f"id {record.id}  name {record.name}  admin {record.admin}  balance {_money(record.balance)}", err=True)
    click.echo("Keep the key now: it is not stored and cannot be shown again.", err=True)


@keys.command("list")
@_db_url
@_db_dir
def keys_list(database_url: str | None, data_dir: str) -> None:
    """List the keys (prefix, name, admin, balance, quotas, revoked), never the keys themselves.

    \b
    Example:
      miserver keys list
    """
    from .services import accounts

    records = _on_store(database_url, data_dir, accounts.list_keys)
    click.echo(f"{'id':<30} {'prefix':<12} {'name':<20} {'admin':<6} {'balance':>16} {'quotas':<20} revoked")
    for r in records:
        quotas = f"{r.max_pending_batches or '-'}b/{r.max_enqueued_tokens or '-'}t"
        revoked = str(r.revoked_at) if r.revoked_at else "-"
        click.echo(
            f"{r.id:<30} {r.prefix:<12} {r.name[:20]:<20} {str(r.admin):<6} {_money(r.balance):>16} {quotas:<20} "
            f"{revoked}"
        )


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
    from .services import accounts

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
    from .services import accounts

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
    from .services import billing

    async def work(store: Any) -> Any:
        return await billing.usage_rollup(
            store, group_by=group_by, start=start, end=end, key=key_id, model=model, kind=kind, currency=""
        )

    answer = _on_store(database_url, data_dir, work)
    label = "key_id" if group_by == "key" else group_by
    click.echo(f"{label:<40} {'requests':>9} {'input':>12} {'output':>12} {'cost':>16}")
    for row in answer["data"]:
        click.echo(
            f"{str(row[label])[:40]:<40} {row['requests']:>9} {row['input_tokens']:>12} {row['output_tokens']:>12} "
            f"{_money(row['cost']):>16}"
        )
