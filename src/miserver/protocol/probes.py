"""Pydantic models of the probe routes (DESIGN §3.5 "Probes"): create, the probe object, and scoring.

A probe is a linear classifier over the resident model's hidden states at one layer, pooled over each input's tokens.
It is given (``weights`` + ``bias``) or trained (``texts`` + ``labels``: a scikit-learn logistic regression).
Binary probes have a weight vector ``[hidden]`` and a scalar bias; probes of K >= 3 classes have ``[K][hidden]`` and
``[K]``. ``classes`` names the classes in order (default ``[0, 1]``, or ``0..K-1``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .common import RequestModel, ResponseModel

#: A probe's name: what ``/api/probes/{name}`` and score requests use.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
#: Labelled texts a probe may be trained on in one request.
MAX_TRAINING_TEXTS = 10_000
#: Inputs of one score request.
MAX_SCORE_INPUTS = 2048

ClassLabel = str | int


class ProbeCreateRequest(RequestModel):
    """``POST /api/probes``: ``weights`` and ``bias``, or ``texts`` and ``labels``; ``model`` defaults to the
    resident model (and must name it when given)."""

    name: str = Field(pattern=NAME_PATTERN)
    layer: int
    pooling: Literal["mean", "last"] = "mean"
    model: str | None = None
    weights: list[float] | list[list[float]] | None = None
    bias: float | list[float] | None = None
    classes: list[str] | list[int] | None = None
    texts: list[str] | None = Field(None, min_length=2, max_length=MAX_TRAINING_TEXTS)
    labels: list[str] | list[int] | None = None
    C: float | None = Field(None, gt=0)
    description: str | None = Field(None, max_length=512)


class ProbeTraining(ResponseModel):
    """How a trained probe was fitted: sample count, regularisation, accuracy on its own training texts."""

    texts: int
    C: float
    train_accuracy: float


class Probe(ResponseModel):
    """The probe object. ``weights``/``bias`` come with create and ``GET /api/probes/{name}``; the list
    (``{"object": "list", "data": [...]}``) leaves them out."""

    id: str
    object: Literal["probe"] = "probe"
    name: str
    model: str
    weights_revision: str
    layer: int
    pooling: Literal["mean", "last"]
    hidden_size: int
    classes: list[ClassLabel]
    created_at: int
    description: str | None = None
    training: ProbeTraining | None = None
    weights: list[float] | list[list[float]] | None = None
    bias: float | list[float] | None = None


class ProbeDeleted(ResponseModel):
    id: str
    object: Literal["probe"] = "probe"
    name: str
    deleted: bool = True


class ProbeScoreRequest(RequestModel):
    """``POST /api/probes/score`` (and batch lines of that endpoint): no model field, the resident model is used."""

    probe: str
    input: str | list[str]
    user: str | None = None


class ProbeScore(ResponseModel):
    """One input's result: ``label`` (the most likely class), ``probabilities`` (in ``classes`` order) and ``score``
    (binary: the probability of ``classes[1]``; otherwise the probability of ``label``)."""

    object: Literal["probe.score"] = "probe.score"
    index: int
    label: ClassLabel
    score: float
    probabilities: list[float]


class ProbeScoreUsage(ResponseModel):
    prompt_tokens: int
    total_tokens: int


class ProbeScoreResponse(ResponseModel):
    object: Literal["list"] = "list"
    probe: str
    model: str
    layer: int
    pooling: Literal["mean", "last"]
    classes: list[ClassLabel]
    data: list[ProbeScore]
    usage: ProbeScoreUsage


class ProbeList(ResponseModel):
    """``GET /api/probes``: every probe, oldest first, without weights."""

    object: Literal["list"] = "list"
    data: list[Probe]
