"""What every service needs: the engine, its admission gate, model resolution, seeds and provenance headers.

Services are called by ``api/`` for synchronous requests and by ``batches/`` for rows: one code path. A service
returns a :class:`ServiceResult` (status, JSON body, headers, usage) or raises :class:`~miserver.errors.APIError`.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from ..engines.base import Engine
from ..errors import EngineUnavailableError, ModelNotFoundError
from ..leases import LeaseManager
from ..scheduler import AdmissionGate, Priority, Slot
from ..store import Store


@dataclass
class ServiceResult:
    """A finished response: HTTP status, the JSON body, provenance headers and token usage."""

    status_code: int
    body: dict[str, Any]
    headers: dict[str, str]
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class StreamResult:
    """A streamed response: SSE ``data:`` payloads (already JSON text, ending with ``[DONE]``) and headers."""

    events: AsyncIterator[str]
    headers: dict[str, str]


@dataclass
class Call:
    """How a service is called: strict mode, admission class, and a slot the caller already holds (batch chunk).

    ``should_stop``, when set, is asked by a many-rows call (``create_many``) before each pack or row it starts;
    once it answers true the remaining rows are left unrun and not yielded (the batch runner's time bound).
    """

    strict: bool = False
    priority: Priority = Priority.INTERACTIVE
    slot: Slot | None = None
    lease: str | None = None
    should_stop: Callable[[], bool] | None = None

    def stopped(self) -> bool:
        return self.should_stop is not None and self.should_stop()


@dataclass
class ServiceContext:
    """The resident engine (None while no model is resident or one is loading), its gate, its lease, the
    server's seed source, and the store (services that keep objects, such as probes, read it)."""

    engine: Engine | None
    gate: AdmissionGate
    rng: random.Random = field(default_factory=random.Random)
    leases: LeaseManager = field(default_factory=LeaseManager)
    loading: bool = False
    store: Store | None = None

    def require_store(self) -> Store:
        """The store; ``RuntimeError`` when the context was built without one (a programming error)."""
        if self.store is None:
            raise RuntimeError("this service context has no store")
        return self.store

    def require_engine(self) -> Engine:
        """The resident engine; 503 ``engine_unavailable`` when none is loaded."""
        if self.engine is None:
            raise EngineUnavailableError("No model is resident on this server.")
        return self.engine

    def served_models(self) -> list[str]:
        """Model ids exactly as requests must name them (``GET /v1/models``)."""
        return [self.engine.info.model_id] if self.engine is not None else []

    def resolve_model(self, name: str) -> Engine:
        """The engine serving ``name`` (exact, case-sensitive match).

        Raises :class:`ModelNotFoundError` (404 ``model_not_found``); when ``name`` is a prefix of a served id up to
        a ``:`` tag (a quantization repository named without its tag), the message names the exact id to send.
        """
        if self.loading:
            raise EngineUnavailableError("A model is being loaded; retry in a moment.")
        served = self.served_models()
        if name in served and self.engine is not None:
            return self.engine
        tagged = [m for m in served if m.startswith(name + ":")]
        if tagged:
            raise ModelNotFoundError(
                f"The model '{name}' does not exist. It names a quantization repository without its tag: "
                f"send the exact id '{tagged[0]}' (as GET /v1/models lists it).",
                param="model",
            )
        listed = ", ".join(f"'{m}'" for m in served) or "none"
        raise ModelNotFoundError(
            f"The model '{name}' does not exist or you do not have access to it. Models served: {listed}.",
            param="model",
        )

    def pick_seed(self, requested: int | None) -> tuple[int, str]:
        """The seed to run with and its ``X-miLLM-Seed`` header value (``scope="request"`` or ``"server"``)."""
        if requested is not None:
            return requested, f'{requested};scope="request"'
        seed = self.rng.randrange(0, 2**31)
        return seed, f'{seed};scope="server"'


def provenance_headers(engine: Engine, seed_header: str, lease: str | None = None) -> dict[str, str]:
    """The ``X-miLLM-*`` headers of DESIGN §3.4 for a response produced by ``engine``."""
    info = engine.info
    headers = {
        "X-miLLM-Model": info.model_id,
        "X-miLLM-Backend": info.backend,
        "X-miLLM-Seed": seed_header,
        "X-miLLM-Weights": info.weights_revision,
        "X-miLLM-Dtype": info.dtype,
    }
    if lease:
        headers["X-miLLM-Lease"] = lease
    return headers
