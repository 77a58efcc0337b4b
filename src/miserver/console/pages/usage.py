"""The usage page: time range, inference type, key (admins) and model filters, a stacked chart per day (UTC),
totals, what batch pricing saved, the day-by-model table, and that table as CSV."""

from __future__ import annotations

import csv
import datetime
import io
from typing import Any
from urllib.parse import urlencode

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, Response

from ...errors import InvalidRequestError
from ...services.accounts.prices import PriceTable
from ...services.batch_api import job_search
from ..state import console_state
from .render import key_choices, money, render

router = APIRouter()


async def _usage(request: Request) -> tuple[dict[str, str], job_search.UsageGrid]:
    q = request.query_params
    today = datetime.datetime.now(tz=datetime.UTC).date()
    start = job_search.parse_day(q.get("start"), today - datetime.timedelta(days=13), "start")
    end = job_search.parse_day(q.get("end"), today, "end")
    kind = q.get("kind") or "all"
    if kind not in ("all", "realtime", "batch"):
        raise InvalidRequestError(f"Invalid 'kind': {kind!r}. Use all, realtime or batch.", param="kind")
    metric = q.get("metric") or "tokens"
    if metric not in ("tokens", "cost"):
        raise InvalidRequestError(f"Invalid 'metric': {metric!r}. Use tokens or cost.", param="metric")
    st = console_state(request).app_state
    prices = st.ctx.prices or PriceTable()
    grid = await job_search.usage_grid(
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


def chart(grid: job_search.UsageGrid, metric: str) -> dict[str, Any]:
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
        realtime = job_search.realtime_equivalent(batch_cost, prices.batch_discount)
        saved = {"realtime": realtime, "saved": realtime - batch_cost}
    elif filters["kind"] == "all":
        batch_only = await job_search.usage_grid(
            st.store,
            start=datetime.date.fromisoformat(filters["start"]),
            end=datetime.date.fromisoformat(filters["end"]),
            kind="batch",
            key=filters["key"] or None,
            model=filters["model"] or None,
            currency=prices.currency,
        )
        realtime = job_search.realtime_equivalent(batch_only.totals["cost"], prices.batch_discount)
        saved = {"realtime": realtime, "saved": realtime - batch_only.totals["cost"]}
    return render(
        request,
        "usage.html",
        {
            "filters": filters,
            "grid": grid,
            "chart": chart(grid, filters["metric"]),
            "saved": saved,
            "keys": await key_choices(request),
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
