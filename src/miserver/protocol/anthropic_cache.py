"""``cache_control`` of Anthropic's Messages API: a prompt caching breakpoint, which a request may set at its top
level, on a content block (of ``messages`` or ``system``) and on a tool.

By Anthropic's definition a breakpoint changes nothing in the answer, only what a later request may read from a
cache. The resident engine reuses shared prompt prefixes by itself, breakpoint or not, and counts every prompt token
alike: a well-formed breakpoint is accepted without effect (``usage`` reports
``cache_creation_input_tokens`` and ``cache_read_input_tokens`` as 0); any other value is 400 ``invalid_value``
naming the field (``messages[0].content[1].cache_control``), in both modes, as Anthropic refuses it.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator
from pydantic_core import PydanticCustomError

#: The ``ttl`` values of a breakpoint (Anthropic's default is ``5m``).
CACHE_TTLS = ("5m", "1h")


def _check_cache_control(value: Any) -> Any:
    """``value`` unchanged when it is None or ``{"type": "ephemeral"}`` with an optional ``ttl`` of
    :data:`CACHE_TTLS`; otherwise a ``PydanticCustomError`` ``invalid_value`` (400 naming the field)."""
    if value is None:
        return None
    if (
        isinstance(value, dict)
        and value.get("type") == "ephemeral"
        and set(value) <= {"type", "ttl"}
        and value.get("ttl", CACHE_TTLS[0]) in CACHE_TTLS
    ):
        return value
    raise PydanticCustomError(
        "invalid_value",
        'expected {"type": "ephemeral"}, with an optional "ttl" of "5m" or "1h", and no other field.',
    )


#: A ``cache_control`` field: None (absent) or a well-formed breakpoint, accepted without effect.
CacheControl = Annotated[Any, AfterValidator(_check_cache_control)]
