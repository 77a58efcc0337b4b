"""``GET /v1/models``: the models a request may name, ids exactly as requests must send them."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from ..errors import ModelNotFoundError
from .common import state

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
