"""The math of a linear probe: shapes refused by name, probabilities equal to scikit-learn's ``predict_proba``."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from sklearn.linear_model import LogisticRegression

from miserver.errors import APIError
from miserver.services.inference.linear_probe import LinearProbe, check_labels

H = 6


def data(classes: int, n: int = 60, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(classes, H)) * 2
    labels = rng.integers(0, classes, size=n)
    return centres[labels] + rng.normal(size=(n, H)), labels


@pytest.mark.parametrize("classes", [2, 4])
def test_fit_and_given_weights_score_as_sklearn(classes: int) -> None:
    x, y = data(classes)
    names = np.array(["a", "b", "c", "d"])[y]
    probe, accuracy = LinearProbe.fit(x, list(names), 0.5)
    reference = LogisticRegression(C=0.5, max_iter=2000).fit(x, names)
    assert probe.classes == tuple(str(c) for c in reference.classes_)
    assert np.allclose(probe.probabilities(x), reference.predict_proba(x), atol=1e-9)
    assert accuracy == pytest.approx(reference.score(x, names))
    weights, bias = probe.api_weights()
    again = LinearProbe.from_api(weights, bias, list(probe.classes), H)
    assert np.array_equal(again.probabilities(x), probe.probabilities(x))
    if classes == 2:
        assert isinstance(bias, float) and len(weights) == H  # binary: [hidden] and one number
    else:
        assert len(weights) == classes and len(bias) == classes  # type: ignore[arg-type]


def test_binary_probe_is_a_sigmoid() -> None:
    probe = LinearProbe.from_api([1.0] + [0.0] * (H - 1), -0.5, None, H)
    assert probe.classes == (0, 1)
    p = probe.probabilities(np.array([[0.5] + [9.0] * (H - 1), [3.0] + [0.0] * (H - 1)]))
    assert np.allclose(p[:, 1], [0.5, 1 / (1 + np.exp(-2.5))]) and np.allclose(p.sum(axis=1), 1)


BAD: list[tuple[str, dict[str, Any], str]] = [
    ("no bias", {"weights": [0.0] * H, "bias": None}, "bias"),
    ("wrong width", {"weights": [0.0] * (H + 1), "bias": 0.0}, "weights"),
    ("ragged rows", {"weights": [[0.0] * H, [0.0] * (H - 1), [0.0] * H], "bias": [0.0] * 3}, "weights"),
    ("bias count", {"weights": [[0.0] * H] * 3, "bias": [0.0] * 2}, "bias"),
    ("list bias for binary", {"weights": [0.0] * H, "bias": [0.0]}, "bias"),
    ("not finite", {"weights": [float("nan")] * H, "bias": 0.0}, "weights"),
    ("class count", {"weights": [0.0] * H, "bias": 0.0, "classes": ["a", "b", "c"]}, "classes"),
    ("repeated classes", {"weights": [[0.0] * H] * 3, "bias": [0.0] * 3, "classes": [1, 1, 2]}, "classes"),
]


@pytest.mark.parametrize(("case", "args", "param"), BAD, ids=[c[0] for c in BAD])
def test_bad_shapes_are_400_naming_the_field(case: str, args: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as info:
        LinearProbe.from_api(args["weights"], args["bias"], args.get("classes"), H)
    assert (info.value.status_code, info.value.param) == (400, param)


def test_labels_must_match_texts_and_differ() -> None:
    for labels in (None, ["a"], ["a", "a"]):
        with pytest.raises(APIError) as info:
            check_labels(["x", "y"], labels)
        assert info.value.param == "labels"
    check_labels(["x", "y"], [0, 1])
