"""Console sessions: an API key exchanged for a random session id kept in an HttpOnly, SameSite=Strict cookie, a
CSRF token per session, and a limit on wrong keys per client address.

Sessions live in this process's memory (a restart signs everyone out; each ``miserver serve`` process has its own).
A session keeps the key's id, never the key itself nor its scopes; every request re-reads the key, so a revoked key
ends its sessions at once and the session always acts with the key's scopes as they are.
"""

from __future__ import annotations

import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

#: Name of the session cookie.
COOKIE = "miserver_console"
#: Name of the cookie that carries the sign-in form's CSRF token before any session exists (double submit).
SIGNIN_COOKIE = "miserver_console_signin"
#: How long a session lasts without use (seconds).
SESSION_SECONDS = 12 * 3600
#: Wrong keys allowed per client address within :data:`FAILURE_WINDOW_SECONDS`.
MAX_FAILURES = 5
FAILURE_WINDOW_SECONDS = 60.0
#: The most sessions kept at once; beyond it the session closest to expiry is dropped (bounded memory).
MAX_SESSIONS = 10_000


@dataclass
class Session:
    """A signed-in browser: ``token`` (the cookie's value), ``key_id`` (None: the server had no key, the console's
    single user), ``csrf`` (the token every form and script request must send back) and ``expires_at`` (monotonic
    seconds)."""

    token: str
    key_id: str | None
    csrf: str
    expires_at: float


class Sessions:
    """The sessions of this process, by token. ``clock`` is monotonic seconds (injectable for tests)."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        lifetime: float = SESSION_SECONDS,
        max_sessions: int = MAX_SESSIONS,
    ) -> None:
        self._clock = clock
        self._lifetime = lifetime
        self._max = max_sessions
        self._by_token: dict[str, Session] = {}

    def create(self, key_id: str | None) -> Session:
        """A new session for ``key_id`` with fresh random token and CSRF token (32 bytes each); when
        ``max_sessions`` are kept already, the one closest to expiry is dropped first."""
        self._sweep()
        if len(self._by_token) >= self._max:
            oldest = min(self._by_token.values(), key=lambda s: s.expires_at)
            del self._by_token[oldest.token]
        session = Session(
            token=secrets.token_urlsafe(32),
            key_id=key_id,
            csrf=secrets.token_urlsafe(32),
            expires_at=self._clock() + self._lifetime,
        )
        self._by_token[session.token] = session
        return session

    def get(self, token: str | None) -> Session | None:
        """The live session of ``token`` (its lifetime renewed), or None (unknown, expired or no token)."""
        if not token:
            return None
        session = self._by_token.get(token)
        if session is None:
            return None
        if session.expires_at <= self._clock():
            del self._by_token[token]
            return None
        session.expires_at = self._clock() + self._lifetime
        return session

    def drop(self, token: str | None) -> None:
        """End the session of ``token`` (sign-out; nothing when unknown)."""
        if token:
            self._by_token.pop(token, None)

    def _sweep(self) -> None:
        at = self._clock()
        for token in [t for t, s in self._by_token.items() if s.expires_at <= at]:
            del self._by_token[token]


class FailureLimit:
    """Wrong sign-in keys per client address: at most ``limit`` within ``window`` seconds; after that
    :meth:`retry_after` says how long the address must wait."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        limit: int = MAX_FAILURES,
        window: float = FAILURE_WINDOW_SECONDS,
    ) -> None:
        self._clock = clock
        self._limit = limit
        self._window = window
        self._failures: dict[str, deque[float]] = {}

    def _recent(self, address: str) -> deque[float]:
        times = self._failures.setdefault(address, deque())
        horizon = self._clock() - self._window
        while times and times[0] <= horizon:
            times.popleft()
        return times

    def retry_after(self, address: str) -> int:
        """Whole seconds until ``address`` may try again (0: it may try now)."""
        times = self._recent(address)
        if len(times) < self._limit:
            return 0
        return max(1, int(times[0] + self._window - self._clock() + 0.999))

    def failed(self, address: str) -> None:
        """Count one wrong key from ``address``."""
        self._recent(address).append(self._clock())

    def succeeded(self, address: str) -> None:
        """Forget ``address``'s failures (a right key)."""
        self._failures.pop(address, None)
