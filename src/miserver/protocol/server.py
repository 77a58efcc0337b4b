"""Pydantic models of miServer's own routes that have no OpenAI counterpart in another module: health, the model
lease, ``/v1/models`` and the model catalogue (DESIGN §3.4-§3.5). The routes build their answers with these models,
and the OpenAPI document describes the routes with them."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .common import RequestModel, ResponseModel

# -- health ---------------------------------------------------------------------------------------------------------


class Health(ResponseModel):
    """``GET /api/health``: the server is ready (it answers 200 only then)."""

    status: Literal["ok"] = "ok"


class Slots(ResponseModel):
    total: int
    in_use: int


class Queues(ResponseModel):
    """Requests waiting for a slot, by class."""

    interactive: int
    batch: int


class InferenceHealth(ResponseModel):
    """``batch_backlog_rows``: rows not yet run across active batches."""

    batch_backlog_rows: int
    slots: Slots
    queues: Queues


class ResidentModel(ResponseModel):
    """The resident model: its id, backend, dtype, weights revision and context length (tokens)."""

    id: str
    backend: str
    dtype: str
    weights_revision: str
    context_length: int


class LeaseObject(ResponseModel):
    """The model lease: its token (sent back as ``X-miLLM-Lease``), holder, time to live in seconds and expiry
    (Unix seconds). ``GET /api/lease`` answers every field null when no lease is live."""

    lease: str | None
    holder: str | None
    ttl_seconds: float | None = None
    expires_at: int | None


class UpstreamHealth(ResponseModel):
    """One upstream engine in gateway mode: its name, whether it answered its last liveness probe, the models it
    serves, requests in flight against its ``max_in_flight``; ``url`` and ``last_error`` are shown to admin keys only
    (null for any other key: they describe the operator's network)."""

    name: str
    live: bool
    models: list[str]
    in_flight: int
    max_in_flight: int
    url: str | None
    last_error: str | None


class HealthDetailed(ResponseModel):
    """``GET /api/health/detailed``; ``upstreams`` is empty when no upstream is configured."""

    status: Literal["ok"] = "ok"
    database: Literal["sqlite", "postgresql"]
    inference: InferenceHealth
    model: ResidentModel | None
    loading: bool
    lease: LeaseObject | None
    upstreams: list[UpstreamHealth]


# -- leases ---------------------------------------------------------------------------------------------------------


class LeaseRequest(RequestModel):
    """``POST /api/lease``: who holds the lease and for how long (seconds; the bounds are ``leases.check_ttl``'s)."""

    holder: str = Field(min_length=1, max_length=200)
    ttl_seconds: float = 60.0


class RenewRequest(RequestModel):
    """``POST /api/lease/{lease}/renew`` (an empty body is allowed): a new time to live, or the lease's own."""

    ttl_seconds: float | None = None


class LeaseReleased(ResponseModel):
    lease: str
    released: Literal[True] = True


# -- models ---------------------------------------------------------------------------------------------------------


class ModelObject(ResponseModel):
    """OpenAI's Model object; ``id`` exactly as requests must name it."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelObject]


class CatalogueEntry(ResponseModel):
    """A model this server can make resident (``GET /api/models``): its id, where it loads from (``source``: a
    transformers folder, a .gguf file or the embedded id; None for a checkpoint), ``kind`` (``gguf``, ``directory``,
    ``checkpoint``; None when the source is missing), its size on disk, its aliases, where the entry came from
    (``embedded``, ``command line``, ``file``, ``added``, ``loaded``, ``checkpoint``), and for the resident model its
    dtype, weights revision and torn flag."""

    id: str
    object: Literal["model"] = "model"
    source: str | None
    kind: str | None
    bytes: int | None
    aliases: list[str]
    origin: str
    resident: bool
    dtype: str | None
    weights_revision: str | None
    weights_torn: bool
    base_model: str | None = None


class Catalogue(ResponseModel):
    object: Literal["list"] = "list"
    data: list[CatalogueEntry]


class ModelLoadRequest(RequestModel):
    """``POST /api/models/load``: a catalogue id, a transformers directory or a ``.gguf`` path."""

    model: str = Field(min_length=1)


class ModelLoaded(ResponseModel):
    id: str
    resident: Literal[True] = True
    weights_revision: str


class ModelUnloaded(ResponseModel):
    resident: None = None
