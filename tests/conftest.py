"""Shared fixtures of the test suite."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.tiny_model import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with the real SmolLM2 tokenizer, saved as a transformers folder (built once a session).

    The tokenizer comes from ``MISERVER_CACHE_DIR`` (default ``~/.cache/miserver``), converted there if needed.
    """
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))
