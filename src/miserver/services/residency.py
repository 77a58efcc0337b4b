"""Model residency (DESIGN §3.5, Models): the catalogue, load and unload. Batches never call this: they wait.

A load or unload takes the admission gate at interactive priority, so it starts between requests (a running batch
chunk finishes first), and needs the lease when one is held. While it runs no model is resident: requests get 503
``engine_unavailable`` and batches wait with ``model_not_resident``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from ..engines.base import Engine
from ..errors import InvalidRequestError, NotFoundError
from ..scheduler import Priority
from ..settings import EMBEDDED_MODEL_ID, Settings
from .context import ServiceContext


class Residency:
    """Loads and unloads the resident model of one process."""

    def __init__(
        self,
        ctx: ServiceContext,
        settings: Settings,
        factory: Callable[[Settings], Awaitable[Engine]],
        prepare: Callable[[Engine], Engine],
    ) -> None:
        self.ctx = ctx
        self.settings = settings
        self.factory = factory
        self.prepare = prepare
        self._known: dict[str, str] = {EMBEDDED_MODEL_ID: EMBEDDED_MODEL_ID}
        if ctx.engine is not None:
            self._known[ctx.engine.info.model_id] = settings.model

    def catalogue(self) -> list[dict[str, Any]]:
        """Every model this process can load, with ``resident`` true for the one in memory."""
        resident = self.ctx.engine.info.model_id if self.ctx.engine is not None else None
        return [
            {"id": model_id, "source": source, "resident": model_id == resident}
            for model_id, source in sorted(self._known.items())
        ]

    async def load(self, model: str, lease: str | None) -> Engine:
        """Make ``model`` (a catalogue id, a transformers directory or a .gguf path) the resident model.

        Raises 409 ``lease_held`` without the held lease, 400 when ``model`` cannot be loaded.
        """
        self.ctx.leases.require(lease)
        current = self.ctx.engine
        if current is not None and current.info.model_id == model:
            return current
        source = self._known.get(model, model)
        served = model if source != model or model == EMBEDDED_MODEL_ID else None
        async with self.ctx.gate.hold(Priority.INTERACTIVE):
            self.ctx.loading = True
            try:
                if current is not None:
                    self.ctx.engine = None
                    await current.close()
                try:
                    update = {"model": source, "served_model_name": served}
                    engine = await self.factory(self.settings.model_copy(update=update))
                except (ValueError, OSError) as exc:
                    raise InvalidRequestError(f"Cannot load model {model!r}: {exc}", param="model") from None
                self.ctx.engine = self.prepare(engine)
                self._known[engine.info.model_id] = source
                return engine
            finally:
                self.ctx.loading = False

    async def unload(self, lease: str | None) -> None:
        """Free the resident model (409 without the held lease, 404 when none is resident)."""
        self.ctx.leases.require(lease)
        if self.ctx.engine is None:
            raise NotFoundError("No model is resident.", param="model", code="model_not_resident")
        async with self.ctx.gate.hold(Priority.INTERACTIVE):
            engine, self.ctx.engine = self.ctx.engine, None
            if engine is not None:
                await engine.close()
