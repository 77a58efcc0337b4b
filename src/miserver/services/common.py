"""Checks shared by the generation services: refused parameters, stop lists, context length."""

from __future__ import annotations

from typing import Any

from ..errors import ContextLengthError, InvalidRequestError, UnsupportedParameterError


def refuse_unsupported(fields: dict[str, Any]) -> None:
    """Raise 400 ``unsupported_parameter`` for the first field the resident engine cannot honour.

    ``fields`` maps a request's field names to their values. A field is refused when it asks for behaviour the
    engine lacks (tools, function calling, non-text response formats, logit bias, penalties, audio, suffix,
    best_of > n); neutral values (``None``, empty, 0, ``{"type": "text"}``) are accepted.
    """
    for name, value in fields.items():
        if value is None:
            continue
        if name in {"tools", "functions", "logit_bias", "modalities"} and not value:
            continue
        if name in {"frequency_penalty", "presence_penalty"} and value == 0:
            continue
        if name == "response_format" and value.get("type") == "text":
            continue
        if name == "parallel_tool_calls" or (name == "best_of" and value == 1):
            continue
        if name in {"tool_choice", "function_call"} and value in ("none", "auto"):
            continue
        if name == "modalities" and value == ["text"]:
            continue
        raise UnsupportedParameterError(
            f"Unsupported parameter: '{name}' is not supported by the resident engine.", param=name
        )


def check_stream_options(stream: bool | None, stream_options: object | None) -> None:
    """OpenAI refuses ``stream_options`` unless ``stream`` is true."""
    if stream_options is not None and stream is not True:
        raise InvalidRequestError(
            "'stream_options' is only allowed when 'stream' is true.", param="stream_options"
        )


def check_stop(stop: str | list[str] | None) -> None:
    """OpenAI allows a string or at most 4 strings."""
    if isinstance(stop, list) and len(stop) > 4:
        raise InvalidRequestError("Invalid 'stop': at most 4 stop sequences are allowed.", param="stop")


def check_context(prompt_tokens: int, max_tokens: int, context_length: int, *, param: str) -> None:
    """Raise 400 ``context_length_exceeded`` when the prompt plus ``max_tokens`` exceeds the context."""
    if prompt_tokens + max_tokens > context_length:
        raise ContextLengthError(
            f"This model's maximum context length is {context_length} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, {max_tokens} in the completion). "
            "Please reduce the length of the prompt or the completion.",
            param=param,
        )
