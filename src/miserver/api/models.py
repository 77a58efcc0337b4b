"""``GET /v1/models``: the models a request may name, ids exactly as requests must send them."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from ..protocol.parsing import parse_request
from ..protocol.server import Catalogue, ModelList, ModelLoaded, ModelLoadRequest, ModelObject, ModelUnloaded
from ..services.inference import routing
from .common import json_body, lease_header, state, strict_mode
from .openapi import CHANGE_ERRORS, LOOKUP_ERRORS, documented

router = APIRouter()


def _model(model_id: str, created: int) -> dict[str, Any]:
    return ModelObject(id=model_id, created=created, owned_by="miserver").model_dump()


@router.get("/v1/models")
@documented(ok=ModelList)
async def list_models(request: Request) -> dict[str, Any]:
    st = state(request)
    return ModelList(data=[ModelObject(**m) for m in routing.list_models(st.ctx, st.started_at)]).model_dump()


@router.get("/v1/models/{model_id:path}")
@documented(ok=ModelObject, errors=LOOKUP_ERRORS)
async def retrieve_model(model_id: str, request: Request) -> dict[str, Any]:
    st = state(request)
    listed = next((m for m in routing.list_models(st.ctx, st.started_at) if m["id"] == model_id), None)
    if listed is not None:
        return ModelObject(**listed).model_dump()
    st.ctx.resolve_model(model_id)  # raises 404 model_not_found with the same message as inference
    return _model(model_id, st.started_at)


@router.get("/api/models")
@documented(ok=Catalogue)
async def catalogue(request: Request) -> dict[str, Any]:
    """The models this server can make resident, with ``resident`` true for the one in memory."""
    return {"object": "list", "data": await state(request).residency.catalogue()}


@router.post("/api/models/load")  # needs models:write (services/accounts/scopes.py)
@documented(body=ModelLoadRequest, ok=ModelLoaded, errors=(400, 409, 500), headers=("strict", "lease"))
async def load(request: Request) -> dict[str, Any]:
    """``{"model": id or path}``: make it the resident model (needs the lease when one is held)."""
    st = state(request)
    lease = lease_header(request)
    req = parse_request(ModelLoadRequest, await json_body(request), strict=strict_mode(request))
    engine = await st.residency.load(req.model, lease)
    st.runner.wake()
    return {"id": engine.info.model_id, "resident": True, "weights_revision": engine.info.weights_revision}


@router.post("/api/models/unload")  # needs models:write (services/accounts/scopes.py)
@documented(ok=ModelUnloaded, errors=CHANGE_ERRORS, headers=("lease",))
async def unload(request: Request) -> dict[str, Any]:
    """Free the resident model (needs the lease when one is held). Batches wait with ``model_not_resident``."""
    st = state(request)
    await st.residency.unload(lease_header(request))
    return {"resident": None}
