"""Faults the fuzzers of issue 18 found, each kept as a regular test of its whole class.

1. A positive temperature too small for ``logits / temperature`` to stay finite (``1e-300``; any value under
   about 1e-38 in float32) made the softmax NaN and ``torch.multinomial`` raise: a 500 on every generation route and
   a failed row in a batch. Such a temperature now samples its limit, the most likely token (``generate.sample``).
   Over HTTP: ``tests/e2e/test_schema_fuzz.py::test_a_vanishing_temperature_is_greedy``.
"""

from __future__ import annotations

import pytest
import torch

from miserver.engines.base import SamplingParams
from miserver.engines.local.generate import sample


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-46, 1e-40, 1e-39])
@pytest.mark.parametrize("top_p", [1.0, 0.5])
def test_a_vanishing_temperature_samples_the_most_likely_token(temperature: float, top_p: float) -> None:
    torch.manual_seed(0)
    for _ in range(20):
        logits = torch.randn(512) * 10
        params = SamplingParams(max_tokens=1, temperature=temperature, top_p=top_p, top_k=3)
        assert sample(logits, params, torch.Generator().manual_seed(1)) == int(torch.argmax(logits))


def test_an_ordinary_temperature_still_samples() -> None:
    """The guard changes nothing where the softmax is finite: at temperature 1 over equal logits the draws differ."""
    logits = torch.zeros(64)
    generator = torch.Generator().manual_seed(3)
    drawn = {sample(logits, SamplingParams(max_tokens=1, temperature=1.0), generator) for _ in range(50)}
    assert len(drawn) > 10
