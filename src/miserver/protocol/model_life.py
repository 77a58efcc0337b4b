"""Pydantic models of the resident model's life (DESIGN §3.5, §10): weight writes, checkpoints and catalogue
additions. The services check bodies field by field (errors name the tensor and its expected shape); these models
describe the same bodies and answers for the OpenAPI document."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from .common import RequestModel, ResponseModel


class WeightsState(ResponseModel):
    """The resident model's weights: its id (None when none is resident), revision, torn flag, and whether a write
    is open. ``object`` names the step that answered (``weights``, ``weights.write``, ``weights.commit``,
    ``weights.abort``)."""

    object: str = "weights"
    model: str | None
    weights_revision: str | None
    torn: bool
    write_open: bool


class TensorInfo(ResponseModel):
    """A named tensor of the resident model: its shape (sizes) and dtype (``float32``, ``bfloat16``...)."""

    name: str
    shape: list[int]
    dtype: str


class TensorList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[TensorInfo]


class WeightWriteRequest(RequestModel):
    """``POST /api/weights/write`` as JSON: ``set``, ``add`` or ``scale`` the tensor (or its ``slice``: one entry per
    leading dimension, an index, ``[start, stop]`` or null) with ``value``: a number, or for set/add a nested list of
    exactly the target's shape. A safetensors body (``application/octet-stream``, ``?op=set|add``) writes its tensors
    by name instead."""

    tensor: str
    op: Literal["set", "add", "scale"]
    value: Any
    slice: list[Any] | None = None


class WeightWritten(WeightsState):
    """The tensors one write changed."""

    written: list[TensorInfo]


class WeightsCommitted(WeightsState):
    """The new revision (also in ``X-miLLM-Weights``) and the tensors whose contents changed."""

    changed: list[str] = Field(default_factory=list)


class CheckpointCreateRequest(RequestModel):
    """``POST /api/checkpoints``: the model id to save the resident weights under."""

    model: str = Field(min_length=1, max_length=256)


class Checkpoint(ResponseModel):
    """A saved checkpoint: its model id, the catalogue model its weights came from, the digest of its weight files
    (what ``X-miLLM-Weights`` says once it is loaded), its size on disk and creation time."""

    id: str
    object: Literal["checkpoint"] = "checkpoint"
    base_model: str
    weights_revision: str
    bytes: int
    created_at: int
    resident: bool
    renamed_from: str | None = None


class CheckpointList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[Checkpoint]


class CheckpointDeleted(ResponseModel):
    id: str
    object: Literal["checkpoint"] = "checkpoint"
    deleted: Literal[True] = True


class CatalogueAddRequest(RequestModel):
    """``POST /api/models`` (``miserver models add``): a model id, its source (a transformers folder, a .gguf file or
    the embedded id) and names that resolve to it (compared case-insensitively)."""

    id: str = Field(min_length=1, max_length=256)
    source: str = Field(min_length=1)
    aliases: list[str] = Field(default_factory=list)


class CatalogueAdded(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    source: str
    aliases: list[str]
