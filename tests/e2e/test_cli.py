"""The ``miserver`` client commands against a running server, as a user runs them (acceptance tier).

``batch run`` reports failed rows and saves both files; ordinary errors (an unknown batch, no server) are one line
and exit status 1, never a traceback.
"""

from __future__ import annotations

import gc
import json
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from miserver.cli import main
from tests.support.batches import chat_body, line
from tests.support.server import ServerProcess


def test_batch_run_saves_output_and_error_lines(sqlite_module_server: ServerProcess, tmp_path: Path) -> None:
    source = tmp_path / "mixed.jsonl"
    rows = [
        line("good-1", chat_body("hi")),
        line("bad-1", chat_body("hi", temperature="hot")),
        line("good-2", chat_body("yo")),
    ]
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    result = CliRunner().invoke(
        main, ["batch", "run", str(source), "-o", str(out), "-e", str(err), "--url", sqlite_module_server.base_url]
    )
    assert result.exit_code == 0, result.output
    assert "completed, 2 completed, 1 failed of 3" in result.output
    assert [json.loads(x)["custom_id"] for x in out.read_text().splitlines()] == ["good-1", "good-2"]
    failed = [json.loads(x) for x in err.read_text().splitlines()]
    assert [f["custom_id"] for f in failed] == ["bad-1"]
    assert failed[0]["response"]["body"]["error"]["param"] == "body.temperature"

    # a second run with no failed row empties the error file instead of leaving the first run's lines there
    source.write_text(json.dumps(rows[0]) + "\n")
    again = CliRunner().invoke(
        main, ["batch", "run", str(source), "-o", str(out), "-e", str(err), "--url", sqlite_module_server.base_url]
    )
    assert again.exit_code == 0, again.output
    assert err.read_bytes() == b"" and f"no error lines: {err} is empty" in again.output


def test_batch_run_without_paths_names_the_files(sqlite_module_server: ServerProcess, tmp_path: Path) -> None:
    source = tmp_path / "one-bad.jsonl"
    rows = [line("good", chat_body("hi")), line("bad", chat_body("hi", foo=1))]
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = CliRunner().invoke(main, ["batch", "run", str(source), "--url", sqlite_module_server.base_url])
    assert result.exit_code == 0, result.output
    assert "output: file file-" in result.output and "error lines: file file-" in result.output


def test_submit_sets_pack_only_when_asked(sqlite_module_server: ServerProcess, tmp_path: Path) -> None:
    """``--pack`` and ``--no-pack`` set the batch's ``pack``; without either the server's default applies (false)."""
    source = tmp_path / "one.jsonl"
    source.write_text(json.dumps(line("one", chat_body("hi"))) + "\n")
    url = ["--url", sqlite_module_server.base_url]
    packs = []
    for flag in (["--pack"], ["--no-pack"], []):
        submitted = CliRunner().invoke(main, ["batch", "submit", str(source), *flag, *url])
        assert submitted.exit_code == 0, submitted.output
        status = CliRunner().invoke(main, ["batch", "status", submitted.output.strip(), *url])
        assert status.exit_code == 0, status.output
        packs.append(json.loads(status.output)["millm"]["pack"])
    assert packs == [True, False, False]


def test_a_failed_batch_says_why_and_exits_1(sqlite_module_server: ServerProcess, tmp_path: Path) -> None:
    source = tmp_path / "all-bad.jsonl"
    source.write_text(json.dumps(line("bad", chat_body("hi", foo=1))) + "\n")
    result = CliRunner().invoke(main, ["batch", "run", str(source), "--url", sqlite_module_server.base_url])
    assert result.exit_code == 1
    assert ": failed, 0 completed, 1 failed of 1" in result.stdout
    assert "unknown_parameter" in result.stderr and "line 1" in result.stderr


def test_a_long_list_of_refused_lines_says_how_many_it_left_out(
    sqlite_module_server: ServerProcess, tmp_path: Path
) -> None:
    source = tmp_path / "many-bad.jsonl"
    source.write_text("".join(json.dumps(line(f"bad-{i}", chat_body("hi", foo=1))) + "\n" for i in range(8)))
    result = CliRunner().invoke(main, ["batch", "run", str(source), "--url", sqlite_module_server.base_url])
    assert result.exit_code == 1
    assert [f"line {i}:" in result.stderr for i in range(1, 9)] == [True] * 5 + [False] * 3
    assert "... and 3 more refused at validation (every one is in the error file)" in result.stderr


def test_an_unknown_batch_is_one_line_not_a_traceback(sqlite_module_server: ServerProcess) -> None:
    result = CliRunner().invoke(main, ["batch", "status", "batch_nope", "--url", sqlite_module_server.base_url])
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: 404") and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_no_server_is_one_line(unused_url: str = "http://127.0.0.1:9") -> None:
    result = CliRunner().invoke(main, ["models", "--url", unused_url])
    assert result.exit_code == 1
    assert "cannot reach a server at http://127.0.0.1:9" in result.stderr


def test_a_command_closes_its_connections_on_success_and_on_error(sqlite_module_server: ServerProcess) -> None:
    """Each command closes its client when it ends, also when it exits 1: an in-process caller (CliRunner here)
    is left no open socket to be found, unclosed, by the garbage collector in some later test."""
    url = ["--url", sqlite_module_server.base_url]
    gc.collect()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        assert CliRunner().invoke(main, ["batch", "list", *url]).exit_code == 0
        assert CliRunner().invoke(main, ["batch", "cancel", "batch_nope", *url]).exit_code == 1
        gc.collect()
    assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, str]]:
    """A server with no model whose database holds one admin key (made with ``miserver keys create`` first), and
    that key."""
    root = tmp_path_factory.mktemp("keyed")
    db = ["--database-url", f"sqlite:///{root / 'miserver.db'}", "--data-dir", str(root / "var")]
    made = CliRunner().invoke(main, ["keys", "create", "--name", "admin", "--admin", *db])
    assert made.exit_code == 0, made.output
    key = made.stdout.strip()
    server = ServerProcess(
        data_dir=root / "var", database_url=f"sqlite:///{root / 'miserver.db'}", env={"MISERVER_NO_MODEL": "1"}
    )
    with server:
        yield server, key


@pytest.mark.parametrize("command", [["batch", "list"], ["models"], ["models", "add", "m", "/nowhere"]])
def test_no_key_set_says_so_and_how_to_set_it(
    keyed_server: tuple[ServerProcess, str], monkeypatch: pytest.MonkeyPatch, command: list[str]
) -> None:
    """Without OPENAI_API_KEY on a server with keys, the error is that no key was set (not that a key was wrong);
    with a wrong key it is the server's word; with the key the command gets past authentication."""
    server, key = keyed_server
    url = ["--url", server.base_url]
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    unset = CliRunner().invoke(main, [*command, *url])
    assert unset.exit_code == 1
    assert unset.stderr.startswith("Error: 401 invalid_api_key: no API key was set"), unset.stderr
    assert "OPENAI_API_KEY" in unset.stderr and "incorrect" not in unset.stderr
    assert len(unset.stderr.strip().splitlines()) == 1

    monkeypatch.setenv("OPENAI_API_KEY", "sk-" + "x" * 43)
    wrong = CliRunner().invoke(main, [*command, *url])
    assert wrong.exit_code == 1 and "401 invalid_api_key: The API key provided (sk-xxxxxxxx...) is incorrect" in (
        wrong.stderr
    ), wrong.stderr

    monkeypatch.setenv("OPENAI_API_KEY", key)
    right = CliRunner().invoke(main, [*command, *url])
    if command[-1] == "/nowhere":  # past authentication: the server looked at the source
        assert right.exit_code == 1 and "400 invalid_value: Invalid 'source'" in right.stderr, right.stderr
    else:
        assert right.exit_code == 0, right.output


def test_no_key_set_works_on_a_server_without_keys(
    sqlite_module_server: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    result = CliRunner().invoke(main, ["models", "--url", sqlite_module_server.base_url])
    assert result.exit_code == 0 and result.stdout.strip() == "tiny", result.output


def test_download_counts_its_lines_in_the_right_number(sqlite_module_server: ServerProcess, tmp_path: Path) -> None:
    source = tmp_path / "three.jsonl"
    rows = [line("good-1", chat_body("hi")), line("good-2", chat_body("yo")), line("bad", chat_body("hi", foo=1))]
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    url = ["--url", sqlite_module_server.base_url]
    ran = CliRunner().invoke(main, ["batch", "run", str(source), *url])
    assert ran.exit_code == 0, ran.output
    batch_id = ran.stdout.split(":", 1)[0]
    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    got = CliRunner().invoke(main, ["batch", "download", batch_id, "-o", str(out), "-e", str(err), *url])
    assert got.exit_code == 0, got.output
    assert f"output: 2 lines written to {out}" in got.stdout
    assert f"error lines: 1 line written to {err}" in got.stdout
