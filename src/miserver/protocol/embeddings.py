"""Pydantic models of ``POST /v1/embeddings``, request and response.

Source: the OpenAI Embeddings API reference (``CreateEmbeddingResponse``). miServer adds ``pooling``: ``mean``
(default) or ``last`` over the resident model's final hidden states. ``dimensions`` is accepted by the schema so that
it can be refused by name when it differs from the model's hidden size.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .common import RequestModel, ResponseModel

#: The inputs: one string, several strings, one token-id list, or several token-id lists.
EmbeddingInput = str | list[str] | list[int] | list[list[int]]
#: OpenAI's limit on the number of inputs of one request.
MAX_INPUTS = 2048


class EmbeddingRequest(RequestModel):
    model: str
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    pooling: Literal["mean", "last"] | None = None


class Embedding(ResponseModel):
    """One vector: a list of floats, or (``encoding_format: base64``) its little-endian float32 bytes in base64."""

    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(ResponseModel):
    prompt_tokens: int
    total_tokens: int


class CreateEmbeddingResponse(ResponseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
