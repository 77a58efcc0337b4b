"""The console's pages (thin: each reads the form or query, calls services, renders a template): sign-in and
sign-out, the job list (search, status and key filters in the URL), one job's row (live refresh), cancel,
downloads, the create page with its upload and cost estimate, the job detail with its results tab, and usage.
"""

from __future__ import annotations

import csv
import datetime
import io
import json
from typing import Any
from urllib.parse import urlencode

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response, StreamingResponse

from ..api.upload import receive_batch_upload
from ..errors import APIError, AuthenticationError, InvalidRequestError, PermissionDeniedError
from ..protocol.batches import BATCH_ENDPOINTS, BATCH_STATUSES, TERMINAL
from ..services.accounts import keys as accounts
from ..services.accounts.keys import Principal
from ..services.accounts.prices import PriceTable
from ..services.batch_api import batches as batches_service
from ..services.batch_api import files, operations
from ..services.batch_api import job_search as console
from ..services.batch_api.estimates import estimate_file_cost
from ..services.inference.checks import MAX_METADATA_VALUE_CHARS
from .sessions import COOKIE, SIGNIN_COOKIE, Session
from .state import console_state, safe_next, set_session_cookie

router = APIRouter()

#: Result lines per page of the results tab.
RESULTS_PAGE = 50
#: Validation errors shown on the detail page.
MAX_SHOWN_ERRORS = 1000
#: Longest description accepted (characters), as ``metadata`` values.
MAX_DESCRIPTION = MAX_METADATA_VALUE_CHARS


def _session(request: Request) -> Session:
    session = request.state.session
    assert isinstance(session, Session)
    return session


def _principal(request: Request) -> Principal:
    principal = request.state.principal
    assert isinstance(principal, Principal)
    return principal


async def _check_csrf(request: Request, form_token: str | None = None) -> None:
    """403 unless the form field ``csrf`` (or the ``X-CSRF-Token`` header) equals the session's token."""
    sent = form_token if form_token is not None else request.headers.get("x-csrf-token")
    if not sent or sent != _session(request).csrf:
        raise PermissionDeniedError("The form's CSRF token is missing or stale: reload the page and try again.")


def _render(request: Request, name: str, context: dict[str, Any], status_code: int = 200) -> HTMLResponse:
    cs = console_state(request)
    base = {
        "principal": getattr(request.state, "principal", None),
        "csrf": _session(request).csrf if getattr(request.state, "session", None) else None,
        "currency": (cs.app_state.ctx.prices or PriceTable()).currency,
        "money": money,
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


def window_choices(max_hours: int) -> list[int]:
    """The completion windows the create page offers: 1, 2, 6, 12 hours, then whole days, up to the server's
    longest window."""
    hours = [h for h in (1, 2, 6, 12) if h <= max_hours]
    hours += [d * 24 for d in range(1, max_hours // 24 + 1)]
    if max_hours not in hours:
        hours.append(max_hours)
    return hours


# -- sign-in ---------------------------------------------------------------------------------------------------


@router.get("/signin", response_class=HTMLResponse)
async def signin_page(request: Request, next: str | None = None) -> HTMLResponse:
    """The sign-in form (an API key) with a CSRF token bound to a short-lived cookie."""
    return _signin(request, next, None, 200)


def _signin(request: Request, next_url: str | None, message: str | None, status: int) -> HTMLResponse:
    import secrets

    token = secrets.token_urlsafe(32)
    response = _render(
        request, "signin.html", {"next": safe_next(next_url), "signin_csrf": token, "message": message}, status
    )
    response.set_cookie(SIGNIN_COOKIE, token, httponly=True, samesite="strict", path="/console", max_age=3600)
    return response


@router.post("/signin", response_model=None)
async def signin(request: Request) -> Response:
    """Exchange a key for a session: a right key sets the session cookie and goes on to ``next``; a wrong one is
    refused (401) with a message, and after 5 wrong keys in a minute from one address the form answers 429."""
    cs = console_state(request)
    form = await request.form()
    next_url = safe_next(str(form.get("next") or ""))
    if not form.get("csrf") or form.get("csrf") != request.cookies.get(SIGNIN_COOKIE):
        return _signin(request, next_url, "The form expired: please sign in again.", 403)
    address = request.client.host if request.client else "unknown"
    wait = cs.failures.retry_after(address)
    if wait:
        response = _signin(request, next_url, f"Too many wrong keys: try again in {wait} seconds.", 429)
        response.headers["retry-after"] = str(wait)
        return response
    key = str(form.get("api_key") or "").strip()
    try:
        principal = await accounts.principal_for(cs.app_state.store, key or None)
    except AuthenticationError as exc:
        cs.failures.failed(address)
        return _signin(request, next_url, exc.message, 401)
    cs.failures.succeeded(address)
    session = cs.sessions.create(principal.key_id)
    redirect = RedirectResponse(next_url, status_code=303)
    set_session_cookie(redirect, session, request.url.scheme == "https")
    redirect.delete_cookie(SIGNIN_COOKIE, path="/console")
    return redirect


@router.post("/signout", response_model=None)
async def signout(request: Request) -> Response:
    """End the session and clear its cookie."""
    form = await request.form()
    await _check_csrf(request, str(form.get("csrf") or ""))
    console_state(request).sessions.drop(request.cookies.get(COOKIE))
    response = RedirectResponse("/console/signin", status_code=303)
    response.delete_cookie(COOKIE, path="/")
    return response


# -- jobs ------------------------------------------------------------------------------------------------------


def _int(value: str | None, name: str, default: int) -> int:
    if value in (None, ""):
        return default
    try:
        return int(value)
    except ValueError:
        raise InvalidRequestError(f"Invalid '{name}': expected a whole number.", param=name) from None


async def _keys(request: Request) -> list[Any]:
    """Every key, for an admin's key filter (an empty list for anyone else)."""
    if not _principal(request).admin or _principal(request).key_id is None:
        return []
    return await accounts.list_keys(console_state(request).app_state.store)


@router.get("/", response_class=HTMLResponse)
async def job_list(
    request: Request, q: str | None = None, status: str | None = None, key: str | None = None, page: str | None = None
) -> HTMLResponse:
    """The job list: newest first, searched by description or id, filtered by status (and key, for admins)."""
    store = console_state(request).app_state.store
    found = await console.search_jobs(store, text=q, status=status or None, key=key or None, page=_int(page, "page", 1))
    filters = {k: v for k, v in {"q": q or "", "status": status or "", "key": key or ""}.items() if v}
    return _render(
        request,
        "jobs.html",
        {
            "found": found,
            "q": q or "",
            "status": status or "",
            "key": key or "",
            "statuses": BATCH_STATUSES,
            "keys": await _keys(request),
            "here": "/console/" + (f"?{urlencode({**filters, 'page': found.page})}"),
            "page_url": lambda n: "/console/?" + urlencode({**filters, "page": n}),
        },
    )


@router.get("/batches/{batch_id}/row", response_class=HTMLResponse)
async def job_row(request: Request, batch_id: str, next: str | None = None) -> HTMLResponse:
    """One job's row of the list (the live refresh of a row whose status changed)."""
    job = await console.get_job(console_state(request).app_state.store, batch_id)
    return _render(request, "_row.html", {"job": job, "here": safe_next(next)})


@router.post("/batches/{batch_id}/cancel", response_model=None)
async def cancel(request: Request, batch_id: str) -> Response:
    """Cancel a job (form with ``csrf`` and ``next``), then back to ``next``."""
    form = await request.form()
    await _check_csrf(request, str(form.get("csrf") or ""))
    st = console_state(request).app_state
    await batches_service.cancel_batch(st.store, batch_id)
    st.runner.wake()
    return RedirectResponse(safe_next(str(form.get("next") or "")), status_code=303)


@router.get("/files/{file_id}/content", response_model=None)
async def download(request: Request, file_id: str) -> Response:
    """A file's exact bytes as a download (``Content-Disposition: attachment``)."""
    record, content = await files.open_content(console_state(request).app_state.store, file_id)
    name = (record.filename or f"{file_id}.jsonl").replace('"', "")
    return StreamingResponse(
        content,
        media_type="application/jsonl",
        headers={"Content-Length": str(record.bytes), "Content-Disposition": f'attachment; filename="{name}"'},
    )


# -- create ----------------------------------------------------------------------------------------------------


@router.get("/batches/new", response_class=HTMLResponse)
async def create_page(request: Request) -> HTMLResponse:
    """The create form: upload, description, maximum wait, endpoint, pack."""
    return _create_form(request, {}, None, 200)


def _create_form(request: Request, values: dict[str, Any], message: str | None, status: int) -> HTMLResponse:
    s = console_state(request).app_state.settings
    return _render(
        request,
        "create.html",
        {
            "endpoints": BATCH_ENDPOINTS,
            "windows": window_choices(s.max_completion_window_hours()),
            "values": values,
            "message": message,
            "max_description": MAX_DESCRIPTION,
            "limits": {"bytes": s.batch_max_file_bytes, "rows": s.batch_max_rows, "line": s.batch_max_line_bytes},
        },
        status,
    )


@router.post("/upload", response_model=None)
async def upload(request: Request) -> Response:
    """The create page's upload (a script request with ``X-CSRF-Token``): multipart ``file`` (purpose ``batch``) ->
    ``{file, lines}``; a refused upload answers the API's error envelope (413 names the limit and the value)."""
    await _check_csrf(request)
    st = console_state(request).app_state
    s = st.settings
    received = await receive_batch_upload(request.headers.get("content-type", ""), request.stream(), s)
    try:
        form = files.FileUpload(
            fields={**received.fields, "purpose": "batch"},
            filename=received.filename,
            path=received.path,
            content_sha256=received.sha256.hexdigest(),
        )
        obj = await files.create_file(st.store, form, default_expiry_seconds=s.file_default_expiry_seconds)
    finally:
        received.discard()
    return JSONResponse({"file": obj, "lines": received.counter.rows})


@router.get("/files/{file_id}/estimate", response_model=None)
async def estimate(request: Request, file_id: str, endpoint: str = "/v1/chat/completions") -> Response:
    """The cost estimate of a batch over an uploaded file (``services/batch_api/estimates.py``), with the amount
    formatted."""
    st = console_state(request).app_state
    body = await estimate_file_cost(st.store, st.ctx, file_id, endpoint)
    body["estimated_cost_text"] = f"{money(int(body['estimated_cost']))} {body['currency']}"
    return JSONResponse(body)


@router.post("/batches", response_model=None)
async def create(request: Request) -> Response:
    """Create the job from the form (``file_id``, ``description`` -> ``metadata.description``, ``window`` hours,
    ``endpoint``, ``pack``), then its detail page; a refused create shows the form again with the server's message."""
    form = await request.form()
    await _check_csrf(request, str(form.get("csrf") or ""))
    st = console_state(request).app_state
    values = {k: str(v) for k, v in form.items() if k != "csrf" and isinstance(v, str)}
    description = values.get("description", "").strip()
    body: dict[str, Any] = {
        "input_file_id": values.get("file_id", ""),
        "endpoint": values.get("endpoint", ""),
        "completion_window": f"{values.get('window', '')}h",
        "pack": values.get("pack") == "on",
    }
    if description:
        body["metadata"] = {"description": description}
    try:
        if not body["input_file_id"]:
            raise InvalidRequestError("Upload a .jsonl file first.", param="input_file_id")
        created = await batches_service.create_batch(
            st.store,
            batches_service.BatchCreate(raw=json.dumps(body).encode(), strict=True),
            max_window_hours=st.settings.max_completion_window_hours(),
            pack_default=st.settings.batch_pack_default,
            prices=st.ctx.prices,
        )
    except APIError as exc:
        param = f" ({exc.param})" if exc.param else ""
        return _create_form(request, values, exc.message + param, exc.status_code)
    st.runner.wake()
    return RedirectResponse(f"/console/batches/{created['id']}", status_code=303)


# -- detail ----------------------------------------------------------------------------------------------------


@router.get("/batches/{batch_id}", response_class=HTMLResponse)
async def detail(
    request: Request,
    batch_id: str,
    tab: str = "overview",
    custom_id: str | None = None,
    offset: str | None = None,
) -> HTMLResponse:
    """A job's detail: counts, timestamps, status history, validation errors, usage and cost, lease holder and
    waiting reason, metadata, files; ``tab=results`` pages through the recorded result lines (``custom_id`` search)."""
    store = console_state(request).app_state.store
    job = await console.get_job(store, batch_id)
    b = job.batch
    input_file = None
    try:
        input_file = await files.retrieve_file(store, b["input_file_id"])
    except APIError:
        input_file = None
    context: dict[str, Any] = {
        "job": job,
        "b": b,
        "tab": "results" if tab == "results" else "overview",
        "input_file": input_file,
        "history": sorted(
            ((k.removesuffix("_at"), b[k]) for k in b if k.endswith("_at") and k != "expires_at" and b[k]),
            key=lambda item: item[1],
        ),
        "errors": ((b.get("errors") or {}).get("data") or [])[:MAX_SHOWN_ERRORS],
        "here": f"/console/batches/{batch_id}",
    }
    if context["tab"] == "results":
        start = _int(offset, "offset", 0)
        page = await operations.results(
            store, batch_id, offset=start, limit=RESULTS_PAGE, status=None, custom_id=custom_id or None
        )
        lines = [json.loads(line) for line in page.body.decode("utf-8").splitlines() if line.strip()]
        context.update(
            results=[_result_view(line) for line in lines],
            custom_id=custom_id or "",
            offset=start,
            next_offset=page.last_line if len(lines) == RESULTS_PAGE else None,
            incomplete=page.incomplete,
        )
    return _render(request, "detail.html", context)


def _result_view(line: dict[str, Any]) -> dict[str, Any]:
    response = line.get("response") or {}
    body = response.get("body") or {}
    text = ""
    if isinstance(body, dict):
        choices = body.get("choices") or []
        if choices and isinstance(choices[0], dict):
            first = choices[0]
            text = str((first.get("message") or {}).get("content") or first.get("text") or "")
        elif "error" in body:
            text = str((body.get("error") or {}).get("message") or "")
    if not text and line.get("error"):
        text = str(line["error"].get("message") or "")
    return {
        "custom_id": line.get("custom_id"),
        "status_code": response.get("status_code"),
        "ok": line.get("error") is None,
        "text": text[:300],
        "line": line.get("millm", {}).get("line") if isinstance(line.get("millm"), dict) else None,
    }


# -- usage -----------------------------------------------------------------------------------------------------


async def _usage(request: Request) -> tuple[dict[str, str], console.UsageGrid]:
    q = request.query_params
    today = datetime.datetime.now(tz=datetime.UTC).date()
    start = console.parse_day(q.get("start"), today - datetime.timedelta(days=13), "start")
    end = console.parse_day(q.get("end"), today, "end")
    kind = q.get("kind") or "all"
    if kind not in ("all", "realtime", "batch"):
        raise InvalidRequestError(f"Invalid 'kind': {kind!r}. Use all, realtime or batch.", param="kind")
    metric = q.get("metric") or "tokens"
    if metric not in ("tokens", "cost"):
        raise InvalidRequestError(f"Invalid 'metric': {metric!r}. Use tokens or cost.", param="metric")
    st = console_state(request).app_state
    prices = st.ctx.prices or PriceTable()
    grid = await console.usage_grid(
        st.store,
        start=start,
        end=end,
        kind=None if kind == "all" else kind,
        key=q.get("key") or None,
        model=q.get("model") or None,
        currency=prices.currency,
    )
    filters = {
        "start": start.isoformat(),
        "end": end.isoformat(),
        "kind": kind,
        "metric": metric,
        "key": q.get("key") or "",
        "model": q.get("model") or "",
    }
    return filters, grid


#: Colours of the chart's models, in turn.
PALETTE = ("#2f6db5", "#d9822b", "#3a9c5b", "#b53f5a", "#7b5cb5", "#8c6d3f", "#3f8c8c", "#6d6d6d")


def chart(grid: console.UsageGrid, metric: str) -> dict[str, Any]:
    """The stacked bar chart of ``grid`` as SVG rectangles: per day, one bar per model stacked, heights scaled to
    the tallest day. Returns ``{width, height, bars: [{x, y, w, h, fill, title}], ticks, legend, max}``."""
    width, height, pad = 720, 240, 40
    totals = [sum(grid.value(d, m, metric) for m in grid.models) for d in grid.days]
    top = max(totals, default=0) or 1
    step = (width - pad) / max(1, len(grid.days))
    bars = []
    for i, day in enumerate(grid.days):
        y = height - 20.0
        for j, model in enumerate(grid.models):
            value = grid.value(day, model, metric)
            if not value:
                continue
            h = (height - 40) * value / top
            y -= h
            shown = money(value) if metric == "cost" else str(value)
            bars.append(
                {
                    "x": round(pad + i * step + step * 0.1, 1),
                    "y": round(y, 1),
                    "w": round(step * 0.8, 1),
                    "h": round(h, 1),
                    "fill": PALETTE[j % len(PALETTE)],
                    "title": f"{day} {model}: {shown}",
                }
            )
    every = max(1, len(grid.days) // 7)
    ticks = [
        {"x": round(pad + i * step + step / 2, 1), "label": day[5:]}
        for i, day in enumerate(grid.days)
        if i % every == 0
    ]
    legend = [{"model": m, "fill": PALETTE[j % len(PALETTE)]} for j, m in enumerate(grid.models)]
    label = money(top) if metric == "cost" else str(top)
    return {"width": width, "height": height, "bars": bars, "ticks": ticks, "legend": legend, "max": label}


@router.get("/usage", response_class=HTMLResponse)
async def usage(request: Request) -> HTMLResponse:
    """Usage: time range, inference type, key (admins) and model filters; a stacked chart per day (UTC), totals,
    saved vs realtime for batch usage, and the day-by-model table (CSV at ``/console/usage.csv``)."""
    filters, grid = await _usage(request)
    st = console_state(request).app_state
    prices = st.ctx.prices or PriceTable()
    batch_cost = grid.totals["cost"]
    saved = None
    if filters["kind"] == "batch":
        realtime = console.realtime_equivalent(batch_cost, prices.batch_discount)
        saved = {"realtime": realtime, "saved": realtime - batch_cost}
    elif filters["kind"] == "all":
        batch_only = await console.usage_grid(
            st.store,
            start=datetime.date.fromisoformat(filters["start"]),
            end=datetime.date.fromisoformat(filters["end"]),
            kind="batch",
            key=filters["key"] or None,
            model=filters["model"] or None,
            currency=prices.currency,
        )
        realtime = console.realtime_equivalent(batch_only.totals["cost"], prices.batch_discount)
        saved = {"realtime": realtime, "saved": realtime - batch_only.totals["cost"]}
    return _render(
        request,
        "usage.html",
        {
            "filters": filters,
            "grid": grid,
            "chart": chart(grid, filters["metric"]),
            "saved": saved,
            "keys": await _keys(request),
            "csv_url": "/console/usage.csv?" + urlencode(filters),
        },
    )


@router.get("/usage.csv", response_model=None)
async def usage_csv(request: Request) -> Response:
    """The usage table as CSV: ``day,model,requests,input_tokens,output_tokens,cost`` (cost in currency units)."""
    _filters, grid = await _usage(request)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["day", "model", "requests", "input_tokens", "output_tokens", "cost"])
    for day in grid.days:
        for model in grid.models:
            cell = grid.cells.get((day, model))
            if cell is not None:
                writer.writerow(
                    [day, model, cell["requests"], cell["input_tokens"], cell["output_tokens"], money(cell["cost"])]
                )
    return Response(
        out.getvalue(),
        media_type="text/csv",
        headers={"Content-Disposition": 'attachment; filename="usage.csv"'},
    )
