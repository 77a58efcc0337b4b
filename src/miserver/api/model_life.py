"""Routes of the resident model's life (DESIGN §3.5, §10): weight writes (``/api/weights``), checkpoints
(``/api/checkpoints``) and catalogue additions (``POST /api/models``). Thin: the rules are in
``services/model_life/weights.py``,
``services/model_life/checkpoints.py`` and ``services/model_life/catalogue.py``. Every change needs the model lease
when one is held
(``X-miLLM-Lease``); answers about the resident weights carry ``X-miLLM-Weights``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..errors import InvalidRequestError
from ..http_headers import header_value
from ..protocol.model_life import (
    CatalogueAdded,
    CatalogueAddRequest,
    Checkpoint,
    CheckpointCreateRequest,
    CheckpointDeleted,
    CheckpointList,
    TensorList,
    WeightsCommitted,
    WeightsState,
    WeightWriteRequest,
    WeightWritten,
)
from .common import bounded_body, json_body, lease_header, state
from .openapi import CHANGE_ERRORS, documented

router = APIRouter()

#: Content types of a safetensors upload to ``POST /api/weights/write``.
SAFETENSORS_TYPES = ("application/octet-stream", "application/safetensors")


def _answer(body: dict[str, Any]) -> JSONResponse:
    revision = body.get("weights_revision")
    headers = {"X-miLLM-Weights": header_value(revision)} if isinstance(revision, str) else {}
    return JSONResponse(body, headers=headers)


@router.get("/api/weights")
@documented(ok=WeightsState)
async def weights_state(request: Request) -> JSONResponse:
    """The resident model, its weights revision, whether its weights are torn and whether a write is open."""
    return _answer({"object": "weights", **state(request).residency.weights.state()})


@router.get("/api/weights/tensors")
@documented(ok=TensorList, errors=(400, 500, 503))
async def weights_tensors(request: Request) -> dict[str, Any]:
    """Every named tensor of the resident model: ``{name, shape, dtype}``."""
    return {"object": "list", "data": await state(request).residency.weights.tensors()}


@router.post("/api/weights/begin")
@documented(ok=WeightsState, errors=(400, 409, 500, 503), headers=("lease",))
async def weights_begin(request: Request) -> JSONResponse:
    """Open a weight write: the running row finishes first; from now on the weights are torn until commit."""
    return _answer(await state(request).residency.weights.begin(lease_header(request)))


@router.post("/api/weights/write")
@documented(body=WeightWriteRequest, ok=WeightWritten, errors=(400, 409, 500, 503), headers=("lease",))
async def weights_write(request: Request) -> JSONResponse:
    """JSON ``{"tensor", "op", "value", "slice"?}``, or a safetensors file as the body (``Content-Type:
    application/octet-stream``; ``?op=set`` (default) or ``add``) whose tensors are written by name."""
    weights = state(request).residency.weights
    limit = state(request).settings.batch_max_file_bytes  # a weight's values may be many megabytes
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type in SAFETENSORS_TYPES:
        unknown = [k for k in request.query_params if k != "op"]
        if unknown:
            raise InvalidRequestError(f"Unknown query parameter '{unknown[0]}'.", param=unknown[0])
        op = request.query_params.get("op", "set")
        body = await bounded_body(request, limit, "BATCH_MAX_FILE_BYTES")
        return _answer(await weights.write_safetensors(lease_header(request), body, op))
    return _answer(await weights.write(lease_header(request), await json_body(request, limit, "BATCH_MAX_FILE_BYTES")))


@router.post("/api/weights/commit")
@documented(ok=WeightsCommitted, errors=(400, 409, 500, 503), headers=("lease",))
async def weights_commit(request: Request) -> JSONResponse:
    """End the write: ``{"weights_revision"}`` is the new revision (also in ``X-miLLM-Weights``)."""
    st = state(request)
    answer = await st.residency.weights.commit(lease_header(request))
    st.runner.wake()
    return _answer(answer)


@router.post("/api/weights/abort")
@documented(ok=WeightsState, errors=(400, 409, 500, 503), headers=("lease",))
async def weights_abort(request: Request) -> JSONResponse:
    """End the write and restore the weights from before ``begin``."""
    st = state(request)
    answer = await st.residency.weights.abort(lease_header(request))
    st.runner.wake()
    return _answer(answer)


@router.post("/api/checkpoints")
@documented(body=CheckpointCreateRequest, ok=Checkpoint, errors=(400, 409, 500, 503), headers=("lease",))
async def checkpoint_save(request: Request) -> JSONResponse:
    """``{"model": "<new id>"}``: save the resident weights under that id; the resident model is then it."""
    st = state(request)
    answer = await st.residency.checkpoints.save(lease_header(request), await json_body(request))
    st.runner.wake()
    return _answer(answer)


@router.get("/api/checkpoints")
@documented(ok=CheckpointList)
async def checkpoint_list(request: Request) -> dict[str, Any]:
    """Every checkpoint, oldest first, with ``resident`` true for the one in memory."""
    return {"object": "list", "data": await state(request).residency.checkpoints.list()}


@router.delete("/api/checkpoints/{model_id:path}")
@documented(ok=CheckpointDeleted, errors=CHANGE_ERRORS, headers=("lease",))
async def checkpoint_delete(model_id: str, request: Request) -> dict[str, Any]:
    """Delete a checkpoint (refused while it is resident or a batch that has not ended names it)."""
    return await state(request).residency.checkpoints.delete(lease_header(request), model_id)


@router.post("/api/models")
@documented(body=CatalogueAddRequest, ok=CatalogueAdded, errors=(400, 409, 500))
async def catalogue_add(request: Request) -> dict[str, Any]:
    """``{"id", "source", "aliases"?}``: add a model this server may load (``miserver models add``)."""
    entry = await state(request).residency.catalogue_.add(await json_body(request))
    return {"id": entry.id, "object": "model", "source": entry.source, "aliases": list(entry.aliases)}
