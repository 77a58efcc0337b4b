"""The batch runner's balance verdict: before each chunk, whether a batch goes on, waits or ends ``failed`` because
of its owner key (revoked, or out of balance past the grace)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...store import keys as store_keys


@dataclass(frozen=True)
class BatchStop:
    """Why a running batch ends ``failed`` because of its key: ``code`` (also the unrun rows' code) and
    ``message``."""

    code: str
    message: str

    def as_batch_error(self) -> dict[str, object]:
        """The ``batch.errors.data`` entry."""
        return {"code": self.code, "message": self.message, "param": None, "line": None}


@dataclass(frozen=True)
class BatchVerdict:
    """The owner key's say on a running batch before a chunk: ``fail`` (end it now), ``waiting`` (run nothing:
    ``insufficient_balance``), or neither (go on)."""

    fail: BatchStop | None = None
    waiting: bool = False


def batch_verdict(key: store_keys.KeyRecord | None, batch: Any, *, now: int, grace_seconds: float) -> BatchVerdict:
    """Pure rule: a missing or revoked key fails the batch (``key_revoked``); a balance at zero or below makes it
    wait (``insufficient_balance``) and, once it has waited ``grace_seconds`` (since ``batch.balance_waiting_since``;
    0: at once), fails it (``insufficient_quota``); otherwise it goes on."""
    if key is None or key.revoked_at is not None:
        return BatchVerdict(
            fail=BatchStop(
                "key_revoked",
                "The API key that created this batch was revoked; the batch stopped. Completed requests are in the "
                "output file and were billed; the others were not run and cost nothing.",
            )
        )
    if key.balance is None or key.balance > 0:
        return BatchVerdict()
    since = batch.balance_waiting_since
    if grace_seconds <= 0 or (since is not None and now - since >= grace_seconds):
        return BatchVerdict(
            fail=BatchStop(
                "insufficient_quota",
                f"The balance of this batch's API key ran out ({key.balance} micro-units) and was not topped up "
                "in time. Completed requests are in the output file and were billed; the others were not run and "
                "cost nothing.",
            )
        )
    return BatchVerdict(waiting=True)
