"""The ETA at a batch's creation: a batch whose estimated time to finish exceeds its window is refused,
unless its create sends ``millm_allow_late: true``."""

from __future__ import annotations

import json

from sqlalchemy.ext.asyncio import AsyncConnection

from ...errors import InvalidRequestError
from ...scheduling import policy as scheduling
from ...store import batches as store_batches
from ...store import operations as store_operations


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


async def check_on_time(
    conn: AsyncConnection, *, input_file_id: str, endpoint: str, priority: int, window_seconds: int
) -> None:
    """Refuse (400 ``completion_window_too_short``, param ``completion_window``) a new batch whose estimated time to
    finish exceeds its window: its rows (the input file's lines) plus the rows ahead of it
    (:func:`~miserver.scheduling.policy.estimate_new`), at the measured rate of its model (the first line's) and
    endpoint. No estimate, no refusal: nothing is refused before a rate was measured."""
    rates = await store_operations.rates(conn)
    known = {m: r for (m, e), r in rates.items() if e == endpoint}
    if not known:
        return
    rows, first = await store_operations.file_lines(conn, input_file_id)
    model = _model_of(first)
    rate = known.get(model) if model is not None else None
    if rate is None:
        rate = max(known.values(), key=lambda r: r.rows_per_second)
    active = [b for b in await store_batches.active_batches(conn) if b.status == "in_progress"]
    pending = await store_operations.pending_by_batch(conn, [b.id for b in active])
    others = []
    for b in active:
        other = rates.get((b.model or "", b.endpoint))
        candidate = scheduling.Candidate(
            id=b.id,
            priority=b.priority,
            created_at=b.created_at,
            expires_at=b.expires_at,
            pending=pending[b.id],
            owner=b.owner_key_id or b.id,
        )
        others.append((candidate, other.rows_per_second if other is not None else None))
    estimate = scheduling.estimate_new(rows, priority=priority, rate=rate.rows_per_second, others=others)
    if estimate > window_seconds:
        ahead = sum(c.pending for c, _ in others if c.priority >= priority)
        raise InvalidRequestError(
            f"The batch would not finish in its completion window: estimated {_duration(estimate)} "
            f"({rows} rows at {rate.rows_per_second:.2f} rows/s measured on {rate.model}, with {ahead} rows of other "
            f"batches ahead or alongside) against a window of {_duration(window_seconds)}. Use a longer "
            'completion_window, or send "millm_allow_late": true to run it anyway (it may expire).',
            param="completion_window",
            code="completion_window_too_short",
        )


def _model_of(first_line: bytes) -> str | None:
    try:
        line = json.loads(first_line)
    except ValueError:
        return None
    body = line.get("body") if isinstance(line, dict) else None
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) else None
