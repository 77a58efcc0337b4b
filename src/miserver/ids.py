"""Identifiers: time-ordered ids for stored objects, random ids for responses, and a clock injectable in tests."""

from __future__ import annotations

import secrets
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


def ordered_id(prefix: str) -> str:
    """``prefix`` + 12 hex digits of milliseconds + 12 random hex digits: sorts by creation time."""
    return f"{prefix}{int(time.time() * 1000):012x}{secrets.token_hex(6)}"


def random_id(prefix: str) -> str:
    """``prefix`` + 24 random hex digits (response ids: ``chatcmpl-``, ``req_``, ``batch_req_``)."""
    return f"{prefix}{secrets.token_hex(12)}"
