"""Model residency (DESIGN §3.5, Models): load and unload. Batches never call this: they wait.

A load or unload takes the admission gate at interactive priority, so it starts between requests (a running batch
chunk finishes first), and needs the lease when one is held. While it runs no model is resident: requests get 503
``engine_unavailable`` and batches wait with ``model_not_resident``. A load names a catalogue id or alias
(``services/model_life/catalogue.py``), a checkpoint (``services/model_life/checkpoints.py``), or a transformers
folder / .gguf path. A
load ends an open weight write and leaves the loaded weights whole (not torn). Progress goes to ``on_loading``
(Socket.IO ``model:loading``): ``{model, stage: "loading" | "loaded" | "failed", ...}``.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from ...engines.base import Engine
from ...errors import InvalidRequestError, NotFoundError
from ...scheduling.admission import Priority
from ...services.accounts import keys as accounts
from ...settings import Settings
from ..inference.context import ServiceContext
from .catalogue import Catalogue
from .checkpoints import Checkpoints
from .weights import WeightWrites


class Residency:
    """Loads and unloads the resident model of one process."""

    def __init__(
        self,
        ctx: ServiceContext,
        settings: Settings,
        factory: Callable[[Settings], Awaitable[Engine]],
        prepare: Callable[[Engine], Engine],
        *,
        catalogue: Catalogue,
        checkpoints: Checkpoints,
        weights: WeightWrites,
        on_loading: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.ctx = ctx
        self.settings = settings
        self.factory = factory
        self.prepare = prepare
        self.catalogue_ = catalogue
        self.checkpoints = checkpoints
        self.weights = weights
        self.on_loading = on_loading or (lambda _payload: None)

    async def catalogue(self) -> list[dict[str, Any]]:
        """``GET /api/models``: every model this process can load (catalogue entries and checkpoints), with
        ``resident`` true for the one in memory (see :meth:`Catalogue.listing`)."""
        return self.catalogue_.listing(await self.checkpoints.list())

    async def load(self, model: str, lease: str | None) -> Engine:
        """Make ``model`` (a catalogue id or alias, a checkpoint id, a transformers directory or a .gguf path) the
        resident model. Loading the resident model again reloads it only when its weights are torn or were written
        (a committed write changed its revision): a load restores the weights of its source.

        Raises 409 ``lease_held`` without the held lease, 400 when ``model`` cannot be loaded.
        """
        self.ctx.leases.require(lease, accounts.current().owner)
        checkpoint = await self.checkpoints.get(model)
        entry = None if checkpoint is not None else self.catalogue_.find(model)
        if checkpoint is not None:
            source, served, origin = checkpoint.path, checkpoint.model_id, checkpoint.base_model
        elif entry is not None:
            source, served, origin = entry.source, entry.id, None
        else:
            source, served, origin = model, None, None
        current = self.ctx.engine
        target = served or model
        if current is not None and current.info.model_id == target and not self.ctx.weights_torn:
            as_loaded = getattr(current, "source_revision", current.info.weights_revision)
            if as_loaded == current.info.weights_revision:
                return current  # resident as loaded: nothing to do
        self.weights.end_for_swap()
        started = time.monotonic()
        self.on_loading({"model": target, "stage": "loading"})
        async with self.ctx.gate.hold(Priority.INTERACTIVE, check=False, exclusive=True):
            self.ctx.loading = True
            try:
                if current is not None:
                    self.ctx.engine = None
                    await current.close()
                try:
                    update = {"model": source, "served_model_name": served}
                    engine = await self.factory(self.settings.model_copy(update=update))
                except (ValueError, OSError) as exc:
                    self.on_loading({"model": target, "stage": "failed", "error": str(exc)})
                    raise InvalidRequestError(f"Cannot load model {model!r}: {exc}", param="model") from None
                self.ctx.engine = self.prepare(engine)
                self.ctx.resident_origin = origin
                if checkpoint is None:
                    self.catalogue_.remember(engine.info.model_id, source)
                await self.weights.mark_whole(engine.info.model_id)
            finally:
                self.ctx.loading = False
        self.on_loading(
            {
                "model": engine.info.model_id,
                "stage": "loaded",
                "seconds": round(time.monotonic() - started, 3),
                "weights_revision": engine.info.weights_revision,
                "dtype": engine.info.dtype,
            }
        )
        return engine

    async def unload(self, lease: str | None) -> None:
        """Free the resident model (409 without the held lease, 404 when none is resident); ends an open write."""
        self.ctx.leases.require(lease, accounts.current().owner)
        if self.ctx.engine is None:
            raise NotFoundError("No model is resident.", param="model", code="model_not_resident")
        self.weights.end_for_swap()
        async with self.ctx.gate.hold(Priority.INTERACTIVE, check=False, exclusive=True):
            engine, self.ctx.engine = self.ctx.engine, None
            if engine is not None:
                await self.weights.mark_whole(engine.info.model_id)
                await engine.close()
            self.ctx.resident_origin = None
