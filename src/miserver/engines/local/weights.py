"""Tensor edits on the resident model (DESIGN §10, model life): list, set / add / scale a tensor or a slice of it,
restore what a write changed, digest the result, save the whole model as a transformers folder.

Everything here runs on the engine's one thread (``LocalEngine.call``), so an edit never overlaps a forward pass.
A :class:`WriteSession` keeps a copy of each tensor the first time a write touches it (copy on write), which is what
``abort`` restores; the untouched tensors cost nothing.

Slices: a JSON list with one entry per leading dimension of the tensor, each an integer index, a ``[start, stop]``
pair (half-open, Python's meaning, negative values counted from the end) or ``null`` (the whole dimension).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import load as load_safetensors

from miserver.engines.local.loader import LoadedModel

WriteOp = Literal["set", "add", "scale"]
WRITE_OPS: tuple[str, ...] = ("set", "add", "scale")


class WeightEditError(ValueError):
    """A write the resident model cannot take; ``param`` names the request field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True)
class TensorInfo:
    """A named tensor of the resident model: ``shape`` (a list of sizes) and ``dtype`` (``float32``, ``bfloat16``)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def named_tensors(loaded: LoadedModel) -> dict[str, torch.Tensor]:
    """The model's state dict (parameters and persistent buffers) by name; tied weights appear under each name."""
    return dict(loaded.model.state_dict(keep_vars=True))


def list_tensors(loaded: LoadedModel) -> list[TensorInfo]:
    """Every named tensor, in the model's own order."""
    return [TensorInfo(n, tuple(t.shape), _dtype_name(t.dtype)) for n, t in named_tensors(loaded).items()]


def parse_slice(spec: Any, name: str, shape: Sequence[int]) -> tuple[Any, ...]:
    """``spec`` (see the module doc) as an index tuple for a tensor of ``shape``; ``WeightEditError`` naming the
    tensor and its shape when it does not fit. ``None`` means the whole tensor."""
    if spec is None:
        return ()
    where = f"tensor '{name}' of shape {list(shape)}"
    if not isinstance(spec, list) or len(spec) > len(shape):
        raise WeightEditError(
            f"Invalid 'slice' for {where}: give a list of at most {len(shape)} entries, each an index, "
            "[start, stop] or null.",
            "slice",
        )
    index: list[Any] = []
    for dim, (entry, size) in enumerate(zip(spec, shape)):
        if entry is None:
            index.append(slice(None))
        elif isinstance(entry, int) and not isinstance(entry, bool):
            if not -size <= entry < size:
                raise WeightEditError(f"Invalid 'slice[{dim}]': index {entry} is out of range for {where}.", "slice")
            index.append(entry)
        elif (
            isinstance(entry, list)
            and len(entry) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in entry)
        ):
            start, stop, _ = slice(entry[0], entry[1]).indices(size)
            if start >= stop:
                raise WeightEditError(f"Invalid 'slice[{dim}]': {entry} selects nothing of {where}.", "slice")
            index.append(slice(start, stop))
        else:
            raise WeightEditError(
                f"Invalid 'slice[{dim}]' for {where}: an index, [start, stop] or null is expected.", "slice"
            )
    return tuple(index)


def _value_tensor(value: Any, name: str, target: torch.Tensor, op: str) -> torch.Tensor | float:
    """The JSON ``value`` as a number or a tensor of exactly the target's shape, in the target's dtype."""
    shape = list(target.shape)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise WeightEditError(f"Invalid 'value' for tensor '{name}': {value} is not a finite number.", "value")
        return float(value)
    if op == "scale":
        raise WeightEditError(f"Invalid 'value' for tensor '{name}': 'scale' takes one number.", "value")
    try:
        tensor = torch.tensor(value, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError):
        raise WeightEditError(
            f"Invalid 'value' for tensor '{name}': a number or a nested list of numbers of shape {shape} is expected.",
            "value",
        ) from None
    if list(tensor.shape) != shape:
        raise WeightEditError(
            f"Invalid 'value' for tensor '{name}': its shape is {list(tensor.shape)}, the expected shape is {shape}.",
            "value",
        )
    if not bool(torch.isfinite(tensor).all()):
        raise WeightEditError(f"Invalid 'value' for tensor '{name}': every number must be finite.", "value")
    return tensor.to(dtype=target.dtype)


def _apply(target: torch.Tensor, op: str, value: torch.Tensor | float) -> None:
    with torch.no_grad():
        if isinstance(value, torch.Tensor):
            value = value.to(device=target.device)
        if op == "set":
            target.copy_(value) if isinstance(value, torch.Tensor) else target.fill_(value)
        elif op == "add":
            target.add_(value)
        else:
            target.mul_(value)


def _digest(tensor: torch.Tensor) -> str:
    raw = tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy()
    return hashlib.sha256(raw.tobytes()).hexdigest()


@dataclass
class WriteSession:
    """The copies of the tensors a write session touched, as they were at ``begin`` (CPU clones)."""

    before: dict[str, torch.Tensor] = field(default_factory=dict)

    def _target(self, loaded: LoadedModel, name: Any) -> tuple[str, torch.Tensor]:
        tensors = named_tensors(loaded)
        if not isinstance(name, str) or name not in tensors:
            raise WeightEditError(
                f"No tensor named {name!r} in the resident model (GET /api/weights/tensors lists them).", "tensor"
            )
        tensor = tensors[name]
        if name not in self.before:
            self.before[name] = tensor.detach().to("cpu", copy=True)
        return name, tensor

    def write(self, loaded: LoadedModel, name: Any, op: Any, value: Any, spec: Any) -> TensorInfo:
        """Apply ``op`` (set, add, scale) with ``value`` to the tensor ``name`` or its ``spec`` slice.

        Raises :class:`WeightEditError` (nothing changed) for an unknown tensor or op, a slice that does not fit, or
        a value of the wrong shape.
        """
        if op not in WRITE_OPS:
            raise WeightEditError(f"Invalid 'op': {op!r}. Use one of {', '.join(WRITE_OPS)}.", "op")
        tensors = named_tensors(loaded)
        if not isinstance(name, str) or name not in tensors:
            raise WeightEditError(
                f"No tensor named {name!r} in the resident model (GET /api/weights/tensors lists them).", "tensor"
            )
        whole = tensors[name]
        index = parse_slice(spec, name, tuple(whole.shape))
        target = whole[index] if index else whole
        number_or_tensor = _value_tensor(value, name, target, op)
        self._target(loaded, name)
        if index and not isinstance(target, torch.Tensor):
            raise WeightEditError(f"Invalid 'slice' for tensor '{name}'.", "slice")
        _apply(target, op, number_or_tensor)
        return TensorInfo(name, tuple(whole.shape), _dtype_name(whole.dtype))

    def write_safetensors(self, loaded: LoadedModel, data: bytes, op: Any) -> list[TensorInfo]:
        """Apply ``op`` (set or add) with every tensor of the safetensors bytes ``data`` to the model tensor of the
        same name. All tensors are checked (name, shape, dtype) before any is written."""
        if op not in ("set", "add"):
            raise WeightEditError(f"Invalid 'op': {op!r}. A safetensors upload takes 'set' or 'add'.", "op")
        try:
            uploaded = load_safetensors(data)
        except Exception as exc:  # safetensors raises its own error types for a malformed header
            raise WeightEditError(f"The body is not a safetensors file: {exc}.", "file") from None
        if not uploaded:
            raise WeightEditError("The safetensors file holds no tensor.", "file")
        tensors = named_tensors(loaded)
        for name, value in uploaded.items():
            if name not in tensors:
                raise WeightEditError(
                    f"No tensor named {name!r} in the resident model (GET /api/weights/tensors lists them).", "tensor"
                )
            target = tensors[name]
            if tuple(value.shape) != tuple(target.shape):
                raise WeightEditError(
                    f"Tensor '{name}': the upload's shape is {list(value.shape)}, the expected shape is "
                    f"{list(target.shape)}.",
                    "tensor",
                )
            if value.dtype != target.dtype:
                raise WeightEditError(
                    f"Tensor '{name}': the upload's dtype is {_dtype_name(value.dtype)}, the expected dtype is "
                    f"{_dtype_name(target.dtype)}.",
                    "tensor",
                )
            if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                raise WeightEditError(f"Tensor '{name}': every number must be finite.", "tensor")
        written = []
        for name, value in uploaded.items():
            _, target = self._target(loaded, name)
            _apply(target, op, value)
            written.append(TensorInfo(name, tuple(target.shape), _dtype_name(target.dtype)))
        return written

    def restore(self, loaded: LoadedModel) -> None:
        """Put every touched tensor back as it was at ``begin``."""
        tensors = named_tensors(loaded)
        with torch.no_grad():
            for name, before in self.before.items():
                tensors[name].copy_(before.to(device=tensors[name].device))
        self.before.clear()

    def changed(self, loaded: LoadedModel) -> dict[str, str]:
        """``{name: sha256 of its bytes}`` of the touched tensors whose content differs from ``begin``."""
        tensors = named_tensors(loaded)
        out = {}
        for name, before in self.before.items():
            now = tensors[name].detach().to("cpu")
            if not torch.equal(now, before):
                out[name] = _digest(now)
        return out


def next_revision(revision: str, changed: dict[str, str]) -> str:
    """The weights revision after a commit that changed ``changed`` (``{tensor name: content digest}``):
    ``sha256:`` + 12 hex digits of the previous revision chained with each changed tensor's name and content, in
    name order. The same revision and the same written contents give the same revision; no change keeps it."""
    if not changed:
        return revision
    hasher = hashlib.sha256(revision.encode())
    for name in sorted(changed):
        hasher.update(b"\0" + name.encode() + b"\0" + changed[name].encode())
    return "sha256:" + hasher.hexdigest()[:12]


def save_model(loaded: LoadedModel, folder: Path) -> None:
    """Write the resident weights (safetensors), config, generation config and tokenizer into ``folder``."""
    loaded.model.save_pretrained(folder, safe_serialization=True)
    loaded.tokenizer.save_pretrained(folder)
