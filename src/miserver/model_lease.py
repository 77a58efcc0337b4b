"""Leases on the resident model (DESIGN §3.5): one holder at a time, with a time to live.

A lease is held in the memory of the process that owns the engine, so a restart ends every lease, as the contract
asks. Load, unload, weight writes and checkpoint operations need the lease when one is held; a running batch holds
one (holder ``millm-batch:<id>``) or runs under the lease its caller handed it.

A lease belongs to the key that took it (``owner``; a batch's own lease to the batch's owner). Its holder names an
object of that tenant, so anyone else reads it as a neutral word (:func:`shown_holder`), in error messages too, and
the same holder name renews a lease only for its owner.
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from .errors import ConflictError, InvalidRequestError, NotFoundError

BATCH_HOLDER_PREFIX = "millm-batch:"
#: What another tenant reads for a batch's own lease holder, and for any other holder.
NEUTRAL_BATCH_HOLDER = "millm-batch"
NEUTRAL_HOLDER = "another holder"
#: The form of every lease token :meth:`LeaseManager.acquire` hands out (``lease_`` and 24 hex digits).
TOKEN_FORM = re.compile(r"lease_[0-9a-f]{24}")
MIN_TTL_SECONDS = 1
MAX_TTL_SECONDS = 86_400


@dataclass(frozen=True)
class Lease:
    """``lease`` is the token a holder sends back (``X-miLLM-Lease``); ``expires_at`` is Unix seconds (float);
    ``owner`` is the key id that took it (None on a server with no keys)."""

    lease: str
    holder: str
    ttl_seconds: float
    expires_at: float
    owner: str | None = None

    def as_json(self) -> dict[str, object]:
        return {
            "lease": self.lease,
            "holder": self.holder,
            "ttl_seconds": self.ttl_seconds,
            "expires_at": int(self.expires_at),
        }


def shown_holder(lease: Lease, scope: str | None) -> str:
    """The holder of ``lease`` as a caller whose owner filter is ``scope`` may read it: as it is when ``scope`` is
    None (an admin, or a server with no keys) or the lease is the caller's own; else :data:`NEUTRAL_BATCH_HOLDER` for
    a batch's own lease and :data:`NEUTRAL_HOLDER` for any other, so that no tenant learns another's ids."""
    if scope is None or lease.owner == scope:
        return lease.holder
    return NEUTRAL_BATCH_HOLDER if lease.holder.startswith(BATCH_HOLDER_PREFIX) else NEUTRAL_HOLDER


def new_token() -> str:
    """A fresh lease token, of the form :data:`TOKEN_FORM`."""
    return "lease_" + secrets.token_hex(12)


def is_token(value: str) -> bool:
    """Whether ``value`` has the form of a lease token (:data:`TOKEN_FORM`); whether it is live is another matter."""
    return TOKEN_FORM.fullmatch(value) is not None


def check_ttl(ttl: float) -> float:
    if not MIN_TTL_SECONDS <= ttl <= MAX_TTL_SECONDS:
        raise InvalidRequestError(
            f"Invalid 'ttl_seconds': {ttl}. Use {MIN_TTL_SECONDS}-{MAX_TTL_SECONDS} seconds.", param="ttl_seconds"
        )
    return ttl


class LeaseManager:
    """The lease of the resident model of this process. ``clock`` returns Unix seconds (injectable in tests)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._lease: Lease | None = None

    def current(self) -> Lease | None:
        """The live lease, or None (an expired lease is dropped)."""
        if self._lease is not None and self._lease.expires_at <= self._clock():
            self._lease = None
        return self._lease

    def acquire(self, holder: str, ttl_seconds: float, owner: str | None = None) -> Lease:
        """Take the lease for ``holder`` on behalf of the key ``owner``. The same holder of the same owner taking it
        again renews it.

        Raises :class:`ConflictError` (409 ``lease_held``) while another holder's lease, or another owner's, is live;
        the message names the holder only to its owner (:func:`shown_holder`).
        """
        if not holder:
            raise InvalidRequestError("Invalid 'holder': a non-empty string is required.", param="holder")
        ttl = check_ttl(ttl_seconds)
        live = self.current()
        if live is not None and (live.holder != holder or live.owner != owner):
            raise ConflictError(
                f"The model is leased by '{shown_holder(live, owner)}' until {int(live.expires_at)}.",
                param="holder",
                code="lease_held",
            )
        token = live.lease if live is not None else new_token()
        self._lease = Lease(token, holder, ttl, self._clock() + ttl, owner)
        return self._lease

    def get(self, lease: str) -> Lease:
        """The live lease named ``lease``; 404 ``lease_not_found`` if it is not the live one."""
        live = self.current()
        if live is None or live.lease != lease:
            raise NotFoundError(f"No live lease {lease!r}.", param="lease", code="lease_not_found")
        return live

    def renew(self, lease: str, ttl_seconds: float | None = None) -> Lease:
        """Push the live lease's expiry ``ttl_seconds`` (default: its own TTL) from now."""
        live = self.get(lease)
        ttl = check_ttl(ttl_seconds) if ttl_seconds is not None else live.ttl_seconds
        self._lease = Lease(live.lease, live.holder, ttl, self._clock() + ttl, live.owner)
        return self._lease

    def release(self, lease: str) -> None:
        """End the live lease ``lease`` (404 if it is not the live one)."""
        self.get(lease)
        self._lease = None

    def require(self, lease: str | None, owner: str | None = None) -> None:
        """For load, unload and weight operations: when a lease is held, the caller (the key ``owner``) must present
        it (409 otherwise; the message names the holder only to its owner)."""
        live = self.current()
        if live is not None and live.lease != lease:
            raise ConflictError(
                f"The model is leased by '{shown_holder(live, owner)}'; send its lease in X-miLLM-Lease.",
                param="X-miLLM-Lease",
                code="lease_held",
            )
