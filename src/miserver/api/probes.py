"""Probe routes (DESIGN §3.5): create, list, get, delete, and ``POST /api/probes/score``; thin wrappers over
``services.probes``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ..protocol.probes import Probe, ProbeCreateRequest, ProbeDeleted, ProbeList, ProbeScoreRequest, ProbeScoreResponse
from ..services.inference import probes
from ..services.inference.context import Call
from ..services.inference.registry import SERVICES
from .common import json_body, lease_header, state, strict_mode, to_response
from .openapi import INFERENCE_ERRORS, LOOKUP_ERRORS, documented

router = APIRouter()


@router.post("/api/probes/score")
@documented(body=ProbeScoreRequest, ok=ProbeScoreResponse, errors=INFERENCE_ERRORS, headers=("strict", "lease"))
async def score(request: Request) -> Response:
    """``{probe, input}``: the named probe on the resident model's hidden states (no model field)."""
    body = await json_body(request)
    call = Call(strict=strict_mode(request), lease=lease_header(request))
    return to_response(await SERVICES["/api/probes/score"].create(state(request).ctx, body, call))


@router.post("/api/probes")
@documented(body=ProbeCreateRequest, ok=Probe, errors=INFERENCE_ERRORS, headers=("strict", "lease"))
async def create(request: Request) -> dict[str, Any]:
    """Store a probe (``weights`` + ``bias``) or train one (``texts`` + ``labels``) for the resident model."""
    body = await json_body(request)
    call = Call(strict=strict_mode(request), lease=lease_header(request))
    return await probes.create_probe(state(request).ctx, body, call)


@router.get("/api/probes")
@documented(ok=ProbeList)
async def list_probes(request: Request) -> dict[str, Any]:
    return await probes.list_probes(state(request).ctx)


@router.get("/api/probes/{name}")
@documented(ok=Probe, errors=LOOKUP_ERRORS)
async def get_probe(name: str, request: Request) -> dict[str, Any]:
    return await probes.get_probe(state(request).ctx, name)


@router.delete("/api/probes/{name}")
@documented(ok=ProbeDeleted, errors=LOOKUP_ERRORS)
async def delete_probe(name: str, request: Request) -> dict[str, Any]:
    return await probes.delete_probe(state(request).ctx, name)
