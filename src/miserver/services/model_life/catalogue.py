"""The catalogue (DESIGN §3.5 Models, §10 model life): the models this server may load, by id, with aliases.

Entries come from four places: the embedded model, the model the server started with (``--model``), a catalogue
file (``--catalogue PATH``, TOML or YAML), and ``miserver models add ID SOURCE`` (``POST /api/models``, kept in the
database). A source is a transformers folder, a ``.gguf`` file, or the embedded id. Ids are what ``/v1/models``
lists and what requests send, compared case-sensitively; an alias resolves to its id, compared case-insensitively
(``smollm2`` for ``HuggingFaceTB/SmolLM2-135M-Instruct-GGUF:Q4_1``).

A catalogue file (TOML)::

    [[models]]
    id = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF:Q4_1"
    source = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF:Q4_1"   # the embedded model
    aliases = ["smollm2", "smol"]

    [[models]]
    id = "org/Model-GGUF:Q4_K_M"
    source = "/models/model.Q4_K_M.gguf"

The same in YAML: ``models: [{id: ..., source: ..., aliases: [...]}]``.
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml  # type: ignore[import-untyped]

from ...clock import now
from ...errors import ConflictError, InvalidRequestError, MissingParameterError
from ...settings import EMBEDDED_MODEL_ID
from ...store import Store
from ...store import model_life as store_models
from ...store.model_life import CatalogueRecord
from ..inference.context import ServiceContext

#: Longest id or alias.
MAX_NAME_CHARS = 256


@dataclass(frozen=True)
class CatalogueEntry:
    """One loadable model: ``source`` is a transformers folder, a .gguf file or the embedded id; ``origin`` says
    where the entry came from (``embedded``, ``command line``, ``file``, ``added``)."""

    id: str
    source: str
    aliases: tuple[str, ...] = ()
    origin: str = "file"


def _name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > MAX_NAME_CHARS or value != value.strip():
        raise ValueError(f"{what} must be a non-empty string of at most {MAX_NAME_CHARS} characters")
    return value


def entries_from_data(data: Any, origin: str = "file") -> list[CatalogueEntry]:
    """Entries of a parsed catalogue document ``{"models": [{"id", "source", "aliases"?}, ...]}``.

    Raises ``ValueError`` naming the entry (``models[2].source``) at fault.
    """
    models = data.get("models") if isinstance(data, dict) else None
    if not isinstance(models, list):
        raise ValueError("a catalogue holds a list 'models' of {id, source, aliases} entries")
    out: list[CatalogueEntry] = []
    for i, item in enumerate(models):
        if not isinstance(item, dict):
            raise ValueError(f"models[{i}] must be a table/mapping with 'id' and 'source'")
        unknown = sorted(set(item) - {"id", "source", "aliases"})
        if unknown:
            raise ValueError(f"models[{i}].{unknown[0]} is not a catalogue field (id, source, aliases)")
        model_id = _name(item.get("id"), f"models[{i}].id")
        source = _name(item.get("source"), f"models[{i}].source")
        aliases = item.get("aliases", [])
        if not isinstance(aliases, list):
            raise ValueError(f"models[{i}].aliases must be a list of strings")
        out.append(
            CatalogueEntry(
                model_id, source, tuple(_name(a, f"models[{i}].aliases[{j}]") for j, a in enumerate(aliases)), origin
            )
        )
    return out


def read_catalogue_file(path: Path) -> list[CatalogueEntry]:
    """The entries of a TOML (``.toml``) or YAML (``.yaml``/``.yml``) catalogue file; relative sources are taken
    relative to the file's folder. Raises ``ValueError`` naming the file and what is wrong."""
    try:
        text = path.read_text(encoding="utf-8")
        data = yaml.safe_load(text) if path.suffix.lower() in (".yaml", ".yml") else tomllib.loads(text)
        entries = entries_from_data(data)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise ValueError(f"catalogue {path}: {exc}") from None
    resolved = []
    for e in entries:
        source = e.source
        if source != EMBEDDED_MODEL_ID and not Path(source).expanduser().is_absolute():
            source = str((path.parent / source).resolve())
        resolved.append(CatalogueEntry(e.id, source, e.aliases, e.origin))
    return resolved


def check_source(source: str) -> None:
    """``ValueError`` unless ``source`` is the embedded id, a .gguf file, or a folder with ``config.json``."""
    from ...engines.local.loader import resolve_model_source

    resolve_model_source(source)


class Catalogue:
    """The catalogue of one process. The entries of the file and the start are fixed; added entries are read from
    the store by :meth:`refresh` and written by :meth:`add`. Aliases are published to ``ctx.aliases``."""

    def __init__(self, ctx: ServiceContext, store: Store, fixed: Iterable[CatalogueEntry]) -> None:
        self.ctx = ctx
        self.store = store
        self._fixed = list(fixed)
        self._added: list[CatalogueEntry] = []
        self._publish()

    def entries(self) -> list[CatalogueEntry]:
        """Every entry by id (a later one replaces an earlier one of the same id: added over file over start)."""
        by_id: dict[str, CatalogueEntry] = {}
        for e in [*self._fixed, *self._added]:
            by_id[e.id] = e
        return list(by_id.values())

    def ids(self) -> set[str]:
        return {e.id for e in self.entries()}

    def find(self, name: str) -> CatalogueEntry | None:
        """The entry whose id is ``name``, or whose alias is ``name`` ignoring case; None otherwise."""
        entries = self.entries()
        for e in entries:
            if e.id == name:
                return e
        lowered = name.lower()
        for e in entries:
            if any(a.lower() == lowered for a in e.aliases):
                return e
        return None

    def _publish(self) -> None:
        self.ctx.aliases = {a.lower(): e.id for e in self.entries() for a in e.aliases}

    def remember(self, model_id: str, source: str) -> None:
        """Note a model loaded by path (it becomes loadable by its id)."""
        if self.find(model_id) is None:
            self._fixed.append(CatalogueEntry(model_id, source, (), "loaded"))

    async def refresh(self) -> None:
        """Read the entries added at run time."""
        async with self.store.tx() as conn:
            records = await store_models.list_catalogue_models(conn)
        self._added = [CatalogueEntry(r.model_id, r.source, r.aliases, "added") for r in records]
        self._publish()

    async def add(self, body: Any) -> CatalogueEntry:
        """``{"id", "source", "aliases"?}`` (``POST /api/models``): add or replace a loadable model.

        Raises 400 naming the field for a bad id, alias or source (a source that is no model), 409 ``model_exists``
        when an alias is another model's id or alias.
        """
        if not isinstance(body, dict):
            raise InvalidRequestError("The body must be a JSON object.")
        for key in ("id", "source"):
            if key not in body:
                raise MissingParameterError(f"Missing required parameter: '{key}'.", param=key)
        unknown = [k for k in body if k not in ("id", "source", "aliases")]
        if unknown:
            raise InvalidRequestError(
                f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0], code="unknown_parameter"
            )
        try:
            [entry] = entries_from_data({"models": [body]}, origin="added")
        except ValueError as exc:
            field = str(exc).split(" ", 1)[0].removeprefix("models[0].")
            raise InvalidRequestError(f"Invalid '{field}': {exc}.".replace("models[0].", ""), param=field) from None
        try:
            check_source(entry.source)
        except ValueError as exc:
            raise InvalidRequestError(f"Invalid 'source': {exc}.", param="source") from None
        for alias in entry.aliases:
            other = self.find(alias)
            if other is not None and other.id != entry.id:
                raise ConflictError(
                    f"The alias '{alias}' already names the model '{other.id}'.", param="aliases", code="model_exists"
                )
        if entry.id in self.ctx.checkpoint_ids:
            raise ConflictError(f"'{entry.id}' is a checkpoint.", param="id", code="model_exists")
        async with self.store.tx() as conn:
            await store_models.add_catalogue_model(conn, CatalogueRecord(entry.id, entry.source, entry.aliases, now()))
        await self.refresh()
        return entry

    def listing(self, checkpoints: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``GET /api/models``: every catalogue entry and checkpoint: ``id``, ``source``, ``kind`` (``gguf``,
        ``directory``, ``checkpoint``), ``bytes`` on disk (None when the source is missing), ``aliases``, and for the
        resident model ``resident: true``, its ``dtype`` and ``weights_revision`` (None for the others)."""
        from ...engines.local.loader import resolve_model_source, source_bytes

        engine = self.ctx.engine
        resident = engine.info.model_id if engine is not None else None
        out: list[dict[str, Any]] = []

        def live(model_id: str) -> dict[str, Any]:
            on = engine is not None and model_id == resident
            return {
                "resident": on,
                "dtype": engine.info.dtype if on and engine is not None else None,
                "weights_revision": engine.info.weights_revision if on and engine is not None else None,
                "weights_torn": self.ctx.weights_torn if on else False,
            }

        for e in sorted(self.entries(), key=lambda e: e.id):
            try:
                src = resolve_model_source(e.source)
                kind: str | None = src.kind
                size: int | None = source_bytes(src)
            except (ValueError, OSError):
                kind, size = None, None
            out.append(
                {
                    "id": e.id,
                    "object": "model",
                    "source": e.source,
                    "kind": kind,
                    "bytes": size,
                    "aliases": list(e.aliases),
                    "origin": e.origin,
                    **live(e.id),
                }
            )
        for c in checkpoints:
            row = {"id": c["id"], "object": "model", "source": None, "kind": "checkpoint", "bytes": c["bytes"]}
            out.append({**row, "aliases": [], "origin": "checkpoint", "base_model": c["base_model"], **live(c["id"])})
        return out
