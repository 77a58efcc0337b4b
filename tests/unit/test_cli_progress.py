"""``miserver batch watch`` / ``batch run``'s progress bar (``cli.batch.wait_for_batch``) over a fake client."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

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
    done = wait_for_batch(client, "batch_x", poll=0)
    assert done.status == "completed"
    frames = [f for f in capsys.readouterr().err.split("\r") if "/64" in f]
    assert "30/64" in frames[0] and "?row/s" in frames[0], frames[0]  # the 30 rows already done are not a rate
    assert "64/64" in frames[-1]
