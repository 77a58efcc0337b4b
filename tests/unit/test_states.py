"""The batch status machine of DESIGN §4."""

from __future__ import annotations

from miserver.store import batch_states as states


def test_terminal_statuses_go_nowhere() -> None:
    for status in states.TERMINAL:
        assert states.TRANSITIONS[status] == frozenset()


def test_cancel_is_possible_before_the_end_only() -> None:
    assert set(states.CANCELLABLE) == {"validating", "in_progress", "finalizing"}


def test_guards() -> None:
    assert states.sources("completed") == ("finalizing",)
    assert states.sources("expired") == ("in_progress",)
    assert states.sources("cancelled") == ("cancelling",)
    assert not states.can_move("completed", "cancelling")
    assert states.can_move("validating", "failed")
