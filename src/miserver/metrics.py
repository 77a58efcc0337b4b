"""Prometheus metrics (``GET /metrics``), with the ``prometheus-client`` library, in a registry per app.

Series (all prefixed ``miserver_``):

- ``batches{status}``: stored batches by status;
- ``batch_rows{outcome="completed"|"failed"}``: rows recorded over the stored batches;
- ``batch_backlog_rows``: rows not yet run across active batches;
- ``batch_rows_per_second{model,endpoint}`` and ``batch_tokens_per_second{model,endpoint}``: the measured rates;
- ``admission_queue_depth{priority="interactive"|"batch"}``: requests waiting for the engine (at the admission gate,
  or admitted and waiting for a slot of the resident engine's step scheduler);
- ``interactive_request_seconds{route}``: a histogram of the synchronous inference routes' latency;
- ``engine_busy_fraction``: share of the last minute the engine's slots were in use (sampled twice a second);
- ``webhook_events{state="pending"|"delivered"|"failed"}``: the outbox; ``webhook_delivery_attempts_total{result}``:
  this process's delivery attempts (``delivered``, ``failed``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from .jobs import webhook_delivery as delivery
from .protocol.batches import BATCH_STATUSES
from .scheduling.admission import AdmissionGate, Priority
from .services.accounts.scopes import INFERENCE_ROUTES
from .store import Store
from .store import operations as store_operations
from .store import outbox as store_outbox
from .store import rows as store_rows

#: The synchronous inference routes whose latency is measured.
INTERACTIVE_ROUTES = INFERENCE_ROUTES
#: ``engine_busy_fraction`` is a moving average over about this many seconds, sampled every ``SAMPLE_SECONDS``.
BUSY_WINDOW_SECONDS = 60.0
SAMPLE_SECONDS = 0.5


class _DeliveryAttempts(Collector):
    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "miserver_webhook_delivery_attempts", "Webhook delivery attempts of this process", labels=["result"]
        )
        family.add_metric(["delivered"], delivery.STATS.delivered)
        family.add_metric(["failed"], delivery.STATS.failed_attempts)
        yield family


class Metrics:
    """The app's registry and series; :meth:`render` refreshes the gauges from the store and the gate."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.batches = Gauge("miserver_batches", "Stored batches by status", ["status"], registry=r)
        self.rows = Gauge("miserver_batch_rows", "Rows recorded over the stored batches", ["outcome"], registry=r)
        self.backlog = Gauge("miserver_batch_backlog_rows", "Rows not yet run across active batches", registry=r)
        self.rows_rate = Gauge(
            "miserver_batch_rows_per_second", "Measured batch rows per second", ["model", "endpoint"], registry=r
        )
        self.tokens_rate = Gauge(
            "miserver_batch_tokens_per_second", "Measured batch tokens per second", ["model", "endpoint"], registry=r
        )
        self.queue = Gauge(
            "miserver_admission_queue_depth", "Requests waiting for an engine slot", ["priority"], registry=r
        )
        self.latency = Histogram(
            "miserver_interactive_request_seconds",
            "Latency of synchronous inference requests",
            ["route"],
            buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0),
            registry=r,
        )
        self.busy = Gauge(
            "miserver_engine_busy_fraction", "Share of the last minute the engine slots were in use", registry=r
        )
        self.generated = Gauge(
            "miserver_engine_generated_tokens",
            "Tokens the resident engine has generated since it started (every sequence, every route)",
            registry=r,
        )
        self.prompt_tokens = Gauge(
            "miserver_engine_prompt_tokens",
            "Prompt tokens the resident engine has prefilled since it started, by source: computed, or reused from a "
            "prompt a cache slot held",
            ["source"],
            registry=r,
        )
        self.webhook_events = Gauge("miserver_webhook_events", "Webhook outbox events by state", ["state"], registry=r)
        r.register(_DeliveryAttempts())
        self._busy_average: float | None = None

    def observe(self, route: str, seconds: float) -> None:
        """Record a synchronous inference request's latency (other routes are ignored)."""
        if route in INTERACTIVE_ROUTES:
            self.latency.labels(route=route).observe(seconds)

    async def sample_busy(self, gate_of: Callable[[], AdmissionGate | None]) -> None:
        """Sample the gate's slots in use every :data:`SAMPLE_SECONDS` into the busy fraction, forever (a task of
        the app's lifespan). ``gate_of()`` returns the gate (None before the app is up)."""
        alpha = SAMPLE_SECONDS / BUSY_WINDOW_SECONDS
        while True:
            gate = gate_of()
            if gate is not None:
                busy = gate.in_use / gate.slots
                last = self._busy_average
                self._busy_average = busy if last is None else alpha * busy + (1 - alpha) * last
                self.busy.set(self._busy_average)
            await asyncio.sleep(SAMPLE_SECONDS)

    async def render(self, store: Store, gate: AdmissionGate, engine: object = None) -> bytes:
        """The text exposition of every series, refreshed now (``engine``: the resident engine, if any; an engine
        that counts its tokens, as the local one does, feeds ``miserver_engine_generated_tokens`` and
        ``miserver_engine_prompt_tokens``)."""
        async with store.read() as conn:
            statuses = await store_operations.status_counts(conn)
            completed, failed = await store_operations.row_totals(conn)
            backlog = await store_rows.backlog_rows(conn)
            rates = await store_operations.rates(conn)
            events = await store_outbox.counts(conn)
        for status in BATCH_STATUSES:
            self.batches.labels(status=status).set(statuses.get(status, 0))
        self.rows.labels(outcome="completed").set(completed)
        self.rows.labels(outcome="failed").set(failed)
        self.backlog.set(backlog)
        for (model, endpoint), rate in rates.items():
            self.rows_rate.labels(model=model, endpoint=endpoint).set(rate.rows_per_second)
            self.tokens_rate.labels(model=model, endpoint=endpoint).set(rate.tokens_per_second)
        self.queue.labels(priority="interactive").set(waiting(gate, engine, Priority.INTERACTIVE))
        self.queue.labels(priority="batch").set(waiting(gate, engine, Priority.BATCH))
        for state, count in events.items():
            self.webhook_events.labels(state=state).set(count)
        generated = getattr(engine, "generated_tokens", None)
        if isinstance(generated, int):
            self.generated.set(generated)
        prompt = getattr(engine, "prompt_tokens", None)
        if isinstance(prompt, dict):
            for source, count in prompt.items():
                self.prompt_tokens.labels(source=source).set(count)
        return generate_latest(self.registry)


def waiting(gate: AdmissionGate, engine: object, priority: Priority) -> int:
    """Requests of ``priority`` waiting for the engine: queued at ``gate``, plus those the gate let through that wait
    for a slot of ``engine``'s step scheduler (an engine without one, such as the gateway's, adds none)."""
    scheduler = getattr(engine, "scheduler", None)
    return gate.queue_length(priority) + (0 if scheduler is None else int(scheduler.waiting(priority)))
