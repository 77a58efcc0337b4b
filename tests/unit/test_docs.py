"""The manual (README.md and the pages under docs/) documents every setting, and every CLI command's ``--help`` shows
an example."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import click
import pytest
from click.testing import CliRunner
from pydantic import AliasChoices

from miserver.cli import main
from miserver.services.accounts import keys as accounts
from miserver.services.accounts.prices import PriceTable, row_usage
from miserver.services.inference.metering import record_realtime
from miserver.settings import Settings

DOCS = Path(__file__).resolve().parents[2] / "docs"
CONFIGURATION = DOCS / "configuration.md"
ACCOUNTS = DOCS / "accounts.md"
RESPONSES_AND_ANTHROPIC = DOCS / "responses-and-anthropic.md"


def _readme_env_table() -> set[str]:
    """The variables named in the first column of the "Environment variables" table of docs/configuration.md."""
    text = CONFIGURATION.read_text()
    section = text.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([A-Z0-9_]+)` \|", section, flags=re.MULTILINE))


def _setting_env_names() -> set[str]:
    """The upper-case environment variable of each :class:`Settings` field."""
    names = set()
    for field_name, field in Settings.model_fields.items():
        alias = field.validation_alias
        assert isinstance(alias, AliasChoices), f"setting {field_name} names no environment variable"
        upper = [c for c in alias.choices if isinstance(c, str) and c.isupper()]
        assert len(upper) == 1, f"setting {field_name}: {alias.choices}"
        names.add(upper[0])
    return names


def _commands(group: click.Group, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], click.Command]]:
    found: list[tuple[tuple[str, ...], click.Command]] = []
    for name, command in sorted(group.commands.items()):
        path = (*prefix, name)
        found.append((path, command))
        if isinstance(command, click.Group):
            found.extend(_commands(command, path))
    return found


def _cli_env_names() -> set[str]:
    names = set()
    for _, command in _commands(main):
        for param in command.params:
            envvar = getattr(param, "envvar", None)
            if isinstance(envvar, str):
                names.add(envvar)
    return names


def test_every_setting_is_in_the_readme_table() -> None:
    table = _readme_env_table()
    assert table, "docs/configuration.md has no '## Environment variables' table"
    missing = sorted(_setting_env_names() - table)
    assert not missing, f"settings missing from the environment table of docs/configuration.md: {missing}"


def test_every_cli_environment_variable_is_in_the_readme_table() -> None:
    missing = sorted(_cli_env_names() - _readme_env_table())
    assert not missing, (
        f"CLI environment variables missing from the environment table of docs/configuration.md: {missing}"
    )


def test_the_readme_table_names_no_unknown_variable() -> None:
    unknown = sorted(_readme_env_table() - _setting_env_names() - _cli_env_names())
    assert not unknown, f"the environment table of docs/configuration.md names variables nothing reads: {unknown}"


@pytest.mark.parametrize(
    "path", [path for path, command in _commands(main) if not isinstance(command, click.Group)], ids=" ".join
)
def test_every_cli_command_help_has_an_example(path: tuple[str, ...]) -> None:
    result = CliRunner().invoke(main, [*path, "--help"])
    assert result.exit_code == 0, result.output
    assert result.output.partition("\n\n")[2].strip(), f"`miserver {' '.join(path)} --help` has no description"
    assert "Example:" in result.output, f"`miserver {' '.join(path)} --help` shows no example"
    example = result.output.split("Example:", 1)[1]
    assert f"miserver {' '.join(path)}" in example, f"the example of `miserver {' '.join(path)}` does not run it"


@pytest.mark.parametrize("path", [path for path, _ in _commands(main)], ids=" ".join)
def test_every_cli_option_help_names_the_environment_variable_it_reads(path: tuple[str, ...]) -> None:
    """``--url`` reads ``MISERVER_URL``, ``--database-url`` ``MISERVER_DATABASE_URL``, ...: ``--help`` says so."""
    command = dict(_commands(main))[path]
    result = CliRunner().invoke(main, [*path, "--help"])
    assert result.exit_code == 0, result.output
    shown = " ".join(result.output.split())
    for param in command.params:
        envvar = getattr(param, "envvar", None)
        if isinstance(envvar, str):
            assert f"env var: {envvar}" in shown, f"`miserver {' '.join(path)} --help` does not name {envvar}"


def test_the_readme_lists_exactly_the_routes_open_without_a_key() -> None:
    """The Accounts page's "Open without a key:" sentence names each of ``OPEN_ROUTES`` and ``OPEN_PREFIXES``, and
    nothing else."""
    text = " ".join(ACCOUNTS.read_text().split("# Accounts", 1)[1].split())
    sentence = text.split("Open without a key: ", 1)[1].split(", since ", 1)[0]
    listed = set(re.findall(r"`(GET|POST|PUT|PATCH|DELETE) (/[^`]*)`", sentence))
    assert listed == set(accounts.OPEN_ROUTES), sentence
    assert all(f"`{prefix}`" in sentence for prefix in accounts.OPEN_PREFIXES), sentence


def _paragraph(starting: str, page: Path) -> str:
    text = page.read_text()
    return " ".join(text[text.index(starting) :].split("\n\n", 1)[0].split())


async def test_the_readme_says_that_usage_is_recorded_per_key_only() -> None:
    """What docs/accounts.md says about usage on a server without keys is what billing does: no record without a key."""
    usage = _paragraph("**Usage records.**", ACCOUNTS)
    assert "Usage is recorded per key only: a server with no keys records none" in usage
    assert "everything costs 0 (each key's usage is still recorded, at cost 0)" in _paragraph(
        "`input` and `output`", ACCOUNTS
    )
    row = {"prices": None, "endpoint": "/v1/chat/completions", "batch_id": "batch_1", "line": 1, "model": "m"}
    assert row_usage(owner=None, input_tokens=3, output_tokens=2, **row) is None
    assert row_usage(owner="key_1", input_tokens=3, output_tokens=2, **row) is not None
    store: Any = None  # not reached: a caller without a key writes nothing
    chat = ("/v1/chat/completions", "m", 3, 2, "req_1")
    assert await record_realtime(store, PriceTable(), accounts.SYSTEM, *chat) is False


def test_the_readme_says_how_the_anthropic_routes_read_x_api_key() -> None:
    """``x-api-key`` is the API key on the /anthropic routes (not a header ignored by a server "with no keys")."""
    anthropic = _paragraph("`POST /anthropic/v1/messages` serves", RESPONSES_AND_ANTHROPIC)
    assert "this server has no keys" not in anthropic
    assert "`x-api-key` is read as the API key, like `Authorization: Bearer`" in anthropic
    request = SimpleNamespace(headers={"x-api-key": "sk-abc"}, url=SimpleNamespace(path="/anthropic/v1/messages"))
    assert accounts.presented_key(request) == "sk-abc"  # type: ignore[arg-type]
