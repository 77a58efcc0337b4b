"""Pydantic models of ``POST /v1/chat/completions``: the request, the response, and the streamed chunk.

Source: the OpenAI Chat Completions API reference; only text content is served by the resident model.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from .common import SEED_MAX, SEED_MIN, ChatTokenLogprob, RequestModel, ResponseModel, Usage


class TextContentPart(RequestModel):
    """A ``{"type": "text", "text": ...}`` part of a message's content."""

    type: Literal["text"]
    text: str


class ChatMessage(RequestModel):
    """One conversation turn. ``content`` is a string or a list of text parts."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The message's content as one string (parts joined without separator, as OpenAI does)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(RequestModel):
    include_usage: bool | None = None


class ChatCompletionRequest(RequestModel):
    """The request body. Fields the resident engine cannot honour are declared so that they are refused by name."""

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    n: int | None = Field(None, ge=1, le=128)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None


class ChatCompletionMessage(ResponseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None


class ChoiceLogprobs(ResponseModel):
    content: list[ChatTokenLogprob] | None
    refusal: list[ChatTokenLogprob] | None = None


class ChatChoice(ResponseModel):
    index: int
    message: ChatCompletionMessage
    logprobs: ChoiceLogprobs | None
    finish_reason: Literal["stop", "length"]


class ChatCompletion(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ChunkDelta(ResponseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(ResponseModel):
    index: int
    delta: ChunkDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionChunk(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
