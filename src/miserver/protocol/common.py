"""Shared pieces of the protocol layer: the strict request base, parsing into OpenAI errors, usage.

Request models accept unknown fields (``extra="allow"``) so that strict mode can name them: a synchronous route
ignores them unless the request carries ``X-miLLM-Strict: true``; a batch line is always strict. Known fields that
the engine cannot honour are refused by the service with ``unsupported_parameter`` in both modes.
"""

from __future__ import annotations

from functools import cache
from typing import Any, TypeVar, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import InvalidRequestError, MissingParameterError, UnknownParameterError


class RequestModel(BaseModel):
    """Base of every request body: strict types (no ``"1"`` for a number), unknown fields kept for strict mode."""

    model_config = ConfigDict(strict=True, extra="allow", frozen=True)


class ResponseModel(BaseModel):
    """Base of every response body."""

    model_config = ConfigDict(extra="forbid")


R = TypeVar("R", bound=RequestModel)

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


def _first_error(exc: ValidationError) -> InvalidRequestError:
    errors = exc.errors(include_url=False)
    # Prefer a missing field over a type error, then the first error in field order.
    missing = [e for e in errors if e["type"] == "missing"]
    err = missing[0] if missing else errors[0]
    loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p.startswith("function-"))))
    param = param_path(loc) or None
    if err["type"] == "missing":
        return MissingParameterError(f"Missing required parameter: '{param}'.", param=param)
    kind = err["type"]
    code = "invalid_type" if kind.endswith("_type") or kind in {"model_attributes_type", "list_type"} else "invalid_value"
    msg = err["msg"]
    return InvalidRequestError(f"Invalid value for '{param}': {msg}.", param=param, code=code)


def _holds_model(annotation: Any) -> bool:
    """Whether a field's type can hold a pydantic model (directly, in a list, in a union...)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return True
    return any(_holds_model(arg) for arg in get_args(annotation))


@cache
def _nested_fields(cls: type[BaseModel]) -> tuple[str, ...]:
    """The fields of ``cls`` that can hold a model, in declaration order (computed once per class)."""
    return tuple(name for name, info in cls.model_fields.items() if _holds_model(info.annotation))


def unknown_fields(model: BaseModel, prefix: tuple[int | str, ...] = ()) -> list[str]:
    """Every field the request carried that its model does not declare, as OpenAI param paths, in order.

    Visits only the fields that can hold a nested model and that the request carried (defaults hold no unknown
    fields): a batch line goes through here, so this is on the validation hot path.
    """
    found: list[str] = [param_path((*prefix, key)) for key in model.model_extra or ()]
    carried = model.model_fields_set
    for name in _nested_fields(type(model)):
        if name not in carried:
            continue
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            found.extend(unknown_fields(value, (*prefix, name)))
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                if isinstance(item, BaseModel):
                    found.extend(unknown_fields(item, (*prefix, name, i)))
    return found


def carried_fields(request: BaseModel, names: tuple[str, ...]) -> dict[str, Any]:
    """The fields among ``names`` that ``request`` carried, with their values, in the order of ``names``."""
    carried = request.model_fields_set
    return {name: getattr(request, name) for name in names if name in carried}


def parse_request(model_cls: type[R], body: Any, *, strict: bool) -> R:
    """Validate a decoded JSON body into ``model_cls``.

    Raises :class:`InvalidRequestError` (400) when the body is not an object or a field is invalid,
    :class:`MissingParameterError` for a missing required field, and, when ``strict``,
    :class:`UnknownParameterError` naming the first unknown field.
    """
    if not isinstance(body, dict):
        raise InvalidRequestError("The request body must be a JSON object.", param=None, code="invalid_type")
    try:
        request = model_cls.model_validate(body)
    except ValidationError as exc:
        raise _first_error(exc) from None
    if strict:
        extra = unknown_fields(request)
        if extra:
            raise UnknownParameterError(f"Unrecognized request argument supplied: {extra[0]}", param=extra[0])
    return request


class PromptTokensDetails(ResponseModel):
    """OpenAI's ``usage.prompt_tokens_details``: no prompt cache and no audio here, so zeros."""

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


class ListObject(ResponseModel):
    """The list envelope of ``/v1/files`` and ``/v1/batches``."""

    object: str = "list"
    data: list[Any]
    first_id: str | None
    last_id: str | None
    has_more: bool
