"""What every service needs: the engine, its admission gate, model resolution, seeds and provenance headers.

Services are called by ``api/`` for synchronous requests and by ``batches/`` for rows: one code path. A service
returns a :class:`ServiceResult` (status, JSON body, headers, usage) or raises :class:`~miserver.errors.APIError`.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...engines.base import Engine, Grammar
from ...engines.upstream import UPSTREAM_PATHS, Gateway, UpstreamPool
from ...errors import ConflictError, EngineUnavailableError, ModelNotFoundError, UnsupportedValueError
from ...model_lease import LeaseManager
from ...scheduling.admission import AdmissionGate, Priority, Slot
from ...store import Store

if TYPE_CHECKING:
    from ..accounts.prices import PriceTable


@dataclass
class ServiceResult:
    """A finished response: HTTP status, the JSON body, provenance headers and token usage."""

    status_code: int
    body: dict[str, Any]
    headers: dict[str, str]
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class StreamUsage:
    """Token counts of a stream, kept by its producer as tokens are generated (:meth:`progress`) and final once the
    stream has ended (:meth:`set`, ``known`` then true).

    A stream reports usage to the client only when asked (``stream_options.include_usage``); this holder is filled
    either way, so that billing never depends on what the client asked to see. The counts so far are what a client
    that goes away in the middle of the stream is charged for.
    """

    prompt_tokens: int = 0
    completion_tokens: int = 0
    known: bool = False

    def progress(self, prompt_tokens: int, completion_tokens: int) -> None:
        """The counts so far (tokens): the prompt tokens computed and the tokens generated until now."""
        self.prompt_tokens, self.completion_tokens = prompt_tokens, completion_tokens

    def set(self, prompt_tokens: int, completion_tokens: int) -> None:
        """Record the stream's final counts (tokens)."""
        self.prompt_tokens, self.completion_tokens, self.known = prompt_tokens, completion_tokens, True


@dataclass
class StreamResult:
    """A streamed response: SSE ``data:`` payloads (already JSON text, ending with ``[DONE]``) and headers.

    ``usage`` is filled by producers that count their own tokens (the resident model's chat and completions streams)
    once the last event has been produced; other producers leave it unknown and billing reads the usage the events
    report.
    """

    events: AsyncIterator[str]
    headers: dict[str, str]
    usage: StreamUsage = field(default_factory=StreamUsage)


@dataclass
class Call:
    """How a service is called: strict mode, admission class, and a slot the caller already holds (batch chunk).

    ``should_stop``, when set, is asked by a many-rows call (``create_many``) before each pack or row it starts;
    once it answers true the remaining rows are left unrun and not yielded (the batch runner's time bound).
    ``interrupt``, when set, holds the part of those rules that must also end work already in flight (a cancel, a
    pause, a lost claim, the runner stopping; not the time bound): batched generation asks it before every
    decode step and drops the rows in flight once it is true, while ``should_stop`` alone only stops new rows from
    starting (the rows in flight finish). Without ``interrupt``, ``should_stop`` plays both parts.
    """

    strict: bool = False
    priority: Priority = Priority.INTERACTIVE
    slot: Slot | None = None
    lease: str | None = None
    should_stop: Callable[[], bool] | None = None
    #: Unix seconds after which a batch row is no longer sent (the batch's ``expires_at``); None for a request
    deadline: float | None = None

    interrupt: Callable[[], bool] | None = None
    #: the time bound alone (no new row starts once true); a group of batched generation applies it only once one of
    #: its rows started, so a chunk always makes progress
    time_up: Callable[[], bool] | None = None
    #: the resident engine's step scheduler takes turns between batch requests by this key (the batch)
    fairness_key: str = ""
    #: run each sequence alone at every decode step (``X-miLLM-Batch-Invariant``; ``pack: false`` batch rows)
    invariant: bool = False

    def stopped(self) -> bool:
        return self.should_stop is not None and self.should_stop()

    def interrupted(self) -> bool:
        """Whether work in flight must end now: ``interrupt()``, or ``should_stop()`` when no ``interrupt``."""
        return self.interrupt() if self.interrupt is not None else self.stopped()


@dataclass
class ServiceContext:
    """The resident engine (None while no model is resident or one is loading), its gate, its lease, the
    server's seed source, and the store (services that keep objects, such as probes, read it).

    Model life (``services/model_life/weights.py``, ``services/model_life/checkpoints.py``,
    ``services/model_life/catalogue.py``): ``weights_torn``
    is true while the resident weights are mid-write (or were left so by a crash); ``resident_origin`` is the
    catalogue id whose weights a checkpoint save or load renamed into the resident id; ``checkpoint_ids`` are the
    saved checkpoints; ``aliases`` maps a lower-cased alias to the catalogue id it names.
    """

    engine: Engine | None
    gate: AdmissionGate
    rng: random.Random = field(default_factory=random.Random)
    leases: LeaseManager = field(default_factory=LeaseManager)
    loading: bool = False
    store: Store | None = None
    #: the upstream engines and their pools in gateway mode (None: no upstream is configured)
    gateway: Gateway | None = None
    #: the price table (``services/accounts/prices.py``; None: everything free)
    prices: PriceTable | None = None
    weights_torn: bool = False
    resident_origin: str | None = None
    checkpoint_ids: set[str] = field(default_factory=set)
    aliases: dict[str, str] = field(default_factory=dict)

    def refuse_if_torn(self) -> None:
        """409 ``weights_torn`` while the resident weights are mid-write (the gate's admission check)."""
        if self.weights_torn and self.engine is not None:
            raise ConflictError(
                f"The weights of '{self.engine.info.model_id}' are torn: a weight write began and has not been "
                "committed or aborted. Retry after POST /api/weights/commit (or a load of the model).",
                param="model",
                code="weights_torn",
            )

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

    def upstream_pool(self, name: object) -> UpstreamPool | None:
        """The upstream pool serving the model ``name`` when it is not the resident model (the resident model wins
        a name both serve); None when no upstream ever listed it or ``name`` is not a string."""
        if self.gateway is None or not isinstance(name, str):
            return None
        if self.engine is not None and self.engine.info.model_id == name:
            return None
        return self.gateway.pool(name)

    def resolve_model(self, name: str) -> Engine:
        """The engine serving ``name``: the exact id (case-sensitive), or a catalogue alias of it (case-insensitive).

        Raises :class:`ModelNotFoundError` (404 ``model_not_found``); when ``name`` is a prefix of a served id up to
        a ``:`` tag (a quantization repository named without its tag), the message names the exact id to send; when
        it is the catalogue id whose weights a checkpoint save or load renamed, the message names the resident id;
        when it is a checkpoint that is not resident, the message says to load it first; in gateway mode it lists
        the upstream models too, and names the upstreams whose models are not known yet (never answered). Raises
        :class:`UnsupportedValueError` (400 ``unsupported_value``, param ``model``) for a model an upstream pool
        serves: the routes that reach this call run on the resident model only (the relayed ones,
        ``UPSTREAM_PATHS``, send such a model upstream before).
        """
        if self.loading:
            raise EngineUnavailableError("A model is being loaded; retry in a moment.")
        served = self.served_models()
        if name in served and self.engine is not None:
            return self.engine
        aliased = self.aliases.get(name.lower())
        if aliased is not None and aliased in served and self.engine is not None:
            return self.engine
        target = aliased or name
        if self.engine is not None and self.resident_origin is not None and target == self.resident_origin:
            resident = self.engine.info.model_id
            raise ModelNotFoundError(
                f"The model '{name}' is not resident: its resident weights were renamed to '{resident}' by a "
                f"checkpoint save or load. Send '{resident}' (as GET /v1/models lists it), or load '{name}' again.",
                param="model",
            )
        if name in self.checkpoint_ids:
            raise ModelNotFoundError(
                f"Checkpoint '{name}' is not resident; load it first (POST /api/models/load with "
                f'{{"model": "{name}"}}).',
                param="model",
            )
        tagged = [m for m in served if m.startswith(name + ":")]
        if tagged:
            raise ModelNotFoundError(
                f"The model '{name}' does not exist. It names a quantization repository without its tag: "
                f"send the exact id '{tagged[0]}' (as GET /v1/models lists it).",
                param="model",
            )
        pool = self.gateway.pool(target) if self.gateway is not None else None
        if pool is not None:  # a route that runs on the resident model only (the relayed ones go upstream first)
            names = ", ".join(f"'{u.name}'" for u in pool.members)
            relayed = ", ".join(UPSTREAM_PATHS)
            raise UnsupportedValueError(
                f"The model '{name}' is served by upstream {names}; miServer relays {relayed} to upstreams "
                "(and /v1/responses and /anthropic/v1/messages, translated to chat). This endpoint runs on the "
                "resident model only.",
                param="model",
            )
        upstream = [p.model for p in self.gateway.models() if p.model not in served] if self.gateway else []
        listed = ", ".join(f"'{m}'" for m in [*served, *upstream]) or "none"
        raise ModelNotFoundError(
            f"The model '{name}' does not exist or you do not have access to it. Models served: {listed}."
            + self._unknown_upstreams_note(),
            param="model",
        )

    def _unknown_upstreams_note(self) -> str:
        """The 404's last sentence in gateway mode while some upstream's models are not known (it never answered
        ``GET /v1/models`` and nothing is remembered of it): the model may be one of them. Empty otherwise."""
        names = self.gateway.unknown_upstreams() if self.gateway is not None else []
        if not names:
            return ""
        quoted = ", ".join(f"'{n}'" for n in names)
        if len(names) == 1:
            return f" Upstream {quoted} has not answered GET /v1/models yet; its models are not known."
        return f" Upstreams {quoted} have not answered GET /v1/models yet; their models are not known."

    def pick_seed(self, requested: int | None) -> tuple[int, str]:
        """The seed to run with and its ``X-miLLM-Seed`` header value (``scope="request"`` or ``"server"``)."""
        if requested is not None:
            return requested, f'{requested};scope="request"'
        seed = self.rng.randrange(0, 2**31)
        return seed, f'{seed};scope="server"'


def provenance_headers(
    engine: Engine,
    seed_header: str,
    lease: str | None = None,
    *,
    invariant: bool | None = None,
    grammar: Grammar | None = None,
) -> dict[str, str]:
    """The ``X-miLLM-*`` headers of DESIGN §3.4 for a response produced by ``engine``; ``invariant`` (generation
    only) says whether it ran batch-invariant (``X-miLLM-Batch-Invariant``); a ``grammar`` constrained it, applied
    by the engine's library (``X-miLLM-Grammar``)."""
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
    if invariant is not None:
        headers["X-miLLM-Batch-Invariant"] = "true" if invariant else "false"
    if grammar is not None:
        headers["X-miLLM-Grammar"] = str(getattr(engine, "grammar_backend", "yes"))
    return headers
