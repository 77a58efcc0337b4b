"""A fake embedding engine for the runner's rules: deterministic vectors, counted executions, and gates a test opens.

It serves ``/v1/embeddings`` only (the runner's rules do not depend on the endpoint): each input's token ids are its
words' lengths, its vector is a function of them. ``executed`` lists every input run, in order, so a test can prove
that a row ran exactly once; ``hold`` (an :class:`asyncio.Event`, set by default) lets a test stop the engine inside
a row while it changes the world (cancel, record, re-read), with no sleeps.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np

from miserver.engines.base import EngineInfo, PoolRequest, Vector

MODEL = "fake"
HIDDEN = 4


class FakeEngine:
    """An engine with the embedding capability only (``embed``, ``embed_many``) and a word-length tokenizer."""

    def __init__(self, model_id: str = MODEL) -> None:
        self.info = EngineInfo(
            model_id=model_id,
            backend="serial",
            dtype="float32",
            weights_revision="fake-rev",
            context_length=64,
            hidden_size=HIDDEN,
            num_layers=1,
        )
        self.executed: list[tuple[int, ...]] = []
        self.hold = asyncio.Event()
        self.hold.set()
        self.entered = asyncio.Event()

    @property
    def vocab_size(self) -> int:
        return 100

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join("x" * i for i in ids)

    def tokenize(self, text: str) -> list[int]:
        return [min(len(w), 99) for w in text.split()]

    def tokenize_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        return [t for m in messages for t in self.tokenize(m["content"])]

    async def embed(self, request: PoolRequest) -> Vector:
        self.entered.set()
        await self.hold.wait()
        self.executed.append(request.prompt_ids)
        v = np.array([len(request.prompt_ids), sum(request.prompt_ids), 1.0, 0.5], dtype=np.float32)
        return v / np.linalg.norm(v) if request.normalize else v

    async def embed_many(self, requests: Sequence[PoolRequest]) -> list[Vector]:
        return [await self.embed(r) for r in requests]

    async def generate(self, request: Any) -> Any:
        raise NotImplementedError("the fake engine only embeds")

    def generate_stream(self, request: Any) -> AsyncIterator[Any]:
        raise NotImplementedError("the fake engine only embeds")

    async def score(self, request: Any) -> Any:
        raise NotImplementedError("the fake engine only embeds")

    async def score_many(self, requests: Sequence[Any]) -> list[Any]:
        raise NotImplementedError("the fake engine only embeds")

    async def close(self) -> None:
        return None
