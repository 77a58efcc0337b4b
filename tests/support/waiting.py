"""Waiting on a condition in an asyncio test, never on a number of loop turns or a fixed sleep.

:func:`until` (a synchronous observation) and :func:`eventually` (an awaited one, a store read for instance) poll
until the observed value satisfies the predicate and return it; when the time runs out they raise
``AssertionError`` with the last value observed, so a condition that never comes fails the test instead of letting
it go on as if it had. :func:`stays` is the opposite: it proves that something does *not* happen, by giving it a
bounded time to happen after the moment from which it could (the caller waits for that moment first).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

#: Seconds between two observations: short against any step of the tiny model, long enough not to spin a core.
INTERVAL = 0.001


def _truthy(value: object) -> bool:
    return bool(value)


async def until(
    observe: Callable[[], T],
    done: Callable[[T], bool] = _truthy,
    *,
    what: str = "the condition",
    timeout: float = 10.0,
) -> T:
    """Observe ``observe()`` every :data:`INTERVAL` seconds until ``done(value)`` is true; returns that value.

    Raises ``AssertionError`` naming ``what`` and the last value observed once ``timeout`` seconds have passed."""
    deadline = time.monotonic() + timeout
    while True:
        value = observe()
        if done(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout} s; last observed: {value!r}")
        await asyncio.sleep(INTERVAL)


async def eventually(
    observe: Callable[[], Awaitable[T]],
    done: Callable[[T], bool] = _truthy,
    *,
    what: str = "the condition",
    timeout: float = 10.0,
) -> T:
    """:func:`until` for an awaited observation (a read of the store): ``await observe()`` until ``done(value)``;
    returns that value. Raises ``AssertionError`` with the last value observed after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = await observe()
        if done(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout} s; last observed: {value!r}")
        await asyncio.sleep(INTERVAL)


async def stays(
    observe: Callable[[], T],
    holds: Callable[[T], bool],
    *,
    what: str = "the condition",
    seconds: float = 0.05,
) -> T:
    """Observe ``observe()`` every :data:`INTERVAL` seconds for ``seconds`` and require ``holds(value)`` each time;
    returns the last value. Raises ``AssertionError`` with the value at the first observation that breaks it.

    Proves a negative (no row was read ahead, a group did not close): call it once the thing could have happened,
    ``seconds`` being far longer than a build that breaks the rule needs to break it (a few loop turns)."""
    deadline = time.monotonic() + seconds
    while True:
        value = observe()
        if not holds(value):
            raise AssertionError(f"{what} no longer held; observed: {value!r}")
        if time.monotonic() > deadline:
            return value
        await asyncio.sleep(INTERVAL)
