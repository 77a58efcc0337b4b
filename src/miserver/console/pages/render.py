"""What every console page uses: the session and principal of the request, the CSRF check, the template renderer
(with the formatting helpers the templates call, and ``may``, whether the caller's scopes allow a console route),
and the parsing of a whole-number query value."""

from __future__ import annotations

import datetime
from typing import Any

from fastapi import Request
from fastapi.responses import HTMLResponse

from ...errors import InvalidRequestError, PermissionDeniedError
from ...protocol.batches import TERMINAL
from ...services.accounts import keys as accounts
from ...services.accounts.keys import Principal
from ...services.accounts.prices import PriceTable
from ..access import may
from ..sessions import Session
from ..state import console_state


def session_of(request: Request) -> Session:
    session = request.state.session
    assert isinstance(session, Session)
    return session


def principal_of(request: Request) -> Principal:
    principal = request.state.principal
    assert isinstance(principal, Principal)
    return principal


async def check_csrf(request: Request, form_token: str | None = None) -> None:
    """403 unless the form field ``csrf`` (or the ``X-CSRF-Token`` header) equals the session's token."""
    sent = form_token if form_token is not None else request.headers.get("x-csrf-token")
    if not sent or sent != session_of(request).csrf:
        raise PermissionDeniedError("The form's CSRF token is missing or stale: reload the page and try again.")


def render(request: Request, name: str, context: dict[str, Any], status_code: int = 200) -> HTMLResponse:
    cs = console_state(request)
    prices = cs.app_state.ctx.prices or PriceTable()
    principal = getattr(request.state, "principal", None)
    base = {
        "principal": principal,
        "may": lambda method, path: may(principal, method, path),
        "csrf": session_of(request).csrf if getattr(request.state, "session", None) else None,
        "currency": prices.currency,
        "priced": prices.enabled,
        "money": money,
        "cost": lambda micro: f"{money(micro)} {prices.currency}" if prices.enabled else "not priced",
        "size": size,
        "count": count,
        "when": when,
        "duration": duration,
        "window_label": window_label,
        "terminal": TERMINAL,
    }
    response = cs.templates.TemplateResponse(request, name, {**base, **context}, status_code=status_code)
    assert isinstance(response, HTMLResponse)
    return response


# -- formatting (used by the templates) ------------------------------------------------------------------------


def money(micro: int) -> str:
    """Micro-units as a decimal amount with 4 places (``1234567`` -> ``"1.2346"``)."""
    return f"{micro / 1_000_000:.4f}"


def size(n: int) -> str:
    """Bytes as a person reads them: ``209715200`` -> ``"200 MiB"``, ``1536`` -> ``"1.5 KiB"``, ``12`` ->
    ``"12 bytes"``."""
    if n < 1024:
        return f"{n} byte{'' if n == 1 else 's'}"
    value, units = n / 1024, ["KiB", "MiB", "GiB"]
    while value >= 1024 and len(units) > 1:
        value, units = value / 1024, units[1:]
    return f"{value:.1f}".removesuffix(".0") + f" {units[0]}"


def count(n: int) -> str:
    """A count with thousands separators: ``50000`` -> ``"50,000"``."""
    return f"{n:,}"


def when(ts: int | None) -> str:
    """Unix seconds as ``YYYY-MM-DD HH:MM:SS`` UTC (empty for None)."""
    if ts is None:
        return ""
    return datetime.datetime.fromtimestamp(ts, tz=datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")


def duration(batch: dict[str, Any]) -> str:
    """How long a job ran or has been running: from creation to its end (or now), as ``1h 02m 03s``."""
    end = next(
        (batch[k] for k in ("completed_at", "failed_at", "expired_at", "cancelled_at") if batch.get(k)),
        None,
    )
    seconds = max(0, (end or int(datetime.datetime.now(tz=datetime.UTC).timestamp())) - batch["created_at"])
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h {m:02d}m {s:02d}s" if h else (f"{m}m {s:02d}s" if m else f"{s}s")


def window_label(hours: int) -> str:
    """``24`` -> ``"24 hours (1 day)"``; ``1`` -> ``"1 hour"``."""
    text = "1 hour" if hours == 1 else f"{hours} hours"
    if hours % 24 == 0:
        days = hours // 24
        text += f" ({days} day{'s' if days > 1 else ''})"
    return text


def whole_number(value: str | None, name: str, default: int) -> int:
    if value in (None, ""):
        return default
    try:
        return int(value)
    except ValueError:
        raise InvalidRequestError(f"Invalid '{name}': expected a whole number.", param=name) from None


async def key_choices(request: Request) -> list[Any]:
    """Every key, for an admin's key filter (an empty list for anyone else)."""
    if not principal_of(request).admin or principal_of(request).key_id is None:
        return []
    return await accounts.list_keys(console_state(request).app_state.store)
