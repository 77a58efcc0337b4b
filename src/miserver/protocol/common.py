"""Shared pieces of the protocol layer: the request and response bases, fields several endpoints take (``stop``,
``seed``), OpenAI's param paths, and the usage and log-probability objects of the completion endpoints.

Request models accept unknown fields (``extra="allow"``) so that strict mode can name them: a synchronous route
ignores them unless the request carries ``X-miLLM-Strict: true``; a batch line is always strict. Known fields that
the engine cannot honour are refused by the service with ``unsupported_parameter`` in both modes. Parsing a body
into a request model is :mod:`~miserver.protocol.parsing`'s.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field


class RequestModel(BaseModel):
    """Base of every request body: strict types (no ``"1"`` for a number), unknown fields kept for strict mode, and
    finite numbers only: Python's JSON reader turns ``NaN``, ``Infinity``, ``-Infinity`` and ``1e999`` into floats
    that no field means, so every float of every request model refuses them (400 naming the field)."""

    model_config = ConfigDict(strict=True, extra="allow", frozen=True, allow_inf_nan=False)


#: The config of a request model whose parse is always strict (management calls: keys, batch creation). Unknown
#: fields are kept (extra="allow") so that the parse names the first one with 400 ``unknown_parameter``; the
#: document says that no other field is accepted.
ALWAYS_STRICT = ConfigDict(strict=True, extra="allow", frozen=True, json_schema_extra={"additionalProperties": False})


class ResponseModel(BaseModel):
    """Base of every response body."""

    model_config = ConfigDict(extra="forbid")


#: ``stop``: one string or up to 4 (OpenAI's bound), as the chat and text completion endpoints take it.
Stop = str | Annotated[list[str], Field(max_length=4)]

#: ``seed`` must fit a signed 64-bit integer (torch's generator seed; vLLM and OpenAI take 64-bit seeds too).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


def param_path(loc: tuple[int | str, ...]) -> str:
    """OpenAI's way of naming a nested field: ``("messages", 0, "content")`` -> ``messages[0].content``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


class PromptTokensDetails(ResponseModel):
    """OpenAI's ``usage.prompt_tokens_details``: zeros. No audio here; the resident engine does reuse the keys and
    values of prompt prefixes it holds, with the same bits, but every prompt token is counted and priced alike, so
    none is reported as cached (vLLM's default too)."""

    cached_tokens: int = 0
    audio_tokens: int = 0


class CompletionTokensDetails(ResponseModel):
    """OpenAI's ``usage.completion_tokens_details``: no reasoning, audio or predicted outputs here, so zeros."""

    reasoning_tokens: int = 0
    audio_tokens: int = 0
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class Usage(ResponseModel):
    """Token counts of one response (OpenAI ``usage``), with the detail objects OpenAI always sends.

    ``completion_tokens`` counts every token generated, those of a stop string and an end-of-sequence token included.
    """

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    completion_tokens_details: CompletionTokensDetails = Field(default_factory=CompletionTokensDetails)


class TopLogprob(ResponseModel):
    """One alternative at a position: ``token`` its text (OpenAI's ``bytes:\\xNN`` form when its bytes are not
    valid UTF-8), ``bytes`` its own UTF-8 bytes from the vocabulary."""

    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(ResponseModel):
    """One generated token: as :class:`TopLogprob`; the ``bytes`` of a message's tokens join to its content."""

    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]
