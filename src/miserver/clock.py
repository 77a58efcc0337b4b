"""The clock: integer Unix seconds and milliseconds read from one injectable source (tests replace it)."""

from __future__ import annotations

import time
from collections.abc import Callable

#: Seconds since the epoch; tests replace it through :func:`set_clock`.
_clock: Callable[[], float] = time.time


def now() -> int:
    """Current time in integer Unix seconds (from the injectable clock)."""
    return int(_clock())


def now_ms() -> int:
    """Current time in integer Unix milliseconds (from the injectable clock)."""
    return int(_clock() * 1000)


def set_clock(clock: Callable[[], float] | None) -> None:
    """Replace the clock (``None`` restores ``time.time``)."""
    global _clock
    _clock = clock or time.time
