"""``miserver serve`` and ``miserver worker``: the process that serves, and the one that only runs batches."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import click

from .. import log_redaction
from ..settings import Settings
from .base import P, R, _on_store, main
from .db import check_reachable


def resident_options(command: Callable[P, R]) -> Callable[P, R]:
    """``--data-dir``, ``--model`` and ``--served-model-name``, shared by ``serve`` and ``worker`` (in this order)."""
    command = click.option(
        "--served-model-name",
        envvar="MISERVER_SERVED_MODEL_NAME",
        show_envvar=True,
        default=None,
        help="Id to serve it under.",
    )(command)
    command = click.option(
        "--model",
        envvar="MISERVER_MODEL",
        show_envvar=True,
        default=None,
        help="Catalogue id, transformers dir or .gguf file.",
    )(command)
    return click.option(
        "--data-dir",
        envvar="MISERVER_DATA_DIR",
        show_envvar=True,
        default="./var",
        show_default=True,
        type=click.Path(),
    )(command)


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
@click.option(
    "--host", envvar="MISERVER_HOST", show_envvar=True, default="127.0.0.1", show_default=True, help="Bind address."
)
@click.option(
    "--port", envvar="MISERVER_PORT", show_envvar=True, default=8000, show_default=True, type=int, help="TCP port."
)
@click.option(
    "--database-url", envvar="MISERVER_DATABASE_URL", show_envvar=True, default=None, help="SQLite or PostgreSQL URL."
)
@resident_options
@click.option(
    "--catalogue",
    envvar="MISERVER_CATALOGUE",
    show_envvar=True,
    default=None,
    type=click.Path(),
    help="Catalogue file (TOML or YAML).",
)
@click.option("--log-level", envvar="MISERVER_LOG_LEVEL", show_envvar=True, default="info", show_default=True)
@click.option(
    "--insecure-no-auth",
    envvar="MISERVER_INSECURE_NO_AUTH",
    show_envvar=True,
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

    from ..app import create_asgi

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
    _check_port_free(host, port)
    check_reachable(settings.resolved_database_url())
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log_redaction.install()
    _check_sqlite_free(settings)
    _check_exposure(settings)
    uvicorn.run(
        create_asgi(settings),
        host=host,
        port=port,
        log_level=log_level,
        log_config=log_redaction.uvicorn_log_config(),
        timeout_graceful_shutdown=30,
    )


@main.command()
@click.option(
    "--database-url",
    envvar="MISERVER_DATABASE_URL",
    show_envvar=True,
    default=None,
    help="PostgreSQL URL shared with the server.",
)
@resident_options
@click.option("--worker-id", default=None, help="Name in row claims (default: worker-<random>).")
@click.option("--log-level", envvar="MISERVER_LOG_LEVEL", show_envvar=True, default="info", show_default=True)
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

    from ..runtime import start_runtime
    from ..store.db import DatabaseInUseError

    overrides: dict[str, Any] = {"data_dir": Path(data_dir), "log_level": log_level}
    for key, value in (("database_url", database_url), ("model", model), ("served_model_name", served_model_name)):
        if value:
            overrides[key] = value
    overrides |= _upstream_overrides(upstream, no_model)
    settings = Settings(**overrides)
    check_reachable(settings.resolved_database_url())
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log_redaction.install()

    async def run() -> None:
        runtime = await start_runtime(settings, worker_id=worker_id, role="worker")
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, runtime.runner.stop)
        logging.getLogger("miserver").info("worker %s ready", runtime.runner.worker_id)
        runtime.jobs.start()  # file pruning and webhook delivery, beside the runner
        try:
            await runtime.runner.run()
        finally:
            await runtime.jobs.stop()
            await runtime.close()

    try:
        run_loop(run())
    except DatabaseInUseError as exc:
        raise click.ClickException(str(exc)) from None


def run_loop(main: Coroutine[Any, Any, None]) -> None:
    """Run ``main`` on uvloop's event loop (the server's, through uvicorn, too), or asyncio's where it is missing."""
    try:
        import uvloop
    except ImportError:  # not installed on this platform
        import asyncio

        asyncio.run(main)
    else:
        uvloop.run(main)


def _check_exposure(settings: Settings) -> None:
    """Refuse, with one clear line, to serve a non-loopback address with no API key (unless --insecure-no-auth)."""
    from ..services.accounts import keys as accounts

    if settings.insecure_no_auth or accounts.is_loopback(settings.host):
        return

    async def check(store: Any) -> None:
        await accounts.refuse_open_exposure(store, settings.host, settings.insecure_no_auth)

    try:
        _on_store(settings.database_url, str(settings.data_dir), check)
    except accounts.OpenExposureError as exc:
        raise click.ClickException(str(exc)) from None


def _check_port_free(host: str, port: int) -> None:
    """Fail at once, before the model loads, when another process listens on ``host:port``."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise click.ClickException(f"cannot serve on {host}:{port}: {exc}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(
            socket.SOL_SOCKET, socket.SO_REUSEADDR, 1
        )  # as uvicorn binds: a closed socket's wait is no conflict
        try:
            probe.bind(address)
        except OSError as exc:
            raise click.ClickException(f"cannot serve on {host}:{port}: {exc.strerror or exc}") from None


def _check_sqlite_free(settings: Settings) -> None:
    """Fail early, with the store's clear message, when another process serves the same SQLite database."""
    from ..store.db import DatabaseInUseError, ProcessLock, is_sqlite

    url = settings.resolved_database_url()
    if is_sqlite(url):
        try:
            ProcessLock.acquire(url).release()
        except DatabaseInUseError as exc:
            raise click.ClickException(str(exc)) from None
