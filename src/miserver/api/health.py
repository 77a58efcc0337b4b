"""Health routes: ``/api/health`` (ready when it answers 200) and ``/api/health/detailed``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from ..metrics import waiting
from ..protocol.server import Health, HealthDetailed
from ..scheduling.admission import AdmissionGate, Priority
from ..services.accounts import keys as accounts
from ..store import rows as store_rows
from .common import state
from .openapi import documented

router = APIRouter()


@router.get("/api/health")
@documented(ok=Health)
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/api/health/detailed")
@documented(ok=HealthDetailed)
async def health_detailed(request: Request) -> dict[str, Any]:
    st = state(request)
    async with st.store.read() as conn:
        backlog = await store_rows.backlog_rows(conn)
    gate = st.ctx.gate
    lease = st.ctx.leases.current()
    engine = st.ctx.engine
    return {
        "status": "ok",
        "database": "sqlite" if st.store.is_sqlite else "postgresql",
        "inference": {
            "batch_backlog_rows": backlog,
            "slots": _slots(engine, gate),
            "queues": {
                "interactive": waiting(gate, engine, Priority.INTERACTIVE),
                "batch": waiting(gate, engine, Priority.BATCH),
            },
        },
        "model": None
        if engine is None
        else {
            "id": engine.info.model_id,
            "backend": engine.info.backend,
            "dtype": engine.info.dtype,
            "weights_revision": engine.info.weights_revision,
            "context_length": engine.info.context_length,
        },
        "loading": st.ctx.loading,
        "lease": accounts.shown_lease(lease) if lease else None,  # the token for admins only
        "upstreams": [] if st.ctx.gateway is None else accounts.shown_upstreams(st.ctx.gateway.status()),
    }


def _slots(engine: object, gate: AdmissionGate) -> dict[str, int]:
    """The resident engine's sequence slots (a step-scheduling engine: its cap and the sequences in flight), else
    the gate's."""
    scheduler = getattr(engine, "scheduler", None)
    if scheduler is not None:
        return {"total": int(scheduler.max_sequences), "in_use": int(scheduler.in_flight)}
    return {"total": gate.slots, "in_use": gate.in_use}
