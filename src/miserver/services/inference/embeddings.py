"""``POST /v1/embeddings`` on the resident model: one code path for the route and batch rows (DESIGN §3.4).

Each input becomes one vector: the resident model's final hidden states pooled over the input's own tokens
(``pooling`` ``mean``, the default, or ``last``) and scaled to unit L2 norm. ``encoding_format`` ``base64`` sends the
vector's little-endian float32 bytes, which decode to exactly the ``float`` result. Synchronously every input runs
alone (the result of an input never depends on the others); in a ``pack: true`` batch every input of every row
runs in packs (:func:`create_many`).
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...engines.base import Engine, PoolRequest, Vector
from ...engines.upstream import UpstreamPool
from ...errors import InvalidRequestError, UnsupportedParameterError
from ...protocol.embeddings import MAX_INPUTS, CreateEmbeddingResponse, Embedding, EmbeddingRequest, EmbeddingUsage
from ...protocol.parsing import parse_request
from . import routing
from .checks import check_context
from .context import Call, ServiceContext, ServiceResult, StreamResult, provenance_headers
from .many import Outcome, Packing, Plan, run_many


def check(ctx: ServiceContext, body: Any, *, strict: bool) -> tuple[EmbeddingRequest, Engine | UpstreamPool]:
    """Parse and check a request body without running it (batch validation calls this): :func:`check_local`, or,
    for a model served by an upstream pool, :func:`parse` and the upstream context check (returns the pool)."""
    return routing.route_check(ctx, body, strict, parse, check_local)


def check_local(ctx: ServiceContext, body: Any, *, strict: bool) -> tuple[EmbeddingRequest, Engine]:
    """Parse and check a request body without running it (batch validation calls this too).

    Raises 400 for schema, unknown (strict) fields, an empty input list, more than 2048 inputs, and ``dimensions``
    other than the model's hidden size (``unsupported_parameter``: vectors are never truncated); 404
    ``model_not_found``.
    """
    req = parse(body, strict=strict)
    engine = ctx.resolve_model(req.model)
    hidden = engine.info.hidden_size
    if req.dimensions is not None and req.dimensions != hidden:
        raise UnsupportedParameterError(
            f"Unsupported parameter: 'dimensions' {req.dimensions}: the model's embeddings have exactly {hidden} "
            "dimensions and are not truncated. Omit 'dimensions' or send "
            f"{hidden}.",
            param="dimensions",
        )
    return req, engine


def parse(body: Any, *, strict: bool) -> EmbeddingRequest:
    """The checks of a body that need no model (an upstream model's request gets these, then goes upstream; the
    ``dimensions`` check needs the model and stays in :func:`check`). Raises 400 as :func:`check` does."""
    req = parse_request(EmbeddingRequest, body, strict=strict)
    if isinstance(req.input, list):
        if not req.input:
            raise InvalidRequestError("Invalid 'input': it must not be empty.", param="input")
        if len(req.input) > MAX_INPUTS and not all(isinstance(x, int) for x in req.input):
            raise InvalidRequestError(f"Invalid 'input': at most {MAX_INPUTS} inputs per request.", param="input")
    return req


def _inputs(engine: Engine, req: EmbeddingRequest) -> list[list[int]]:
    """Token ids of each input. Raises 400 for an input with no tokens or a token id outside the vocabulary."""
    x = req.input
    if isinstance(x, str):
        lists, strings = [engine.tokenize(x)], True
    elif all(isinstance(v, str) for v in x):
        lists, strings = [engine.tokenize(v) for v in x if isinstance(v, str)], True
    else:  # one token-id list, or several (the request model admits no mix)
        flat = [v for v in x if isinstance(v, int)]
        lists = [flat] if len(flat) == len(x) else [v for v in x if isinstance(v, list)]
        strings = False
    vocab = engine.vocab_size
    for i, ids in enumerate(lists):
        param = "input" if isinstance(x, str) or len(lists) == 1 else f"input[{i}]"
        if not ids:
            what = "a string" if strings else "a token list"
            raise InvalidRequestError(f"Invalid 'input': {what} with no tokens cannot be embedded.", param=param)
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(
                f"Invalid 'input': token id {bad[0]} is outside the vocabulary (0-{vocab - 1}).", param=param
            )
    return lists


@dataclass
class _Prepared:
    req: EmbeddingRequest
    engine: Engine
    units: list[PoolRequest]
    headers: dict[str, str]


def _prepare(ctx: ServiceContext, body: Any, call: Call) -> _Prepared:
    """Check and tokenise; an input longer than the context is 400 ``context_length_exceeded``."""
    req, engine = check_local(ctx, body, strict=call.strict)
    inputs = _inputs(engine, req)
    for ids in inputs:
        check_context(len(ids), 0, engine.info.context_length, param="input")
    pooling = req.pooling or "mean"
    units = [PoolRequest(tuple(ids), pooling=pooling, layer=-1, normalize=True) for ids in inputs]
    _, seed_header = ctx.pick_seed(None)
    return _Prepared(req, engine, units, provenance_headers(engine, seed_header, call.lease))


def encode(vector: Vector, encoding_format: str | None) -> list[float] | str:
    """A float32 vector as JSON floats, or as base64 of its little-endian float32 bytes."""
    v = np.asarray(vector, dtype="<f4")
    if encoding_format == "base64":
        return base64.b64encode(v.tobytes()).decode("ascii")
    return [float(x) for x in v]


def _build(p: _Prepared, vectors: list[Vector]) -> ServiceResult:
    """The response from each input's vector (the same code whether the inputs ran alone or in packs)."""
    tokens = sum(len(u.prompt_ids) for u in p.units)
    data = [Embedding(index=i, embedding=encode(v, p.req.encoding_format)) for i, v in enumerate(vectors)]
    response = CreateEmbeddingResponse(
        data=data, model=p.engine.info.model_id, usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)
    )
    return ServiceResult(200, response.model_dump(), p.headers, tokens, 0)


async def create(ctx: ServiceContext, body: Any, call: Call) -> ServiceResult | StreamResult:
    """Embed every input of the request, each alone; a model served by an upstream pool goes there
    (:func:`~miserver.services.inference.routing.create`, never a stream: an embedding request has no ``stream``)."""
    pool = routing.target(ctx, body)
    if pool is not None:
        return await routing.create(ctx, pool, "/v1/embeddings", parse(body, strict=call.strict), body, call)
    return await _execute(ctx, _prepare(ctx, body, call), call)


async def _execute(ctx: ServiceContext, p: _Prepared, call: Call) -> ServiceResult:
    """The computation of a prepared request: every input alone, under the admission gate (or ``call.slot``)."""
    async with ctx.gate.hold(call.priority, call.slot):
        vectors = [await p.engine.embed(u) for u in p.units]
    return _build(p, vectors)


PACKING: Packing[_Prepared, PoolRequest, Vector] = Packing(
    prepare=_prepare,
    units=lambda p: p.units,
    build=_build,
    run_pack=lambda engine, units: engine.embed_many(units),
    run_one=lambda engine, unit: engine.embed(unit),
    execute=_execute,
)


def create_many(ctx: ServiceContext, bodies: list[Any], call: Call, plan: Plan | None) -> AsyncIterator[Outcome]:
    """Many rows of the resident engine at once (the registry routes upstream rows first, see
    ``upstream_rows.routed_many``): in a ``pack: true`` batch every input of every row in
    the packs ``plan`` makes (``Engine.embed_many``). A row refused at checking fails alone. Yields every row once."""
    return run_many(PACKING, ctx, bodies, call, plan)
