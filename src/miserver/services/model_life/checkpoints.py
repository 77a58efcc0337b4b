"""Checkpoints (DESIGN §3.5, §10 model life): save the resident weights under a new model id, list, delete.

``save`` takes the admission gate at interactive priority (the running row finishes first), writes the resident
weights (safetensors), config and tokenizer into ``<data dir>/checkpoints/<folder>/`` (a temporary folder renamed
into place), records the checkpoint, and renames the resident model: it is served under the new id from then on,
with the weights revision a later load of the checkpoint reports (the digest of its weight files). The catalogue id
it came from now answers 404 ``model_not_found`` naming the resident id; a checkpoint that is not resident answers
its own 404 ("load it first"). ``POST /api/models/load`` loads a checkpoint (``services/model_life/residency.py``).
"""

from __future__ import annotations

import hashlib
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...clock import now
from ...errors import ConflictError, InvalidRequestError, MissingParameterError, NotFoundError
from ...scheduling.admission import Priority
from ...services.accounts import keys as accounts
from ...store import Store
from ...store import model_life as store_models
from ...store.model_life import CheckpointRecord
from ..inference.context import ServiceContext
from .weights import WeightWrites, local_engine, weights_torn_error

#: Longest model id a checkpoint may take.
MAX_ID_CHARS = 256
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def folder_name(model_id: str) -> str:
    """A file-system-safe, unique folder name for ``model_id`` (its safe characters and a digest)."""
    digest = hashlib.sha256(model_id.encode()).hexdigest()[:10]
    return f"{_UNSAFE.sub('_', model_id)[:80]}-{digest}"


def folder_bytes(folder: Path) -> int:
    """Bytes of the files under ``folder``."""
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def check_new_id(value: Any) -> str:
    """The ``model`` of a save: a non-empty string of at most 256 characters without control characters or
    surrounding spaces; 400 naming ``model`` otherwise."""
    if value is None:
        raise MissingParameterError(
            "Missing required parameter: 'model' (the new checkpoint's model id).", param="model"
        )
    if not isinstance(value, str) or not value or len(value) > MAX_ID_CHARS:
        raise InvalidRequestError(
            f"Invalid 'model': a model id of 1-{MAX_ID_CHARS} characters is expected.", param="model"
        )
    if value != value.strip() or any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise InvalidRequestError(
            "Invalid 'model': an id has no control characters and no leading or trailing spaces.", param="model"
        )
    return value


class Checkpoints:
    """The checkpoints of this server, saved under ``data_dir/checkpoints``. ``known_ids()`` returns the catalogue
    ids (a checkpoint may not take one); ``cache_dir`` memoises weight-file digests (as the loader does)."""

    def __init__(
        self,
        ctx: ServiceContext,
        store: Store,
        weights: WeightWrites,
        *,
        data_dir: Path,
        cache_dir: Path,
        known_ids: Callable[[], set[str]],
    ) -> None:
        self.ctx = ctx
        self.store = store
        self.weights = weights
        self.root = data_dir / "checkpoints"
        self.cache_dir = cache_dir
        self.known_ids = known_ids

    async def refresh(self) -> None:
        """Read the checkpoint ids into the service context (model resolution names them in its messages)."""
        async with self.store.tx() as conn:
            self.ctx.checkpoint_ids = {c.model_id for c in await store_models.list_checkpoints(conn)}

    async def list(self) -> list[dict[str, Any]]:
        """Every checkpoint (oldest first), with ``resident`` true for the one in memory."""
        async with self.store.tx() as conn:
            records = await store_models.list_checkpoints(conn)
        resident = self.ctx.engine.info.model_id if self.ctx.engine is not None else None
        return [{**r.as_json(), "resident": r.model_id == resident} for r in records]

    async def get(self, model_id: str) -> CheckpointRecord | None:
        async with self.store.tx() as conn:
            return await store_models.get_checkpoint(conn, model_id)

    async def save(self, lease: str | None, body: Any) -> dict[str, Any]:
        """``{"model": "<new id>"}``: save the resident weights as that checkpoint; the resident model is then it.

        Raises 409 ``lease_held``, 409 ``weights_torn`` (mid-write), 409 ``model_exists`` (the id names a catalogue
        model or a checkpoint), 400 for a bad id, 503 without a resident model.
        """
        from ...engines.local.loader import folder_revision
        from ...engines.local.weights import save_model

        self.ctx.leases.require(lease, accounts.current().owner)
        new_id = check_new_id(body.get("model") if isinstance(body, dict) else None)
        if isinstance(body, dict):
            unknown = [k for k in body if k != "model"]
            if unknown:
                raise InvalidRequestError(
                    f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0], code="unknown_parameter"
                )
        engine = local_engine(self.ctx)
        if self.weights.open is not None or self.ctx.weights_torn:
            raise weights_torn_error(engine.info.model_id)
        await self.refresh()
        if new_id == engine.info.model_id or new_id in self.ctx.checkpoint_ids or new_id in self.known_ids():
            raise ConflictError(
                f"A model '{new_id}' exists already (in the catalogue or as a checkpoint): choose another id.",
                param="model",
                code="model_exists",
            )
        folder = self.root / folder_name(new_id)
        async with self.ctx.gate.hold(Priority.INTERACTIVE, exclusive=True):  # what runs finishes first; torn refused
            if self.ctx.engine is not engine:
                raise ConflictError("The resident model changed meanwhile; save again.", code="conflict")
            old_id = engine.info.model_id
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = self.root / f".{folder.name}.tmp-{now()}"
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                await engine.call(lambda loaded: save_model(loaded, tmp))
                if folder.exists():
                    shutil.rmtree(folder)  # left by a save whose record was never written (a crash)
                tmp.rename(folder)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            revision = folder_revision(folder, self.cache_dir)
            base = self.ctx.resident_origin if old_id in self.ctx.checkpoint_ids else old_id
            record = CheckpointRecord(
                model_id=new_id,
                path=str(folder.resolve()),
                base_model=base or old_id,
                weights_revision=revision,
                bytes=folder_bytes(folder),
                created_at=now(),
            )
            async with self.store.tx() as conn:
                await store_models.insert_checkpoint(conn, record)
            engine.rename(model_id=new_id, weights_revision=revision)
            self.ctx.checkpoint_ids.add(new_id)
            self.ctx.resident_origin = record.base_model
        return {**record.as_json(), "resident": True, "renamed_from": old_id}

    async def delete(self, lease: str | None, model_id: str) -> dict[str, Any]:
        """Delete a checkpoint's record and folder. Refused with 409 ``checkpoint_resident`` while it is the
        resident model and 409 ``checkpoint_in_use`` while a batch that has not ended names it; 404 when unknown."""
        self.ctx.leases.require(lease, accounts.current().owner)
        record = await self.get(model_id)
        if record is None:
            raise NotFoundError(f"No checkpoint '{model_id}'.", param="model", code="checkpoint_not_found")
        if self.ctx.engine is not None and self.ctx.engine.info.model_id == model_id:
            raise ConflictError(
                f"The checkpoint '{model_id}' is the resident model: load another model first.",
                param="model",
                code="checkpoint_resident",
            )
        async with self.store.tx() as conn:
            deleted = await store_models.delete_checkpoint(conn, model_id)
            users = [] if deleted else await store_models.batches_naming(conn, model_id)
        if not deleted:
            raise ConflictError(
                f"The checkpoint '{model_id}' is named by batches that have not ended ({', '.join(users)}).",
                param="model",
                code="checkpoint_in_use",
            )
        shutil.rmtree(record.path, ignore_errors=True)
        self.ctx.checkpoint_ids.discard(model_id)
        return {"id": model_id, "object": "checkpoint", "deleted": True}
