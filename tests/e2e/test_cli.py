"""The ``miserver`` client commands against a running server, as a user runs them (acceptance tier).

``batch run`` reports failed rows and saves both files; ordinary errors (an unknown batch, no server) are one line
and exit status 1, never a traceback.
"""

from __future__ import annotations

import gc
import json
import warnings
from pathlib import Path

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
    assert failed[0]["response"]["body"]["error"]["param"] == "temperature"

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


def test_a_failed_batch_says_why_and_exits_1(sqlite_module_server: ServerProcess, tmp_path: Path) -> None:
    source = tmp_path / "all-bad.jsonl"
    source.write_text(json.dumps(line("bad", chat_body("hi", foo=1))) + "\n")
    result = CliRunner().invoke(
        main, ["batch", "run", str(source), "--url", sqlite_module_server.base_url]
    )
    assert result.exit_code == 1
    assert ": failed, 0 completed, 1 failed of 1" in result.stdout
    assert "unknown_parameter" in result.stderr and "line 1" in result.stderr


def test_an_unknown_batch_is_one_line_not_a_traceback(sqlite_module_server: ServerProcess) -> None:
    result = CliRunner().invoke(
        main, ["batch", "status", "batch_nope", "--url", sqlite_module_server.base_url]
    )
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
