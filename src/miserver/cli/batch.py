"""``miserver batch``: submit, watch and manage batches on a running server (a client of the HTTP API)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import click

from ..protocol.batches import TERMINAL
from .base import _client, client_errors, main, plural, url_option


@main.group()
def batch() -> None:
    """Submit and watch batches on a running server (a client of the HTTP API)."""


#: ``--pack/--no-pack``: the batch's ``pack`` field (unset: the server's ``BATCH_PACK_DEFAULT``).
pack_option = click.option(
    "--pack/--no-pack",
    default=None,
    help="Run the rows packed (pack: true) or one at a time; unset, the server's default (BATCH_PACK_DEFAULT).",
)


def _submit(url: str, path: str, endpoint: str, window: str, pack: bool | None) -> Any:
    client = _client(url)
    with open(path, "rb") as fh:
        uploaded = client.files.create(file=(Path(path).name, fh), purpose="batch")
    extra = {} if pack is None else {"pack": pack}
    return client.batches.create(
        input_file_id=uploaded.id, endpoint=endpoint, completion_window=window, extra_body=extra
    )


@batch.command("submit")
@click.argument("path", type=click.Path(exists=True, dir_okay=False))
@click.option("--endpoint", default="/v1/chat/completions", show_default=True)
@click.option("--window", default="24h", show_default=True, help="completion_window, 1h-168h.")
@pack_option
@url_option
@client_errors
def batch_submit(path: str, endpoint: str, window: str, pack: bool | None, url: str) -> None:
    """Upload PATH (JSONL) and create a batch; prints the batch id.

    \b
    Example:
      miserver batch submit examples/topics.jsonl --endpoint /v1/chat/completions --pack
    """
    click.echo(_submit(url, path, endpoint, window, pack).id)


@batch.command("status")
@click.argument("batch_id")
@url_option
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


#: Validation errors ``batch run`` prints (the error file holds them all).
SHOWN_ERRORS = 5


def ended_text(counts: Any) -> str:
    """``29 completed, 1 failed`` of a batch's ``request_counts``."""
    return f"{counts.completed} completed, {counts.failed} failed"


def rows_text(counts: Any) -> str:
    """``30/64 rows done (29 completed, 1 failed)`` of a batch's ``request_counts``."""
    return f"{counts.completed + counts.failed}/{counts.total} rows done ({ended_text(counts)})"


def wait_for_batch(
    client: Any, batch_id: str, *, poll: float = 0.5, show: bool = True, terminal: bool | None = None
) -> Any:
    """Poll until the batch is terminal, showing its progress on standard error: on a ``terminal`` (None: whether
    standard error is one) a tqdm progress bar over ``request_counts``, whose rate counts the rows that finished
    while it watched (a batch joined half-way starts the bar there); elsewhere (a pipe, a log file) a line each time
    the status or the rows done change."""
    from tqdm import tqdm

    if terminal is None:
        terminal = sys.stderr.isatty()
    bar = tqdm(total=0, unit="row", disable=not (show and terminal), file=sys.stderr, dynamic_ncols=True)
    first, last = True, ""
    try:
        while True:
            b = client.batches.retrieve(batch_id)
            counts = b.request_counts
            if counts is not None and show and not terminal:
                line = f"{b.status} {rows_text(counts)}"
                if line != last:
                    click.echo(f"{line}{_eta_text(b)}", err=True)
                    last = line
            elif counts is not None:
                bar.total = counts.total
                bar.n = counts.completed + counts.failed
                if first:
                    bar.initial, first = bar.n, False
                bar.set_postfix_str(f"{b.status} {ended_text(counts)}{_eta_text(b)}")
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
@pack_option
@url_option
@client_errors
def batch_run(
    path: str, endpoint: str, window: str, output: str | None, errors: str | None, pack: bool | None, url: str
) -> None:
    """Submit PATH, show progress until the batch ends, then save its output (and its error lines).

    Exits 0 when the batch completed, even if some rows failed (they are counted, and are in the error file);
    1 when the batch failed, expired or was cancelled.

    \b
    Example:
      miserver batch run examples/topics.jsonl -o results.jsonl -e errors.jsonl
    """
    client = _client(url)
    created = _submit(url, path, endpoint, window, pack)
    final = wait_for_batch(client, created.id)
    counts = final.request_counts
    done = f"{counts.completed} completed, {counts.failed} failed of {counts.total}" if counts else "no rows"
    click.echo(f"{final.id}: {final.status}, {done}")
    refused = (final.errors.data or []) if final.errors else []
    for error in refused[:SHOWN_ERRORS]:
        where = f"line {error.line}: " if error.line else ""
        click.echo(f"  {where}{error.code}: {error.message}", err=True)
    if len(refused) > SHOWN_ERRORS:
        more = len(refused) - SHOWN_ERRORS
        click.echo(f"  ... and {more} more refused at validation (every one is in the error file)", err=True)
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


@batch.command("watch")
@click.argument("batch_id")
@url_option
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
@url_option
@client_errors
def batch_list(limit: int, url: str) -> None:
    """List batches, newest first: id, status, rows done of total (completed, failed), and the ETA or why it waits.

    \b
    Example:
      miserver batch list --limit 50
    """
    page = _client(url).batches.list(limit=limit)
    for b in page.data:
        counts = b.request_counts
        click.echo(f"{b.id}  {b.status:<11} {rows_text(counts) if counts else '-'}{_eta_text(b)}")


def _post(url: str, path: str) -> Any:
    """POST an extension route of ``/v1`` with the SDK's client (errors become one-line messages)."""
    return _client(url).post(path, cast_to=object)


@batch.command("cancel")
@click.argument("batch_id")
@url_option
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
@url_option
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
@url_option
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
@url_option
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
@url_option
@client_errors
def batch_download(batch_id: str, output: str | None, errors: str | None, url: str) -> None:
    """Save an ended batch's output file (-o) and error file (-e); a file the batch does not have is written empty.

    \b
    Example:
      miserver batch download batch_0193... -o results.jsonl -e errors.jsonl
    """
    client = _client(url)
    b = client.batches.retrieve(batch_id)
    if b.status not in TERMINAL:
        raise click.ClickException(
            f"{batch_id} is {b.status}: its files exist once it has ended (the rows recorded so far: "
            f"GET /v1/batches/{batch_id}/results)"
        )
    if output is None and errors is None:
        raise click.UsageError("give --output and/or --errors")
    for target, file_id, what in ((output, b.output_file_id, "output"), (errors, b.error_file_id, "error lines")):
        if target is None:
            continue
        data = client.files.content(file_id).content if file_id else b""
        Path(target).write_bytes(data)
        click.echo(f"{what}: {plural(len(data.splitlines()), 'line')} written to {target}")
