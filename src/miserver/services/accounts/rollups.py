"""Usage roll-ups: the usage records of a key (an admin's: of any key) summed per day, model, kind or endpoint."""

from __future__ import annotations

import datetime
from typing import Any

from ...errors import InvalidRequestError, NotFoundError
from ...protocol.accounts import UsageRow
from ...store import Store
from ...store import usage as store_usage
from ...store.usage import GROUPS
from . import keys as accounts


def check_usage_query(group_by: str, kind: str | None, start: str | None, end: str | None) -> None:
    """``GET /api/usage`` parameters: ``group_by`` one of day/model/key, ``kind`` realtime/batch, days as
    ``YYYY-MM-DD``; else 400 naming the parameter."""
    if group_by not in GROUPS:
        raise InvalidRequestError(
            f"Invalid 'group_by': {group_by!r}. Use one of {', '.join(GROUPS)}.", param="group_by"
        )
    if kind is not None and kind not in ("realtime", "batch"):
        raise InvalidRequestError(f"Invalid 'kind': {kind!r}. Use 'realtime' or 'batch'.", param="kind")
    for name, value in (("start", start), ("end", end)):
        if value is None:
            continue
        try:
            datetime.date.fromisoformat(value)
        except ValueError:
            raise InvalidRequestError(f"Invalid '{name}': {value!r}. Use a day as YYYY-MM-DD.", param=name) from None


async def usage_rollup(
    store: Store,
    *,
    group_by: str,
    start: str | None,
    end: str | None,
    key: str | None,
    model: str | None,
    kind: str | None,
    currency: str,
) -> dict[str, Any]:
    """The usage rollup the current caller may read: its own key's (a ``key`` naming another key is refused with
    404, as if it did not exist), or any key's for an admin. Returns ``{object: "list", group_by, currency, data}``."""
    check_usage_query(group_by, kind, start, end)
    s = accounts.scope()
    if s is not None and key is not None and key != s:
        raise NotFoundError(f"No such API key: {key}", param="key", code="not_found")
    key_filter = key if s is None else s
    async with store.read() as conn:
        data = await store_usage.rollup(
            conn, group_by=group_by, start=start, end=end, key_id=key_filter, model=model, kind=kind
        )
    rows = [UsageRow(**row).model_dump(exclude_unset=True) for row in data]  # only the group_by's group field
    return {"object": "list", "group_by": group_by, "currency": currency, "data": rows}
