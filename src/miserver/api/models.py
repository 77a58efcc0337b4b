"""``GET /v1/models``: the models a request may name, ids exactly as requests must send them."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from ..errors import MissingParameterError
from .common import json_body, state

router = APIRouter()


def _model(model_id: str, created: int) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "miserver"}


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    st = state(request)
    return {"object": "list", "data": [_model(m, st.started_at) for m in st.ctx.served_models()]}


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> dict[str, Any]:
    st = state(request)
    st.ctx.resolve_model(model_id)  # raises 404 model_not_found with the same message as inference
    return _model(model_id, st.started_at)


@router.get("/api/models")
async def catalogue(request: Request) -> dict[str, Any]:
    """The models this server can make resident, with ``resident`` true for the one in memory."""
    return {"object": "list", "data": state(request).residency.catalogue()}


@router.post("/api/models/load")
async def load(request: Request) -> dict[str, Any]:
    """``{"model": id or path}``: make it the resident model (needs the lease when one is held)."""
    st = state(request)
    body = await json_body(request)
    model = body.get("model") if isinstance(body, dict) else None
    if not isinstance(model, str) or not model:
        raise MissingParameterError("Missing required parameter: 'model'.", param="model")
    engine = await st.residency.load(model, request.headers.get("x-millm-lease"))
    st.runner.wake()
    return {"id": engine.info.model_id, "resident": True, "weights_revision": engine.info.weights_revision}


@router.post("/api/models/unload")
async def unload(request: Request) -> dict[str, Any]:
    """Free the resident model (needs the lease when one is held). Batches wait with ``model_not_resident``."""
    st = state(request)
    await st.residency.unload(request.headers.get("x-millm-lease"))
    return {"resident": None}
