"""A checkpoint of the real embedded model (SmolLM2-135M-Instruct, issue 15): saved, reloaded, and scoring a prompt
with logprobs identical to the weights it was saved from; the reloaded checkpoint keeps the saved revision."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from miserver.settings import EMBEDDED_MODEL_ID
from tests.support.server import ServerProcess

pytestmark = pytest.mark.slow

SCORE = {"prompt": "The capital of France is", "max_tokens": 1, "logprobs": 5, "temperature": 0, "echo": False}


def top_logprobs(http: httpx.Client, model: str) -> object:
    answer = http.post("/v1/completions", json={**SCORE, "model": model})
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["logprobs"]["top_logprobs"]


def test_a_smollm2_checkpoint_reloads_with_identical_logits(tmp_path: Path) -> None:
    with ServerProcess(data_dir=tmp_path / "var") as server:
        http = server.http()
        before = top_logprobs(http, EMBEDDED_MODEL_ID)
        saved = http.post("/api/checkpoints", json={"model": "smollm2-ck"})
        assert saved.status_code == 200, saved.text
        ck = saved.json()
        assert ck["base_model"] == EMBEDDED_MODEL_ID and ck["bytes"] > 100_000_000
        assert top_logprobs(http, "smollm2-ck") == before  # the renamed resident weights: unchanged
        renamed = http.post("/v1/completions", json={**SCORE, "model": EMBEDDED_MODEL_ID})
        assert renamed.status_code == 404 and "'smollm2-ck'" in renamed.json()["error"]["message"]
        assert http.post("/api/models/load", json={"model": EMBEDDED_MODEL_ID}).status_code == 200
        loaded = http.post("/api/models/load", json={"model": "smollm2-ck"})
        assert loaded.status_code == 200, loaded.text
        assert loaded.json()["weights_revision"] == ck["weights_revision"]
        assert top_logprobs(http, "smollm2-ck") == before
