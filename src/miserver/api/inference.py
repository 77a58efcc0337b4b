"""Synchronous inference routes on the resident model: thin wrappers over ``services``."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ..protocol.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionRequest
from ..protocol.completions import Completion, CompletionRequest
from ..services.inference.context import Call
from ..services.inference.registry import SERVICES
from .common import batch_invariant, json_body, lease_header, state, strict_mode, to_response
from .openapi import INFERENCE_ERRORS, documented

router = APIRouter()


@router.post("/v1/chat/completions")
@documented(
    body=ChatCompletionRequest,
    ok=ChatCompletion,
    stream=ChatCompletionChunk,
    errors=INFERENCE_ERRORS,
    headers=("strict", "lease", "invariant"),
)
async def chat_completions(request: Request) -> Response:
    body = await json_body(request)
    call = Call(strict=strict_mode(request), lease=lease_header(request), invariant=batch_invariant(request))
    return to_response(await SERVICES["/v1/chat/completions"].create(state(request).ctx, body, call))


@router.post("/v1/completions")
@documented(
    body=CompletionRequest,
    ok=Completion,
    stream=Completion,
    errors=INFERENCE_ERRORS,
    headers=("strict", "lease", "invariant"),
)
async def completions(request: Request) -> Response:
    body = await json_body(request)
    call = Call(strict=strict_mode(request), lease=lease_header(request), invariant=batch_invariant(request))
    return to_response(await SERVICES["/v1/completions"].create(state(request).ctx, body, call))
