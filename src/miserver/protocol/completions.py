"""Pydantic models of ``POST /v1/completions`` (legacy text completions), request and response.

Source: the OpenAI Completions API reference. ``logprobs`` accepts 0-20 (vLLM's bound; OpenAI's is 5).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .chat import StreamOptions
from .common import SEED_MAX, SEED_MIN, RequestModel, ResponseModel, Stop, Usage

#: A prompt: one string, several strings, one token-id list, or several token-id lists.
Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(RequestModel):
    model: str
    prompt: Prompt
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    n: int | None = Field(None, ge=1, le=128)
    stop: Stop | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None


class CompletionLogprobs(ResponseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"] | None


class Completion(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None
    system_fingerprint: str | None = None
