"""``miserver serve`` and ``miserver worker`` refuse to start, with one line and before the model loads, when their
database cannot be opened or (serve) their port is taken: the same line as ``miserver db upgrade``, never a
traceback."""

from __future__ import annotations

import socket
from pathlib import Path

from click.testing import CliRunner

from miserver.cli import main

MISSING = "postgresql+psycopg://postgres@127.0.0.1:5432/miserver_no_such_database"


def test_serve_and_worker_say_the_database_cannot_be_opened(tmp_path: Path) -> None:
    for command in (["serve", "--port", "0"], ["worker"]):
        result = CliRunner().invoke(main, [*command, "--database-url", MISSING, "--data-dir", str(tmp_path)])
        assert result.exit_code == 1, result.output
        assert "cannot open the database" in result.output and "createdb NAME" in result.output, result.output
        assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1, result.output


def test_serve_says_its_port_is_taken_before_it_loads_the_model(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(main, ["serve", "--port", str(port), "--data-dir", str(tmp_path)])
    assert result.exit_code == 1, result.output
    assert f"cannot serve on 127.0.0.1:{port}" in result.output and "in use" in result.output, result.output
    assert "Traceback" not in result.output
