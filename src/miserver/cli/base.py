"""The ``main`` click group and what several command modules share: the default URL, the client and its errors,
and running a coroutine on the server's database."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Collection, Iterable, Sequence
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import click

from ..settings import Settings

DEFAULT_URL = "http://127.0.0.1:8000"
#: The variable the client commands read their API key from (the one the OpenAI SDK reads).
API_KEY_ENV = "OPENAI_API_KEY"
#: Sent when no key is set, because the OpenAI SDK refuses to send a request without one: a server without keys
#: accepts any key, and a server with keys refuses it (then :func:`error_line` says that no key was set).
NO_KEY_PLACEHOLDER = "no-key-set"
P = ParamSpec("P")
R = TypeVar("R")


#: The ``--url`` option of every client command (``MISERVER_URL`` when not given).
url_option = click.option(
    "--url", envvar="MISERVER_URL", default=DEFAULT_URL, show_default=True, show_envvar=True, help="Server base URL."
)


def plural(count: int, noun: str) -> str:
    """``1 line``, ``0 lines``, ``2 lines``: a count with its noun in the right number."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def table(header: Sequence[str], rows: Iterable[Sequence[str]], right: Collection[int] = ()) -> list[str]:
    """The lines of a text table: every column as wide as its longest cell (the header's included), so no value is
    ever cut; the columns numbered in ``right`` (numbers) are aligned right, the others left."""
    cells = [list(header), *(list(row) for row in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]

    def line(row: list[str]) -> str:
        padded = (c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
        return " ".join(padded).rstrip()

    return [line(row) for row in cells]


def api_key() -> str | None:
    """The API key of the client commands, from ``OPENAI_API_KEY``; None when it is unset or empty."""
    return os.environ.get(API_KEY_ENV) or None


def error_line(status: int, code: str | None, message: str) -> str:
    """The one-line message of an error answer: ``<status> <code>: <message>``. A 401 while no key is set says
    that none was set and how to set one, instead of the server's word on the placeholder it was sent."""
    if status == 401 and api_key() is None:
        message = (
            f"no API key was set, and this server needs one: set {API_KEY_ENV} "
            f"(export {API_KEY_ENV}=sk-...; an admin makes keys with `miserver keys create`)"
        )
    return f"{status} {code}: {message}" if code else f"{status}: {message}"


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
            raise click.ClickException(error_line(exc.status_code, code, message or exc.message)) from None
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


def _client(url: str) -> Any:
    from openai import OpenAI

    # a server with API keys needs one: OPENAI_API_KEY, as the OpenAI SDK reads it (any value on a server without)
    client = OpenAI(base_url=url.rstrip("/") + "/v1", api_key=api_key() or NO_KEY_PLACEHOLDER, max_retries=2)
    # closed with the command's context, on success and on error alike, so no connection outlives the command
    # (in-process callers, such as tests with click's CliRunner, would otherwise leak its sockets)
    ctx = click.get_current_context(silent=True)
    return ctx.with_resource(client) if ctx is not None else client


def _on_store(database_url: str | None, data_dir: str, work: Callable[[Any], Any]) -> Any:
    """Run ``await work(store)`` on the server's database (migrated first); errors become one-line messages."""
    import asyncio

    from ..errors import APIError
    from ..store import Store

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
