"""The math of a linear probe: shape checks, class probabilities, and fitting by logistic regression.

A probe is ``coef`` ``[1, hidden]`` with ``intercept`` ``[1]`` (binary: ``p(classes[1]) = sigmoid(x . w + b)``) or
``[K, hidden]`` with ``[K]`` for K >= 2 classes (softmax), exactly scikit-learn's ``LogisticRegression`` convention,
so a probe fitted here or elsewhere scores the same as ``predict_proba``. Features are float64 ``[n, hidden]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import InvalidRequestError, MissingParameterError


@dataclass(frozen=True)
class LinearProbe:
    coef: np.ndarray  # float64 [1 or K, hidden]
    intercept: np.ndarray  # float64 [1 or K]
    classes: tuple[Any, ...]  # 2 (binary) or K labels, str or int

    @property
    def hidden_size(self) -> int:
        return int(self.coef.shape[1])

    def probabilities(self, features: np.ndarray) -> np.ndarray:
        """``[n, len(classes)]`` class probabilities of ``features`` ``[n, hidden]`` (rows sum to 1)."""
        z = np.asarray(features, dtype=np.float64) @ self.coef.T + self.intercept
        if self.coef.shape[0] == 1:
            p1 = 1.0 / (1.0 + np.exp(-z[:, 0]))
            return np.stack([1.0 - p1, p1], axis=1)
        z = z - z.max(axis=1, keepdims=True)
        e = np.exp(z)
        probabilities: np.ndarray = e / e.sum(axis=1, keepdims=True)
        return probabilities

    def api_weights(self) -> tuple[list[float] | list[list[float]], float | list[float]]:
        """``(weights, bias)`` in the API's shape.

        ``[hidden]`` and a number when binary, else ``[K][hidden]`` and ``[K]``.
        """
        if self.coef.shape[0] == 1:
            return [float(x) for x in self.coef[0]], float(self.intercept[0])
        return [[float(x) for x in row] for row in self.coef], [float(x) for x in self.intercept]

    @classmethod
    def from_api(
        cls,
        weights: Sequence[float] | Sequence[Sequence[float]],
        bias: float | Sequence[float] | None,
        classes: Sequence[Any] | None,
        hidden_size: int,
    ) -> LinearProbe:
        """Build from the API's ``weights``/``bias``/``classes``; 400 naming the field when a shape or value is wrong.

        ``hidden_size`` is the model's: the weight vectors must have exactly that many values.
        """
        if bias is None:
            raise MissingParameterError("Missing required parameter: 'bias' (it goes with 'weights').", param="bias")
        if weights and isinstance(weights[0], (int, float)):  # binary: [hidden] and a number
            if not isinstance(bias, (int, float)):
                raise InvalidRequestError(
                    "Invalid 'bias': a binary probe ([hidden] weights) has one number.", param="bias"
                )
            coef = np.asarray([list(weights)], dtype=np.float64)
            intercept = np.asarray([bias], dtype=np.float64)
        else:
            rows = [list(r) for r in weights]  # type: ignore[arg-type]
            if not rows or any(len(r) != len(rows[0]) for r in rows):
                raise InvalidRequestError("Invalid 'weights': every row must have the same length.", param="weights")
            if isinstance(bias, (int, float)) or len(bias) != len(rows):
                raise InvalidRequestError(
                    f"Invalid 'bias': {len(rows)} weight rows need {len(rows)} biases.", param="bias"
                )
            coef = np.asarray(rows, dtype=np.float64)
            intercept = np.asarray(list(bias), dtype=np.float64)
        if coef.shape[1] != hidden_size:
            raise InvalidRequestError(
                f"Invalid 'weights': {coef.shape[1]} values per row; the model's hidden size is {hidden_size}.",
                param="weights",
            )
        if not (np.isfinite(coef).all() and np.isfinite(intercept).all()):
            raise InvalidRequestError(
                "Invalid 'weights': every weight and bias must be a finite number.", param="weights"
            )
        count = 2 if coef.shape[0] == 1 else coef.shape[0]
        labels = tuple(classes) if classes is not None else tuple(range(count))
        if len(labels) != count or len(set(labels)) != count:
            raise InvalidRequestError(
                f"Invalid 'classes': this probe has {count} classes; give {count} distinct labels.", param="classes"
            )
        return cls(coef, intercept, labels)

    @classmethod
    def fit(cls, features: np.ndarray, labels: Sequence[Any], c: float) -> tuple[LinearProbe, float]:
        """Fit scikit-learn's ``LogisticRegression(C=c)`` (lbfgs, multinomial when K > 2) on ``features``
        ``[n, hidden]``; returns the probe and its accuracy on the training data. CPU-bound: call it off the loop."""
        from sklearn.linear_model import LogisticRegression  # imported on use: it is slow to import

        model = LogisticRegression(C=c, max_iter=2000)
        model.fit(np.asarray(features, dtype=np.float64), np.asarray(list(labels)))
        accuracy = float(model.score(np.asarray(features, dtype=np.float64), np.asarray(list(labels))))
        classes = tuple(x.item() if hasattr(x, "item") else x for x in model.classes_)
        probe = cls(np.asarray(model.coef_, dtype=np.float64), np.asarray(model.intercept_, dtype=np.float64), classes)
        return probe, accuracy


def check_labels(texts: Sequence[str], labels: Sequence[Any] | None) -> None:
    """400 unless there is one label per text and at least two distinct labels."""
    if labels is None:
        raise MissingParameterError("Missing required parameter: 'labels' (one per text).", param="labels")
    if len(labels) != len(texts):
        raise InvalidRequestError(
            f"Invalid 'labels': {len(labels)} labels for {len(texts)} texts; give one label per text.", param="labels"
        )
    if len(set(labels)) < 2:
        raise InvalidRequestError("Invalid 'labels': a probe needs at least two distinct labels.", param="labels")
