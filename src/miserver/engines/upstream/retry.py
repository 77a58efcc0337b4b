"""The one retry loop (:func:`send`): connect errors, timeouts and the statuses of
:data:`~.errors.RETRYABLE_STATUSES` are retried with jittered exponential backoff (at least the ``Retry-After`` the
upstream asked for), on another live upstream of the pool when there is one, until the attempts or the caller's
deadline run out."""

from __future__ import annotations

import asyncio
import email.utils
import json
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from ...errors import APIError, UpstreamTimeoutError, UpstreamUnavailableError
from .client import Upstream
from .errors import RETRYABLE_STATUSES
from .pool import UpstreamPool

log = logging.getLogger("miserver.upstream")

#: Longest ``Retry-After`` honoured, in seconds (a longer one is cut to this).
MAX_RETRY_AFTER = 60.0


@dataclass
class Answer:
    """An upstream's complete answer (any status). ``response`` is set, with its body unread, for a stream that
    answered 200: the caller reads it, then calls :meth:`close`."""

    upstream: Upstream
    status: int
    content: bytes
    headers: httpx.Headers
    response: httpx.Response | None = None

    async def close(self) -> None:
        """Close a stream's response and give its place on the upstream back (once)."""
        if self.response is not None:
            response, self.response = self.response, None
            try:
                await response.aclose()
            finally:
                self.upstream.release()


class Deferred(Exception):
    """The row was not sent to completion and is not the row's fault: the deadline (a batch's ``expires_at``) came,
    or the caller stopped. A batch leaves the row unrun."""


@dataclass(frozen=True)
class RetryPolicy:
    """``max_attempts`` per request; backoff ``base * 2**n`` seconds capped at ``cap``, jittered to 50-100%."""

    max_attempts: int = 8
    base: float = 0.5
    cap: float = 30.0

    def delay(self, attempt: int, retry_after: float | None) -> float:
        """Seconds to wait after attempt number ``attempt`` (0-based) failed; at least ``retry_after``."""
        backoff: float = min(self.cap, self.base * 2.0**attempt) * random.uniform(0.5, 1.0)
        return max(backoff, min(retry_after or 0.0, MAX_RETRY_AFTER))


def retry_after(headers: httpx.Headers) -> float | None:
    """Seconds asked by ``Retry-After`` (a number, or an HTTP date); None when absent or unreadable."""
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        seconds: float = max(0.0, float(value))
        return seconds
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


async def _attempt(upstream: Upstream, path: str, payload: bytes, request_id: str, stream: bool) -> Answer:
    """One attempt on ``upstream`` under its timeouts; holds one of its places (kept for an open stream)."""
    timeouts = upstream.timeouts
    await upstream.acquire()
    keep = False
    try:
        headers = {**upstream.headers(request_id), "Content-Type": "application/json"}
        async with asyncio.timeout(timeouts.total):
            response = await upstream.send(
                "POST", path, content=payload, headers=headers, timeout=timeouts.first_byte, stream=True
            )
            if stream and response.status_code == 200:
                keep = True
                return Answer(upstream, 200, b"", response.headers, response)
            try:
                content = await response.aread()
            finally:
                await response.aclose()
        return Answer(upstream, response.status_code, content, response.headers)
    finally:
        if not keep:
            upstream.release()


async def send(
    pool: UpstreamPool,
    path: str,
    body: Any,
    *,
    request_id: str,
    policy: RetryPolicy,
    deadline: float,
    defer_at_deadline: bool,
    stream: bool = False,
    stopped: Callable[[], bool] = lambda: False,
) -> Answer:
    """POST ``body`` (JSON) to ``path`` (under ``/v1``) on the pool, retrying as the module says.

    ``deadline`` is a ``time.monotonic()`` instant: no attempt or backoff starts that would reach past it. Returns
    the first answer that is not retried (a success, or a 4xx that is the request's own), or the last retryable
    answer once attempts run out. Raises :class:`~miserver.errors.UpstreamUnavailableError` when no member is live
    (at the start, or after the live ones failed), :class:`Deferred` when the deadline comes with
    ``defer_at_deadline`` or when ``stopped()`` answers true, and, at the deadline or after the last attempt,
    :class:`~miserver.errors.UpstreamTimeoutError` (504) when the last attempt timed out or
    :class:`~miserver.errors.UpstreamUnavailableError` when it could not reach the upstream.
    """
    payload = json.dumps(body, ensure_ascii=False).encode()
    avoid: Upstream | None = None
    last: Answer | APIError | None = None
    for attempt in range(policy.max_attempts):
        if stopped():
            raise Deferred("stopped")
        upstream = pool.pick(avoid)
        if upstream is None:
            raise UpstreamUnavailableError(
                f"No upstream serving '{pool.model}' is reachable now "
                f"({', '.join(f'{u.name}: {_why(u, pool.model)}' for u in pool.members) or 'none known'}); retry later."
            )
        wait: float | None = None
        try:
            answer = await _attempt(upstream, path, payload, request_id, stream)
        except (httpx.TimeoutException, TimeoutError):
            last = UpstreamTimeoutError(
                f"The upstream '{upstream.name}' did not answer within its timeouts "
                f"(first byte {upstream.timeouts.first_byte:g} s, idle {upstream.timeouts.idle:g} s, "
                f"total {upstream.timeouts.total:g} s)."
            )
        except httpx.TransportError as exc:
            upstream.mark_down(f"{type(exc).__name__}: {exc}")
            last = UpstreamUnavailableError(f"The upstream '{upstream.name}' could not be reached: {exc!r}.")
        else:
            if answer.status not in RETRYABLE_STATUSES:
                return answer
            last = answer
            wait = retry_after(answer.headers)
            log.info("upstream %s answered %d; retrying", upstream.name, answer.status)
        avoid = upstream
        if attempt + 1 >= policy.max_attempts:
            break
        delay = policy.delay(attempt, wait)
        if time.monotonic() + delay >= deadline:
            if defer_at_deadline:
                raise Deferred("deadline")
            break
        await asyncio.sleep(delay)
    if isinstance(last, Answer):
        return last
    assert last is not None
    raise last


def _why(upstream: Upstream, model: str) -> str:
    """Why ``upstream`` takes no row of ``model`` now (the 503's message)."""
    if upstream.last_error:
        return upstream.last_error
    if upstream.live:
        return f"it no longer lists '{model}' in GET /v1/models"
    return "not probed yet"
