"""``miserver batch watch`` / ``batch run``'s progress (``cli.batch.wait_for_batch``) over a fake client: a bar on a
terminal, lines elsewhere."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from click.testing import CliRunner

from miserver.cli import batch as cli_batch
from miserver.cli.base import main
from miserver.cli.batch import wait_for_batch


class FakeBatches:
    """``batches.retrieve`` answering each of ``states`` ((status, completed, failed) of 64 rows) in turn."""

    def __init__(self, states: list[tuple[str, int, int]]) -> None:
        self.states = states

    def retrieve(self, batch_id: str) -> Any:
        status, completed, failed = self.states.pop(0)
        counts = SimpleNamespace(total=64, completed=completed, failed=failed)
        return SimpleNamespace(id=batch_id, status=status, request_counts=counts, model_extra={})


def test_a_batch_joined_half_way_shows_no_rate_for_the_rows_done_before(capsys: pytest.CaptureFixture[str]) -> None:
    client = SimpleNamespace(batches=FakeBatches([("in_progress", 29, 1), ("completed", 63, 1)]))
    done = wait_for_batch(client, "batch_x", poll=0, terminal=True)
    assert done.status == "completed"
    frames = [f for f in capsys.readouterr().err.split("\r") if "/64" in f]
    assert "30/64" in frames[0] and "?row/s" in frames[0], frames[0]  # the 30 rows already done are not a rate
    assert "64/64" in frames[-1] and "63 completed, 1 failed" in frames[-1], frames[-1]


def test_a_pipe_gets_a_line_per_change_and_no_bar_frames(capsys: pytest.CaptureFixture[str]) -> None:
    states = [("validating", 0, 0), ("in_progress", 10, 0), ("in_progress", 10, 0), ("completed", 62, 2)]
    client = SimpleNamespace(batches=FakeBatches(states))
    wait_for_batch(client, "batch_x", poll=0, terminal=False)
    err = capsys.readouterr().err
    assert "\r" not in err
    assert err.splitlines() == [
        "validating 0/64 rows done (0 completed, 0 failed)",
        "in_progress 10/64 rows done (10 completed, 0 failed)",
        "completed 64/64 rows done (62 completed, 2 failed)",
    ]


def test_download_of_a_running_batch_names_where_its_rows_so_far_are(monkeypatch: pytest.MonkeyPatch) -> None:
    client = SimpleNamespace(batches=FakeBatches([("in_progress", 29, 1)]))
    monkeypatch.setattr(cli_batch, "_client", lambda url: client)
    got = CliRunner().invoke(main, ["batch", "download", "batch_x", "-o", "out.jsonl"])
    assert got.exit_code == 1
    assert "batch_x is in_progress: its files exist once it has ended" in got.stderr
    assert "GET /v1/batches/batch_x/results" in got.stderr
