"""The create page: the form (upload, description, maximum wait, endpoint, pack), the upload it sends as a script
request, the cost estimate of the uploaded file, and the create itself."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response

from ...api.upload import receive_batch_upload
from ...errors import APIError, InvalidRequestError
from ...protocol.batches import BATCH_ENDPOINTS, BatchCreateRequest
from ...services.batch_api import batches as batches_service
from ...services.batch_api import files
from ...services.batch_api.estimates import estimate_file_cost
from ...services.inference.checks import MAX_METADATA_VALUE_CHARS
from ..state import console_state
from .render import check_csrf, money, render

router = APIRouter()

#: Longest description accepted (characters), as ``metadata`` values.
MAX_DESCRIPTION = MAX_METADATA_VALUE_CHARS


def window_choices(max_hours: int) -> list[int]:
    """The completion windows the create page offers: 1, 2, 6, 12 hours, then whole days, up to the server's
    longest window."""
    hours = [h for h in (1, 2, 6, 12) if h <= max_hours]
    hours += [d * 24 for d in range(1, max_hours // 24 + 1)]
    if max_hours not in hours:
        hours.append(max_hours)
    return hours


@router.get("/batches/new", response_class=HTMLResponse)
async def create_page(request: Request) -> HTMLResponse:
    """The create form: upload, description, maximum wait, endpoint, pack."""
    return _create_form(request, {}, None, 200)


def _create_form(request: Request, values: dict[str, Any], message: str | None, status: int) -> HTMLResponse:
    s = console_state(request).app_state.settings
    return render(
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
    await check_csrf(request)
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
    await check_csrf(request, str(form.get("csrf") or ""))
    st = console_state(request).app_state
    values = {k: str(v) for k, v in form.items() if k != "csrf" and isinstance(v, str)}
    description = values.get("description", "").strip()
    try:
        if not values.get("file_id"):
            raise InvalidRequestError("Upload a .jsonl file first.", param="input_file_id")
        created = await batches_service.create_batch_request(
            st.store,
            BatchCreateRequest(
                input_file_id=values["file_id"],
                endpoint=values.get("endpoint", ""),
                completion_window=f"{values.get('window', '')}h",
                pack=values.get("pack") == "on",
                metadata={"description": description} if description else None,
            ),
            max_window_hours=st.settings.max_completion_window_hours(),
            pack_default=st.settings.batch_pack_default,
            prices=st.ctx.prices,
        )
    except APIError as exc:
        param = f" ({exc.param})" if exc.param else ""
        return _create_form(request, values, exc.message + param, exc.status_code)
    st.runner.wake()
    return RedirectResponse(f"/console/batches/{created['id']}", status_code=303)
