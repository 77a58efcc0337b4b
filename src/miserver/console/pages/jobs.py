"""The job list (search, status and key filters in the URL), one job's row (the live refresh), cancel, and a file's
download."""

from __future__ import annotations

from urllib.parse import urlencode

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse

from ...http_headers import content_disposition
from ...protocol.batches import BATCH_STATUSES
from ...services.batch_api import batches as batches_service
from ...services.batch_api import files, job_search
from ...services.batch_api.files import download_name
from ..state import console_state, safe_next
from .render import check_csrf, key_choices, render, whole_number

router = APIRouter()


@router.get("/", response_class=HTMLResponse)
async def job_list(
    request: Request, q: str | None = None, status: str | None = None, key: str | None = None, page: str | None = None
) -> HTMLResponse:
    """The job list: newest first, searched by description or id, filtered by status (and key, for admins)."""
    store = console_state(request).app_state.store
    found = await job_search.search_jobs(
        store, text=q, status=status or None, key=key or None, page=whole_number(page, "page", 1)
    )
    filters = {k: v for k, v in {"q": q or "", "status": status or "", "key": key or ""}.items() if v}
    return render(
        request,
        "jobs.html",
        {
            "found": found,
            "q": q or "",
            "status": status or "",
            "key": key or "",
            "statuses": BATCH_STATUSES,
            "keys": await key_choices(request),
            "here": "/console/" + (f"?{urlencode({**filters, 'page': found.page})}"),
            "page_url": lambda n: "/console/?" + urlencode({**filters, "page": n}),
        },
    )


@router.get("/batches/{batch_id}/row", response_class=HTMLResponse)
async def job_row(request: Request, batch_id: str, next: str | None = None) -> HTMLResponse:
    """One job's row of the list (the live refresh of a row whose status changed)."""
    job = await job_search.get_job(console_state(request).app_state.store, batch_id)
    return render(request, "_row.html", {"job": job, "here": safe_next(next)})


@router.post("/batches/{batch_id}/cancel", response_model=None)
async def cancel(request: Request, batch_id: str) -> Response:
    """Cancel a job (form with ``csrf`` and ``next``), then back to ``next``."""
    form = await request.form()
    await check_csrf(request, str(form.get("csrf") or ""))
    st = console_state(request).app_state
    await batches_service.cancel_batch(st.store, batch_id)
    st.runner.wake()
    return RedirectResponse(safe_next(str(form.get("next") or "")), status_code=303)


@router.get("/files/{file_id}/content", response_model=None)
async def download(request: Request, file_id: str) -> Response:
    """A file's exact bytes as a download (``Content-Disposition: attachment``)."""
    record, content = await files.open_content(console_state(request).app_state.store, file_id)
    return StreamingResponse(
        content,
        media_type="application/jsonl",
        headers={
            "Content-Length": str(record.bytes),
            "Content-Disposition": content_disposition(download_name(record)),
        },
    )
