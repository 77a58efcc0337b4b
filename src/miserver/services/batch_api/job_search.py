"""What the web console (``console/``) reads: searched pages of batch jobs with their cost, one job with its
files, and the usage of a time range as a day-by-model grid. The console calls these (and the other services),
never the store.

Money is in integer micro-units of the price table's currency; days are UTC ``YYYY-MM-DD``.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass, field
from typing import Any

from ...errors import InvalidRequestError
from ...protocol.batches import BATCH_STATUSES
from ...store import Store
from ...store import batches as store_batches
from ...store.batches import BatchRecord
from ..accounts import keys as accounts
from ..accounts.prices import cost, price_from_snapshot
from ..accounts.rollups import usage_rollup
from .batches import batch_object, not_found

#: Jobs per page of the console's list.
PAGE_SIZE = 25
#: The longest search text accepted (characters).
MAX_SEARCH_CHARS = 200
#: The longest usage range (days) the console draws.
MAX_USAGE_DAYS = 366


@dataclass(frozen=True)
class Job:
    """One batch as the console shows it: the Batch object (``batch``) and its cost so far (micro-units, at the
    batch prices it kept at creation; 0 on a server without prices)."""

    batch: dict[str, Any]
    cost: int


@dataclass(frozen=True)
class JobPage:
    """A page of jobs, newest first: ``jobs``, ``total`` (jobs matching the filters), ``page`` (1-based) and
    ``pages`` (at least 1)."""

    jobs: list[Job]
    total: int
    page: int
    pages: int


def job_cost(record: BatchRecord) -> int:
    """The cost of a batch's recorded usage at its kept batch prices (micro-units)."""
    price = price_from_snapshot(record.prices, record.model or "")
    return cost(price, record.input_tokens, record.output_tokens)


def check_filters(text: str | None, status: str | None, page: int) -> None:
    """400 naming the field for a search text over 200 characters, an unknown status, or a page below 1."""
    if text is not None and len(text) > MAX_SEARCH_CHARS:
        raise InvalidRequestError(f"Invalid 'q': at most {MAX_SEARCH_CHARS} characters.", param="q")
    if status is not None and status not in BATCH_STATUSES:
        raise InvalidRequestError(
            f"Invalid 'status': {status!r}. Use one of {', '.join(BATCH_STATUSES)}.", param="status"
        )
    if page < 1:
        raise InvalidRequestError("Invalid 'page': must be 1 or more.", param="page")


async def search_jobs(
    store: Store, *, text: str | None, status: str | None, key: str | None, page: int, per_page: int = PAGE_SIZE
) -> JobPage:
    """The current caller's jobs (an admin's: everyone's, or the key ``key``'s) whose id or metadata (the
    description) contains ``text`` (case-insensitive), with status ``status`` (None: any), newest first, page
    ``page`` of ``per_page``. A non-admin's ``key`` other than its own is ignored (it sees only its own jobs).
    Raises 400 (:func:`check_filters`)."""
    text = (text or "").strip() or None
    check_filters(text, status, page)
    scope = accounts.scope()
    owner = scope if scope is not None else key
    escaped = json.dumps(text)[1:-1] if text else None  # metadata is stored as JSON text
    async with store.read() as conn:
        records, total = await store_batches.search_batches(
            conn,
            text=escaped,
            statuses=(status,) if status else None,
            owner=owner,
            limit=per_page,
            offset=(page - 1) * per_page,
        )
    pages = max(1, -(-total // per_page))
    return JobPage([Job(batch_object(r), job_cost(r)) for r in records], total, page, pages)


async def get_job(store: Store, batch_id: str) -> Job:
    """One job of the current caller; 404 ``not_found`` for no such batch or another key's."""
    async with store.read() as conn:
        record = await store_batches.get_batch(conn, batch_id)
    if record is None or not accounts.visible(record.owner_key_id):
        raise not_found(batch_id)
    return Job(batch_object(record), job_cost(record))


# -- usage ---------------------------------------------------------------------------------------------------------


def parse_day(value: str | None, default: datetime.date, param: str) -> datetime.date:
    """A ``YYYY-MM-DD`` day (``default`` when empty); 400 naming ``param`` otherwise."""
    if not value:
        return default
    try:
        return datetime.date.fromisoformat(value)
    except ValueError:
        raise InvalidRequestError(f"Invalid '{param}': {value!r}. Use a day as YYYY-MM-DD.", param=param) from None


@dataclass
class UsageGrid:
    """Usage of the days ``days`` (every day of the range, zero-filled) by model: ``cells[(day, model)]`` holds
    ``{requests, input_tokens, output_tokens, cost}``; ``models`` sorted; ``totals`` over everything."""

    days: list[str]
    models: list[str]
    cells: dict[tuple[str, str], dict[str, int]] = field(default_factory=dict)
    totals: dict[str, int] = field(default_factory=dict)

    def value(self, day: str, model: str, metric: str) -> int:
        """``tokens`` (input + output) or ``cost`` of one cell (0 for a day without usage)."""
        cell = self.cells.get((day, model))
        if cell is None:
            return 0
        return cell["input_tokens"] + cell["output_tokens"] if metric == "tokens" else cell["cost"]


async def usage_grid(
    store: Store,
    *,
    start: datetime.date,
    end: datetime.date,
    kind: str | None,
    key: str | None,
    model: str | None,
    currency: str,
) -> UsageGrid:
    """The current caller's usage (an admin's: any key's, or ``key``'s) from ``start`` to ``end`` inclusive, per day
    and model, through :func:`~miserver.services.accounts.usage_rollup` (so the same access rules). Raises
    400 for an
    end before the start or a range over 366 days, 404 for another key's ``key`` (non-admin)."""
    if end < start:
        raise InvalidRequestError("Invalid 'end': the range ends before it starts.", param="end")
    if (end - start).days + 1 > MAX_USAGE_DAYS:
        raise InvalidRequestError(f"Invalid 'start': at most {MAX_USAGE_DAYS} days at once.", param="start")
    days = [(start + datetime.timedelta(days=i)).isoformat() for i in range((end - start).days + 1)]

    async def rollup(group_by: str, name: str | None) -> list[dict[str, Any]]:
        answer = await usage_rollup(
            store, group_by=group_by, start=days[0], end=days[-1], key=key, model=name, kind=kind, currency=currency
        )
        data: list[dict[str, Any]] = answer["data"]
        return data

    by_model = await rollup("model", model)
    models = sorted(str(item["model"]) for item in by_model)
    grid = UsageGrid(days=days, models=models)
    for name in models:
        for item in await rollup("day", name):
            grid.cells[(str(item["day"]), name)] = {
                k: int(item[k]) for k in ("requests", "input_tokens", "output_tokens", "cost")
            }
    totals = {"requests": 0, "input_tokens": 0, "output_tokens": 0, "cost": 0}
    for cell in grid.cells.values():
        for k in totals:
            totals[k] += cell[k]
    grid.totals = totals
    return grid


def realtime_equivalent(batch_cost: int, batch_discount: float) -> int:
    """What batch usage that cost ``batch_cost`` would have cost at realtime prices (batch prices are the realtime
    price times ``batch_discount``); equal to ``batch_cost`` when the discount is 0 or 1."""
    if batch_discount <= 0 or batch_discount >= 1:
        return batch_cost
    return round(batch_cost / batch_discount)
