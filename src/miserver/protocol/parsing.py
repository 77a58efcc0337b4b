"""A decoded JSON body into a request model (:func:`parse_request`), with strict mode's unknown-field check and the
text check before anything reads the body."""

from __future__ import annotations

from functools import cache
from typing import Any, TypeVar, get_args

from pydantic import BaseModel, ValidationError

from ..errors import InvalidRequestError, UnknownParameterError
from .common import RequestModel, param_path
from .text import check_text
from .validation_errors import first_error

R = TypeVar("R", bound=RequestModel)


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

    Raises :class:`InvalidRequestError` (400) when the body is not an object, a string holds an unpaired surrogate
    (before anything else reads it) or a field is invalid,
    :class:`MissingParameterError` for a missing required field, and, when ``strict``,
    :class:`UnknownParameterError` naming the first unknown field.
    """
    if not isinstance(body, dict):
        raise InvalidRequestError("The request body must be a JSON object.", param=None, code="invalid_type")
    check_text(body)
    try:
        request = model_cls.model_validate(body)
    except ValidationError as exc:
        raise first_error(model_cls, body, exc) from None
    if strict:
        extra = unknown_fields(request)
        if extra:
            raise UnknownParameterError(f"Unrecognized request argument supplied: {extra[0]}", param=extra[0])
    return request
