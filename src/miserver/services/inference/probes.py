"""Probes on the resident model (DESIGN §3.5): create (given or trained), list, get, delete, and score.

A probe belongs to the model that was resident when it was made (``model``) and reads that model's hidden states at
``layer``, pooled over each input's tokens. Scoring names no model: the resident one is used, and a probe made for
another model is refused with 409 ``probe_model_mismatch``. Probes live in the database, so they survive restarts.
``POST /api/probes/score`` and its batch rows share :func:`create`; probe rows always run one at a time.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from ...clock import now
from ...engines.base import Engine, PoolRequest
from ...errors import ConflictError, InvalidRequestError, MissingParameterError, NotFoundError
from ...ids import ordered_id
from ...protocol.parsing import parse_request
from ...protocol.probes import (
    MAX_SCORE_INPUTS,
    Probe,
    ProbeCreateRequest,
    ProbeDeleted,
    ProbeScore,
    ProbeScoreRequest,
    ProbeScoreResponse,
    ProbeScoreUsage,
    ProbeTraining,
)
from ...store import probes as store_probes
from ...store.probes import ProbeRecord
from ..accounts import keys as accounts
from .checks import check_context
from .context import Call, ServiceContext, ServiceResult, provenance_headers
from .linear_probe import LinearProbe, check_labels

DEFAULT_C = 1.0


def _layer(layer: int, engine: Engine) -> int:
    """``layer`` as an index of the hidden states (``-1`` -> the last); 400 outside the model's layers."""
    count = engine.info.num_layers
    if not -(count + 1) <= layer <= count:
        raise InvalidRequestError(
            f"Invalid 'layer': {layer}. The model has hidden states 0 (embeddings) to {count} (-1 is the last).",
            param="layer",
        )
    return layer % (count + 1)


def _tokens(engine: Engine, texts: list[str], param: str) -> list[list[int]]:
    """Token ids of each text; 400 for a text with no tokens or longer than the context."""
    out = []
    for i, text in enumerate(texts):
        ids = engine.tokenize(text)
        where = f"{param}[{i}]" if len(texts) > 1 else param
        if not ids:
            raise InvalidRequestError(f"Invalid '{where}': a text with no tokens has no hidden states.", param=where)
        check_context(len(ids), 0, engine.info.context_length, param=where)
        out.append(ids)
    return out


async def _features(
    ctx: ServiceContext, engine: Engine, ids: list[list[int]], layer: int, pooling: str, call: Call
) -> np.ndarray:
    """Pooled hidden states ``[len(ids), hidden]`` (float64), each input alone; the gate is taken per input."""
    vectors = []
    for one in ids:
        async with ctx.gate.hold(call.priority, call.slot):
            request = PoolRequest(tuple(one), pooling=pooling, layer=layer)  # type: ignore[arg-type]
            vectors.append(await engine.embed(request))
    return np.stack(vectors).astype(np.float64)


def probe_object(record: ProbeRecord, *, with_weights: bool) -> dict[str, Any]:
    """The probe object of the API; without ``with_weights`` it has no ``weights`` and ``bias`` keys."""
    training = ProbeTraining(**record.training) if record.training else None
    return Probe(
        id=record.id,
        name=record.name,
        model=record.model_id,
        weights_revision=record.weights_revision,
        layer=record.layer,
        pooling=record.pooling,  # type: ignore[arg-type]
        hidden_size=record.hidden_size,
        classes=record.classes,
        created_at=record.created_at,
        description=record.description,
        training=training,
        weights=record.weights if with_weights else None,
        bias=record.bias if with_weights else None,
    ).model_dump(exclude={"weights", "bias"} if not with_weights else None)


async def create_probe(ctx: ServiceContext, body: Any, call: Call) -> dict[str, Any]:
    """``POST /api/probes``: store a given probe, or train one on labelled texts, for the resident model.

    Raises 400 (schema, shapes, labels, layer), 404 (``model`` not resident), 409 ``probe_exists``.
    """
    req = parse_request(ProbeCreateRequest, body, strict=call.strict)
    engine = ctx.resolve_model(req.model) if req.model is not None else ctx.require_engine()
    layer = _layer(req.layer, engine)
    store = ctx.require_store()
    async with store.tx() as conn:
        if await store_probes.get_probe(conn, req.name) is not None:
            raise _exists(req.name)
    training = None
    if req.weights is not None and req.texts is not None:
        raise InvalidRequestError("Give 'weights' and 'bias', or 'texts' and 'labels', not both.", param="texts")
    if req.weights is not None:
        if req.labels is not None or req.C is not None:
            param = "labels" if req.labels is not None else "C"
            raise InvalidRequestError(f"'{param}' goes with 'texts' (training), not with 'weights'.", param=param)
        probe = LinearProbe.from_api(req.weights, req.bias, req.classes, engine.info.hidden_size)
    elif req.texts is not None:
        check_labels(req.texts, req.labels)
        for name in ("bias", "classes"):
            if getattr(req, name) is not None:
                raise InvalidRequestError(
                    f"'{name}' goes with 'weights'; a trained probe's come from the fit.", param=name
                )
        features = await _features(ctx, engine, _tokens(engine, req.texts, "texts"), layer, req.pooling, call)
        c = req.C if req.C is not None else DEFAULT_C
        assert req.labels is not None
        probe, accuracy = await asyncio.to_thread(LinearProbe.fit, features, req.labels, c)
        training = {"texts": len(req.texts), "C": c, "train_accuracy": accuracy}
    else:
        raise MissingParameterError(
            "Missing required parameter: 'weights' (with 'bias'), or 'texts' (with 'labels') to train the probe.",
            param="weights",
        )
    weights, bias = probe.api_weights()
    record = ProbeRecord(
        id=ordered_id("probe_"),
        name=req.name,
        model_id=engine.info.model_id,
        weights_revision=engine.info.weights_revision,
        layer=layer,
        pooling=req.pooling,
        hidden_size=probe.hidden_size,
        classes=list(probe.classes),
        weights=weights,
        bias=bias,
        training=training,
        description=req.description,
        created_at=now(),
        owner_key_id=accounts.current().owner,
    )
    async with store.tx() as conn:
        if not await store_probes.insert_probe(conn, record):
            raise _exists(req.name)
    return probe_object(record, with_weights=True)


def _exists(name: str) -> ConflictError:
    return ConflictError(
        f"A probe named '{name}' already exists. Delete it first or choose another name.",
        param="name",
        code="probe_exists",
    )


def _not_found(name: str, param: str) -> NotFoundError:
    return NotFoundError(f"No probe named '{name}'.", param=param, code="probe_not_found")


async def list_probes(ctx: ServiceContext) -> dict[str, Any]:
    """``GET /api/probes``: every probe, oldest first, without weights."""
    async with ctx.require_store().tx() as conn:
        records = await store_probes.list_probes(conn, owner=accounts.scope())
    return {"object": "list", "data": [probe_object(r, with_weights=False) for r in records]}


async def get_probe(ctx: ServiceContext, name: str) -> dict[str, Any]:
    """``GET /api/probes/{name}``: the probe with its weights; 404 ``probe_not_found``."""
    async with ctx.require_store().tx() as conn:
        record = await store_probes.get_probe(conn, name)
    if record is None or not accounts.visible(record.owner_key_id):
        raise _not_found(name, "name")
    return probe_object(record, with_weights=True)


async def delete_probe(ctx: ServiceContext, name: str) -> dict[str, Any]:
    """``DELETE /api/probes/{name}``; 404 ``probe_not_found``."""
    async with ctx.require_store().tx() as conn:
        record = await store_probes.delete_probe(conn, name, owner=accounts.scope())
    if record is None:
        raise _not_found(name, "name")
    return ProbeDeleted(id=record.id, name=record.name).model_dump()


# -- scoring: the endpoint service of POST /api/probes/score and of its batch rows ------------------------------


def check(ctx: ServiceContext, body: Any, *, strict: bool) -> tuple[ProbeScoreRequest, Engine]:
    """Parse and check a score body (batch validation calls this too). The request names no model: the engine is
    the resident one (503 ``engine_unavailable`` when none). The probe itself is looked up when the request runs."""
    req = parse_request(ProbeScoreRequest, body, strict=strict)
    if isinstance(req.input, list):
        if not req.input:
            raise InvalidRequestError("Invalid 'input': it must not be empty.", param="input")
        if len(req.input) > MAX_SCORE_INPUTS:
            raise InvalidRequestError(f"Invalid 'input': at most {MAX_SCORE_INPUTS} inputs.", param="input")
    return req, ctx.require_engine()


async def create(ctx: ServiceContext, body: Any, call: Call) -> ServiceResult:
    """Score every input with the named probe, each input alone.

    Raises 400 (schema, empty or over-long input), 404 ``probe_not_found``, 409 ``probe_model_mismatch`` (the probe
    was made for another model than the resident one, or for other hidden states).
    """
    req, engine = check(ctx, body, strict=call.strict)
    async with ctx.require_store().tx() as conn:
        record = await store_probes.get_probe(conn, req.probe)
    if record is None or not accounts.visible(record.owner_key_id):
        raise _not_found(req.probe, "probe")
    info = engine.info
    if record.model_id != info.model_id:
        raise ConflictError(
            f"The probe '{record.name}' was made for the model '{record.model_id}', but the resident model is "
            f"'{info.model_id}'. Load '{record.model_id}' or create the probe again for '{info.model_id}'.",
            param="probe",
            code="probe_model_mismatch",
        )
    if record.hidden_size != info.hidden_size or record.layer > info.num_layers:
        raise ConflictError(
            f"The probe '{record.name}' reads {record.hidden_size}-wide hidden states at layer {record.layer}; the "
            f"resident model has {info.hidden_size}-wide states and {info.num_layers} layers.",
            param="probe",
            code="probe_model_mismatch",
        )
    texts = [req.input] if isinstance(req.input, str) else list(req.input)
    ids = _tokens(engine, texts, "input")
    probe = LinearProbe.from_api(record.weights, record.bias, record.classes, record.hidden_size)
    _, seed_header = ctx.pick_seed(None)
    headers = provenance_headers(engine, seed_header, call.lease)
    features = await _features(ctx, engine, ids, record.layer, record.pooling, call)
    probs = probe.probabilities(features)
    data = []
    for i, row in enumerate(probs):
        best = int(np.argmax(row))
        score = float(row[1]) if len(probe.classes) == 2 else float(row[best])
        data.append(ProbeScore(index=i, label=probe.classes[best], score=score, probabilities=[float(x) for x in row]))
    tokens = sum(len(x) for x in ids)
    response = ProbeScoreResponse(
        probe=record.name,
        model=info.model_id,
        layer=record.layer,
        pooling=record.pooling,  # type: ignore[arg-type]
        classes=record.classes,
        data=data,
        usage=ProbeScoreUsage(prompt_tokens=tokens, total_tokens=tokens),
    )
    return ServiceResult(200, response.model_dump(), headers, tokens, 0)
