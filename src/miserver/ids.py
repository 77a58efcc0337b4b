"""Identifiers: time-ordered ids for stored objects and random ids for responses."""

from __future__ import annotations

import secrets
import time


def ordered_id(prefix: str) -> str:
    """``prefix`` + 12 hex digits of milliseconds + 12 random hex digits: sorts by creation time."""
    return f"{prefix}{int(time.time() * 1000):012x}{secrets.token_hex(6)}"


def random_id(prefix: str) -> str:
    """``prefix`` + 24 random hex digits (response ids: ``chatcmpl-``, ``req_``, ``batch_req_``)."""
    return f"{prefix}{secrets.token_hex(12)}"
