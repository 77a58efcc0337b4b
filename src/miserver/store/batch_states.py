"""The batch status machine of DESIGN §4, as data (pure: no I/O)."""

from __future__ import annotations

from typing import Final

from ..protocol.batches import TERMINAL

__all__ = ["CANCELLABLE", "TERMINAL", "TRANSITIONS", "can_move", "sources"]

#: status -> statuses it may move to.
TRANSITIONS: Final[dict[str, frozenset[str]]] = {
    "validating": frozenset({"failed", "in_progress", "cancelling"}),
    # in_progress -> failed: the owner's key was revoked, or its balance ran out past the grace
    "in_progress": frozenset({"finalizing", "expired", "cancelling", "failed"}),
    "finalizing": frozenset({"completed", "cancelling"}),
    "cancelling": frozenset({"cancelled"}),
    "completed": frozenset(),
    "failed": frozenset(),
    "expired": frozenset(),
    "cancelled": frozenset(),
}

#: Statuses from which a cancel request moves the batch to ``cancelling``.
CANCELLABLE: Final = tuple(s for s, nxt in TRANSITIONS.items() if "cancelling" in nxt)


def sources(to: str) -> tuple[str, ...]:
    """Every status that may move to ``to`` (the guard of the UPDATE that performs the move)."""
    return tuple(sorted(s for s, nxt in TRANSITIONS.items() if to in nxt))


def can_move(frm: str, to: str) -> bool:
    return to in TRANSITIONS.get(frm, frozenset())
