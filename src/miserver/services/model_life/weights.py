"""Weight writes on the resident model (DESIGN §3.5 Weights, §10 model life): begin, write, commit, abort.

``begin`` takes the admission gate at interactive priority, so the running batch row (or pack) finishes first, and
keeps the slot until ``commit`` or ``abort``: no row or request starts in between. It also marks the weights torn,
in memory (synchronous requests get 409 ``weights_torn`` from the gate's admission check) and in the database
(``model_state``: batches wait with ``waiting_reason: weights_torn``, and a crash mid-write leaves the model torn
after a restart). ``write`` sets, adds to or scales a named tensor or a slice of it (or takes a safetensors upload);
``commit`` ends the write with a new weights revision (the previous revision chained with the content digest of
every tensor the write changed: see ``engines.local.weights.next_revision``), carried by ``X-miLLM-Weights`` from
then on; ``abort`` restores every touched tensor. After a restart, a late ``commit`` (no write open, weights torn)
accepts the resident weights as they are, and a load of the model restores them from their source.

Each operation needs the model lease when one is held (``X-miLLM-Lease``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...clock import now
from ...errors import ConflictError, InvalidRequestError, MissingParameterError
from ...scheduling.admission import Priority, Slot
from ...services.accounts import keys as accounts
from ...store import Store
from ...store import model_life as store_models
from ..inference.context import ServiceContext

if TYPE_CHECKING:
    from ...engines.local.engine import LocalEngine
    from ...engines.local.weights import WriteSession


def local_engine(ctx: ServiceContext) -> LocalEngine:
    """The resident engine when its weights can be edited (the in-process engine); 503 without a resident model,
    400 for an engine whose weights live elsewhere."""
    from ...engines.local.engine import LocalEngine

    engine = ctx.require_engine()
    if not isinstance(engine, LocalEngine):
        raise InvalidRequestError("The resident engine's weights cannot be edited or saved here.", param="model")
    return engine


def weights_torn_error(model_id: str) -> ConflictError:
    """409 ``weights_torn`` for an operation that needs whole weights."""
    return ConflictError(
        f"The weights of '{model_id}' are torn (a weight write is open, or was left open by a crash): commit or "
        "abort it, or load the model again.",
        param="model",
        code="weights_torn",
    )


@dataclass
class OpenWrite:
    """A write between ``begin`` and ``commit``: the held admission slot, the copies of touched tensors, and the
    resident model's id and revision at ``begin`` (``torn_before``: whether it was torn already, by a crash)."""

    slot: Slot
    session: WriteSession
    model_id: str
    revision: str
    torn_before: bool


class WeightWrites:
    """The weight-write service of one process (one resident model). ``on_change()`` is called when the weights
    become whole again (the runner is woken so waiting batches run)."""

    def __init__(self, ctx: ServiceContext, store: Store, on_change: Callable[[], None] | None = None) -> None:
        self.ctx = ctx
        self.store = store
        self.on_change = on_change or (lambda: None)
        self.open: OpenWrite | None = None

    async def load_flag(self) -> None:
        """Read the persisted torn flag of the resident model into memory (at start: a crash mid-write)."""
        engine = self.ctx.engine
        if engine is None:
            self.ctx.weights_torn = False
            return
        async with self.store.tx() as conn:
            self.ctx.weights_torn = await store_models.weights_torn(conn, engine.info.model_id)

    async def _persist(self, model_id: str, torn: bool) -> None:
        async with self.store.tx() as conn:
            await store_models.set_weights_torn(conn, model_id, torn, now())
        self.ctx.weights_torn = torn

    def state(self) -> dict[str, Any]:
        """``{model, weights_revision, torn, write_open}`` of the resident model (``model`` None when none)."""
        engine = self.ctx.engine
        return {
            "model": engine.info.model_id if engine is not None else None,
            "weights_revision": engine.info.weights_revision if engine is not None else None,
            "torn": self.ctx.weights_torn,
            "write_open": self.open is not None,
        }

    async def tensors(self) -> list[dict[str, Any]]:
        """Every named tensor of the resident model: ``{name, shape, dtype}``."""
        from ...engines.local.weights import list_tensors

        infos = await local_engine(self.ctx).call(list_tensors)
        return [t.as_json() for t in infos]

    async def begin(self, lease: str | None) -> dict[str, Any]:
        """Open a write: wait for the admission slot (the running row finishes first), mark the weights torn.

        Raises 409 ``lease_held`` without the held lease, 409 ``weights_write_open`` when a write is open already,
        503 without a resident model.
        """
        from ...engines.local.weights import WriteSession

        self.ctx.leases.require(lease, accounts.current().owner)
        engine = local_engine(self.ctx)
        if self.open is not None:
            raise self._already_open()
        slot = await self.ctx.gate.acquire(Priority.INTERACTIVE, exclusive=True)
        try:
            if self.open is not None:  # another begin got the slot first
                raise self._already_open()
            if self.ctx.engine is not engine:
                raise ConflictError("The resident model changed while the write waited; begin again.", code="conflict")
            torn_before = self.ctx.weights_torn
            await self._persist(engine.info.model_id, True)
            self.open = OpenWrite(slot, WriteSession(), engine.info.model_id, engine.info.weights_revision, torn_before)
        except BaseException:
            self.ctx.gate.release(slot)
            raise
        return {**self.state(), "object": "weights.write"}

    def _already_open(self) -> ConflictError:
        return ConflictError(
            "A weight write is open already: commit or abort it first.", param=None, code="weights_write_open"
        )

    def _require_open(self, lease: str | None) -> tuple[OpenWrite, LocalEngine]:
        self.ctx.leases.require(lease, accounts.current().owner)
        if self.open is None:
            raise ConflictError(
                "No weight write is open: POST /api/weights/begin first.", param=None, code="weights_write_not_open"
            )
        return self.open, local_engine(self.ctx)

    async def write(self, lease: str | None, body: Any) -> dict[str, Any]:
        """``{"tensor", "op": "set"|"add"|"scale", "value", "slice"?}``: edit one tensor of the open write.

        ``value`` is a number (``set`` fills, ``add`` adds, ``scale`` multiplies) or, for ``set``/``add``, a nested
        list of exactly the target's shape. Raises 400 naming the field (the message names the tensor and the
        expected shape), 409 ``weights_write_not_open`` before ``begin``.
        """
        from ...engines.local.weights import WeightEditError

        opened, engine = self._require_open(lease)
        if not isinstance(body, dict):
            raise InvalidRequestError("The body must be a JSON object.", param=None)
        for name in ("tensor", "op", "value"):
            if name not in body:
                raise MissingParameterError(f"Missing required parameter: '{name}'.", param=name)
        unknown = [k for k in body if k not in ("tensor", "op", "value", "slice")]
        if unknown:
            raise InvalidRequestError(
                f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0], code="unknown_parameter"
            )
        session = opened.session
        try:
            info = await engine.call(
                lambda loaded: session.write(loaded, body["tensor"], body["op"], body["value"], body.get("slice"))
            )
        except WeightEditError as exc:
            raise InvalidRequestError(exc.message, param=exc.param) from None
        return {"object": "weights.tensor_write", "written": [info.as_json()], **self.state()}

    async def write_safetensors(self, lease: str | None, data: bytes, op: str) -> dict[str, Any]:
        """Write every tensor of a safetensors file (``op`` ``set`` or ``add``) to the model tensor of its name;
        each is checked (name, shape, dtype) before any is written."""
        from ...engines.local.weights import WeightEditError

        opened, engine = self._require_open(lease)
        session = opened.session
        try:
            infos = await engine.call(lambda loaded: session.write_safetensors(loaded, data, op))
        except WeightEditError as exc:
            raise InvalidRequestError(exc.message, param=exc.param) from None
        return {"object": "weights.tensor_write", "written": [i.as_json() for i in infos], **self.state()}

    async def commit(self, lease: str | None) -> dict[str, Any]:
        """End the open write: the new weights revision (unchanged when no tensor changed), weights whole again.

        With no write open but the weights torn (a crash mid-write), a late commit accepts the resident weights as
        they are. Raises 409 ``weights_write_not_open`` when there is nothing to commit.
        """
        from ...engines.local.weights import next_revision

        self.ctx.leases.require(lease, accounts.current().owner)
        if self.open is None:
            engine = self.ctx.require_engine()
            if not self.ctx.weights_torn:
                raise ConflictError(
                    "No weight write is open: POST /api/weights/begin first.", code="weights_write_not_open"
                )
            await self._persist(engine.info.model_id, False)
            self.on_change()
            return {**self.state(), "object": "weights.commit"}
        opened, engine = self._require_open(lease)
        try:
            changed = await engine.call(opened.session.changed)
            engine.rename(weights_revision=next_revision(opened.revision, changed))
            await self._persist(opened.model_id, False)
        finally:
            self._close(opened)
        return {**self.state(), "object": "weights.commit", "changed": sorted(changed)}

    async def abort(self, lease: str | None) -> dict[str, Any]:
        """Restore the weights from before ``begin`` and end the write (the revision stays what it was)."""
        opened, engine = self._require_open(lease)
        try:
            await engine.call(opened.session.restore)
            await self._persist(opened.model_id, opened.torn_before)
        finally:
            self._close(opened)
        return {**self.state(), "object": "weights.abort"}

    def _close(self, opened: OpenWrite) -> None:
        if self.open is opened:
            self.open = None
            self.ctx.gate.release(opened.slot)
            self.on_change()

    def end_for_swap(self) -> None:
        """Before a load or unload replaces the resident weights: drop the open write (nothing to restore: the
        weights are replaced) and give its admission slot back, so the load can take it."""
        if self.open is not None:
            self._close(self.open)

    async def mark_whole(self, model_id: str) -> None:
        """The weights of ``model_id`` were just loaded from their source: not torn (in memory and persisted)."""
        await self._persist(model_id, False)
        self.on_change()
