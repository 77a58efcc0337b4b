"""Checks shared by the services: the JSON body, refused parameters, stop lists, context length."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ...errors import ContextLengthError, InvalidRequestError, UnsupportedParameterError
from ...protocol.text import check_text


def decode_json(raw: bytes) -> Any:
    """A request body's bytes as a JSON value; 400 ``invalid_json`` when they are not JSON (or not UTF-8), 400
    ``invalid_value`` naming the field when a string holds an unpaired surrogate (``"\\ud800"``: valid JSON, but
    no text; every route's body is refused here before anything reads it)."""
    try:
        value = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise InvalidRequestError(
            "We could not parse the JSON body of your request. Send valid JSON with Content-Type: application/json.",
            code="invalid_json",
        ) from None
    except RecursionError:
        raise InvalidRequestError(
            "The JSON body of your request is nested too deeply to be read.", code="invalid_json"
        ) from None
    check_text(value)
    return value


#: OpenAI's ``response_format`` types; only ``text`` is served (the others constrain decoding, which is not done).
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
#: ``service_tier`` values that ask for nothing but the one tier this server has.
NEUTRAL_SERVICE_TIERS = ("auto", "default")
#: Why a refused field cannot be honoured, where "not supported by this server" alone would leave the reader asking.
REFUSAL_REASONS = {
    "verbosity": "the resident model has no verbosity setting",
}


def check_response_format(value: dict[str, Any]) -> None:
    """400 ``invalid_value`` on ``response_format.type`` when the type is absent or not one of OpenAI's."""
    kind = value.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        accepted = ", ".join(f"'{t}'" for t in RESPONSE_FORMAT_TYPES)
        got = "is missing" if "type" not in value else f"is {kind!r}" if isinstance(kind, str) else "is not a string"
        raise InvalidRequestError(
            f"Invalid value for 'response_format.type': it {got}; it must be one of {accepted} (this server "
            "serves 'text').",
            param="response_format.type",
        )


def refuse_unsupported(fields: dict[str, Any]) -> None:
    """Raise 400 ``unsupported_parameter`` for the first of ``fields`` whose value is not neutral.

    ``fields`` maps request field names to their values, in order: the fields a service refuses on the resident
    engine, as the request carried them. A neutral value asks for nothing the engine would do otherwise and is
    accepted: ``None``; an empty ``functions``, ``tools``, ``logit_bias`` or ``modalities``; ``modalities:
    ["text"]``; ``store: false``; ``service_tier`` ``"auto"``/``"default"``; ``function_call`` or ``tool_choice``
    ``"none"``/``"auto"``; ``best_of: 1``; a penalty of 0; ``response_format: {"type": "text"}``; any
    ``parallel_tool_calls``. Any other value is refused by name, with its :data:`REFUSAL_REASONS` entry where it has
    one. A ``response_format`` of no known type is 400 ``invalid_value`` on ``response_format.type``.
    """
    for name, value in fields.items():
        if value is None:
            continue
        if name == "response_format":
            check_response_format(value)
        if name == "store" and value is False:
            continue
        if name == "service_tier" and value in NEUTRAL_SERVICE_TIERS:
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
        reason = f": {REFUSAL_REASONS[name]}" if name in REFUSAL_REASONS else ""
        raise UnsupportedParameterError(
            f"Unsupported parameter: '{name}' is not supported by this server{reason}.", param=name
        )


def refuse_message_names(messages: Sequence[Any]) -> None:
    """400 ``unsupported_parameter`` on ``messages[i].name`` for the first message that carries a ``name``.

    The resident model's chat template receives role and content only; a name would change nothing in the prompt,
    and a field the engine cannot honour is refused rather than silently ignored.
    """
    for i, message in enumerate(messages):
        if message.name is not None:
            raise UnsupportedParameterError(
                f"Unsupported parameter: 'messages[{i}].name': the model's chat template has no place for a "
                "participant name, so it would change nothing in the prompt. Remove it (or write the name into the "
                "content).",
                param=f"messages[{i}].name",
            )


def check_max_tokens(max_tokens: int | None, max_completion_tokens: int | None) -> None:
    """400 on ``max_tokens`` when it and ``max_completion_tokens`` (its newer name) are both given and differ: one of
    them would be ignored. The same value in both is accepted."""
    if max_tokens is not None and max_completion_tokens is not None and max_tokens != max_completion_tokens:
        raise InvalidRequestError(
            f"Invalid 'max_tokens': {max_tokens}, while 'max_completion_tokens' is {max_completion_tokens}. They are "
            "the same limit ('max_tokens' is its older name): send one of them.",
            param="max_tokens",
        )


def check_stream_options(stream: bool | None, stream_options: object | None) -> None:
    """OpenAI refuses ``stream_options`` unless ``stream`` is true."""
    if stream_options is not None and stream is not True:
        raise InvalidRequestError("'stream_options' is only allowed when 'stream' is true.", param="stream_options")


def check_stop(stop: str | list[str] | None) -> None:
    """OpenAI allows a string or at most 4 strings. An empty string can stop nothing: it is refused (400
    ``invalid_value`` naming it), never silently dropped."""
    if isinstance(stop, list) and len(stop) > 4:
        raise InvalidRequestError("Invalid 'stop': at most 4 stop sequences are allowed.", param="stop")
    sequences = [stop] if isinstance(stop, str) else stop or []
    for i, sequence in enumerate(sequences):
        if sequence == "":
            param = "stop" if isinstance(stop, str) else f"stop[{i}]"
            raise InvalidRequestError(f"Invalid '{param}': a stop sequence must not be empty.", param=param)


def check_context(prompt_tokens: int, max_tokens: int, context_length: int, *, param: str) -> None:
    """Raise 400 ``context_length_exceeded`` when the prompt plus ``max_tokens`` exceeds the context."""
    if prompt_tokens + max_tokens > context_length:
        raise ContextLengthError(
            f"This model's maximum context length is {context_length} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, {max_tokens} in the completion). "
            "Please reduce the length of the prompt or the completion.",
            param=param,
        )


#: OpenAI's bounds on ``metadata`` (batches, Responses): pairs, key and value lengths in characters
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


def check_metadata(metadata: dict[str, str] | None) -> None:
    """At most 16 pairs, keys of at most 64 characters, values of at most 512; else 400 (param ``metadata``).
    (That keys and values are strings is the request model's rule.)"""
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA_PAIRS:
        raise InvalidRequestError(
            f"Invalid 'metadata': at most {MAX_METADATA_PAIRS} key-value pairs.", param="metadata"
        )
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise InvalidRequestError(
                f"Invalid 'metadata': key {key[:20]!r}... is over {MAX_METADATA_KEY_CHARS} characters.",
                param="metadata",
            )
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise InvalidRequestError(
                f"Invalid 'metadata': the value of {key!r} is over {MAX_METADATA_VALUE_CHARS} characters.",
                param="metadata",
            )
