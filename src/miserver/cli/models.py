"""``miserver models``: list the models a running server serves, and add one to its catalogue."""

from __future__ import annotations

import json

import click

from .base import DEFAULT_URL, _client, api_key, client_errors, error_line, main, url_option


@main.group(invoke_without_command=True)
@url_option
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
@click.option(
    "--url", envvar="MISERVER_URL", default=None, show_envvar=True, help="Server base URL (default: the group's --url)."
)
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
    key = api_key()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        answer = httpx.post(base + "/api/models", json=body, headers=headers, timeout=60.0)
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
        message = error.get("message") or answer.text
        raise click.ClickException(error_line(answer.status_code, error.get("code"), message))
    click.echo(json.dumps(answer.json()))
