"""The ``miserver`` command line: a thin click layer over the library (DESIGN §3.6)."""

from __future__ import annotations

import functools
import json
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


@main.command()
@click.option("--host", envvar="MISERVER_HOST", default="127.0.0.1", show_default=True, help="Bind address.")
@click.option("--port", envvar="MISERVER_PORT", default=8000, show_default=True, type=int, help="TCP port.")
@click.option("--database-url", envvar="MISERVER_DATABASE_URL", default=None, help="SQLite or PostgreSQL URL.")
@click.option("--data-dir", envvar="MISERVER_DATA_DIR", default="./var", show_default=True, type=click.Path())
@click.option("--model", envvar="MISERVER_MODEL", default=None, help="Catalogue id, transformers dir or .gguf file.")
@click.option("--served-model-name", envvar="MISERVER_SERVED_MODEL_NAME", default=None, help="Id to serve it under.")
@click.option("--log-level", envvar="MISERVER_LOG_LEVEL", default="info", show_default=True)
def serve(
    host: str,
    port: int,
    database_url: str | None,
    data_dir: str,
    model: str | None,
    served_model_name: str | None,
    log_level: str,
) -> None:
    """Run the HTTP server, the resident model and the batch runner.

    \b
    Example:
      miserver serve --port 8000 --data-dir ./var
      MISERVER_DATABASE_URL=postgresql+psycopg://postgres@127.0.0.1/test miserver serve
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
    settings = Settings(**overrides)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _check_sqlite_free(settings)
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
def worker(
    database_url: str | None,
    data_dir: str,
    model: str | None,
    served_model_name: str | None,
    worker_id: str | None,
    log_level: str,
) -> None:
    """Run the batch runner and a resident model without the HTTP API.

    Workers share batches with the server through PostgreSQL: each claims chunks of rows with FOR UPDATE SKIP
    LOCKED and heartbeats its claims; the chunk of a worker that dies is reclaimed after BATCH_CLAIM_TTL_SECONDS.
    SIGTERM stops it gracefully (the row in progress is recorded first).

    \b
    Example:
      MISERVER_DATABASE_URL=postgresql+psycopg://postgres@127.0.0.1/miserver miserver worker
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

    return OpenAI(base_url=url.rstrip("/") + "/v1", api_key="miserver", max_retries=2)


@main.command()
@click.option("--url", envvar="MISERVER_URL", default=DEFAULT_URL, show_default=True, help="Server base URL.")
@client_errors
def models(url: str) -> None:
    """List the models a running server serves, ids exactly as requests must name them.

    \b
    Example:
      miserver models --url http://127.0.0.1:8000
    """
    for m in _client(url).models.list():
        click.echo(m.id)


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
                bar.set_postfix_str(f"{b.status} failed={counts.failed}")
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
