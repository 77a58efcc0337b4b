"""A job's detail page: counts, timestamps, status history, validation errors, usage and cost, lease holder and
waiting reason, metadata, files, and the results tab that pages through the recorded result lines."""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from ...errors import APIError
from ...services.accounts.scopes import needed_scopes
from ...services.batch_api import files, job_search, operations
from ..state import console_state
from .render import principal_of, render, whole_number

router = APIRouter()

#: Result lines per page of the results tab.
RESULTS_PAGE = 50
#: Validation errors shown on the detail page.
MAX_SHOWN_ERRORS = 1000
#: The API route whose scopes a key needs to see the input file's name and size (else its id alone is shown).
FILE_LOOKUP = ("GET", "/v1/files/{file_id}")


@router.get("/batches/{batch_id}", response_class=HTMLResponse)
async def detail(
    request: Request,
    batch_id: str,
    tab: str = "overview",
    custom_id: str | None = None,
    offset: str | None = None,
) -> HTMLResponse:
    """A job's detail: counts, timestamps, status history, validation errors, usage and cost, lease holder and
    waiting reason, metadata, files (the input file by its id alone for a key without ``files``); ``tab=results``
    pages through the recorded result lines (``custom_id`` search). 404 for a job the caller may not see."""
    store = console_state(request).app_state.store
    job = await job_search.get_job(store, batch_id)
    b = job.batch
    input_file = None
    files_shown = set(needed_scopes(*FILE_LOOKUP, {})) <= principal_of(request).scopes
    if files_shown:
        try:
            input_file = await files.retrieve_file(store, b["input_file_id"])
        except APIError:
            input_file = None
    context: dict[str, Any] = {
        "job": job,
        "b": b,
        "tab": "results" if tab == "results" else "overview",
        "input_file": input_file,
        "files_shown": files_shown,
        "history": sorted(
            ((k.removesuffix("_at"), b[k]) for k in b if k.endswith("_at") and k != "expires_at" and b[k]),
            key=lambda item: item[1],
        ),
        "errors": ((b.get("errors") or {}).get("data") or [])[:MAX_SHOWN_ERRORS],
        "here": f"/console/batches/{batch_id}",
    }
    if context["tab"] == "results":
        start = whole_number(offset, "offset", 0)
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
    return render(request, "detail.html", context)


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
