"""``examples/demo.py``'s progress while the batch runs: in a log or a pipe (standard error not a terminal), plain
lines, one at each change of status and each quarter of the rows, and no progress bar's carriage returns."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo.py"


def demo_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("miserver_demo", DEMO)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Batches:
    """``client.batches`` answering ``retrieve`` with each state in turn (the last one from then on)."""

    def __init__(self, states: list[tuple[str, int, int]]) -> None:
        self.states = states

    def retrieve(self, batch_id: str) -> Any:
        status, total, completed = self.states.pop(0) if len(self.states) > 1 else self.states[0]
        counts = SimpleNamespace(total=total, completed=completed, failed=0)
        return SimpleNamespace(id=batch_id, status=status, request_counts=counts)


def test_progress_in_a_log_is_plain_lines(capsys: pytest.CaptureFixture[str]) -> None:
    states = [("validating", 0, 0), ("in_progress", 8, 0), ("in_progress", 8, 1), ("in_progress", 8, 2)]
    states += [("in_progress", 8, 3), ("in_progress", 8, 5), ("in_progress", 8, 7), ("completed", 8, 8)]
    client = SimpleNamespace(batches=Batches(states))
    batch, _ = demo_module().poll(client, "batch_1", interval=0)
    assert batch.status == "completed"
    err = capsys.readouterr().err
    assert "\r" not in err
    assert err.splitlines() == [
        "batch validating: 0/0 rows",
        "batch in_progress: 0/8 rows",
        "batch in_progress: 2/8 rows",
        "batch in_progress: 5/8 rows",
        "batch in_progress: 7/8 rows",
        "batch completed: 8/8 rows",
    ]
