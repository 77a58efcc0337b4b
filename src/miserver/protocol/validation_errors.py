"""Validation errors as OpenAI errors: one error per failed validation, its ``param`` a path of the request (never
the name of an internal type), its message saying what the field accepts (:func:`first_error`)."""

from __future__ import annotations

from dataclasses import dataclass
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, Tag, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails

from ..errors import InvalidRequestError, MissingParameterError, UnsupportedValueError
from .common import param_path


def _unwrap(annotation: Any) -> tuple[Any, list[Any]]:
    """``annotation`` without ``Annotated`` and without ``None`` in a union (one member left: that member)."""
    metadata: list[Any] = []
    while get_origin(annotation) is Annotated:
        for item in annotation.__metadata__:
            metadata.extend(item.metadata if isinstance(item, FieldInfo) else [item])
        annotation = get_args(annotation)[0]
    if _is_union(annotation):
        members = [m for m in get_args(annotation) if m is not type(None)]
        if len(members) == 1:
            return _unwrap(members[0])[0], metadata
    return annotation, metadata


def _is_union(annotation: Any) -> bool:
    return get_origin(annotation) in (Union, UnionType)


def _union_members(annotation: Any) -> list[Any]:
    return [m for m in get_args(annotation) if m is not type(None)]


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _tag_of(member: Any) -> str:
    """The name pydantic gives a union member in an error's location (``str``, ``list[int]``, a class name...)."""
    tags = [m.tag for m in getattr(member, "__metadata__", ()) if isinstance(m, Tag)]
    if tags:
        return tags[0]
    member, _ = _unwrap(member)
    if isinstance(member, type):
        return member.__name__
    origin, args = get_origin(member), get_args(member)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_tag_of(a) for a in args)}]"
    return str(member)


def _pick_member(annotation: Any, tag: int | str, following: int | str | None) -> Any:
    """The member of a union that pydantic named ``tag``; failing that, one that can hold the next location part."""
    members = _union_members(annotation)
    for member in members:
        if _tag_of(member) == tag:
            return member
    for member in members:
        inner, _ = _unwrap(member)
        origin = get_origin(inner) or inner
        if isinstance(following, int) and origin in (list, tuple):
            return member
        if isinstance(following, str) and (_is_model(inner) or origin is dict):
            return member
    return Any


@dataclass
class _Located:
    """One pydantic error with its location split into the request's own path and the unions it went through."""

    error: ErrorDetails
    path: tuple[int | str, ...]
    #: ``(path of the union's value, the member's tag, the union's annotation)`` from the outermost union inwards
    unions: list[tuple[tuple[int | str, ...], str, Any]]

    @property
    def kind(self) -> str:
        return str(self.error["type"])


def _locate(model_cls: type[BaseModel], error: ErrorDetails) -> _Located:
    """Split an error's ``loc`` into request path parts and union member tags, following the model's annotations.

    Pydantic puts the name of the union member it tried (``str``, ``list[str]``, ``function-after[...]``) into the
    location; those are no part of the request and never reach a ``param``.
    """
    loc = tuple(error["loc"])
    path: list[int | str] = []
    unions: list[tuple[tuple[int | str, ...], str, Any]] = []
    annotation: Any = model_cls
    i = 0
    while i < len(loc):
        part = loc[i]
        inner, _ = _unwrap(annotation)
        if _is_union(inner):
            unions.append((tuple(path), str(part), inner))
            annotation = _pick_member(inner, part, loc[i + 1] if i + 1 < len(loc) else None)
            i += 1
            continue
        i += 1
        if isinstance(part, str) and (part == "[key]" or part.startswith("function-")):
            continue
        path.append(part)
        origin = get_origin(inner)
        if _is_model(inner) and isinstance(part, str):
            field = inner.model_fields.get(part)
            annotation = field.annotation if field is not None else Any
        elif origin in (list, tuple) and isinstance(part, int):
            annotation = get_args(inner)[0] if get_args(inner) else Any
        elif origin is dict:
            annotation = get_args(inner)[1] if len(get_args(inner)) == 2 else Any
        else:
            annotation = Any
    return _Located(error, tuple(path), unions)


_SINGULAR = {str: "a string", int: "an integer", float: "a number", bool: "a boolean"}
_PLURAL = {str: "strings", int: "integers", float: "numbers", bool: "booleans"}


def describe(annotation: Any, *, plural: bool = False) -> str:
    """What a field accepts, in words: ``str | list[str]`` -> ``"a string or a list of strings"``."""
    inner, metadata = _unwrap(annotation)
    if _is_union(inner):
        words = list(dict.fromkeys(describe(m, plural=plural) for m in _union_members(inner)))
        if len(words) == 1:
            return words[0]
        return "values" if plural else ", ".join(words[:-1]) + " or " + words[-1]
    if inner in _SINGULAR:
        return _PLURAL[inner] if plural else _SINGULAR[inner]
    origin = get_origin(inner)
    if origin is Literal:
        values = ", ".join(repr(v) for v in get_args(inner))
        return f"values among {values}" if plural else f"one of {values}"
    if origin in (list, tuple):
        item = describe(get_args(inner)[0], plural=True) if get_args(inner) else "values"
        most = [m.max_length for m in metadata if getattr(m, "max_length", None) is not None]
        count = f"up to {most[0]} " if most else ""
        return f"lists of {count}{item}" if plural else f"a list of {count}{item}"
    if origin is dict or _is_model(inner):
        return "objects" if plural else "an object"
    return "values" if plural else "a value"


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    return "an object"


def _value_at(body: Any, path: tuple[int | str, ...]) -> Any:
    for part in path:
        try:
            body = body[part]
        except (KeyError, IndexError, TypeError):
            return None
    return body


def _is_type_error(kind: str) -> bool:
    return kind.endswith("_type")


#: Pydantic error types whose message names an internal class; replaced by the wording a JSON user reads.
_MESSAGES = {
    "model_type": "Input should be an object",
    "model_attributes_type": "Input should be an object",
    "dict_type": "Input should be an object",
}

#: Error types raised by the protocol's own validators (``PydanticCustomError``): the code is the type.
_CUSTOM_CODES = {"unsupported_value": UnsupportedValueError, "invalid_value": InvalidRequestError}


def _as_api_error(located: _Located) -> InvalidRequestError:
    err = located.error
    param = param_path(located.path) or None
    kind = located.kind
    if kind == "missing":
        return MissingParameterError(f"Missing required parameter: '{param}'.", param=param)
    if kind in _CUSTOM_CODES:
        return _CUSTOM_CODES[kind](f"Invalid value for '{param}': {err['msg']}", param=param, code=kind)
    code = "invalid_type" if _is_type_error(kind) else "invalid_value"
    msg = _MESSAGES.get(kind, err["msg"])
    if kind == "too_long" and "max_length" in err.get("ctx", {}):
        msg = f"at most {err['ctx']['max_length']} items are allowed, got {err['ctx'].get('actual_length')}"
    return InvalidRequestError(f"Invalid value for '{param}': {msg}.", param=param, code=code)


def _choose(located: list[_Located], body: Any, level: int = 0) -> InvalidRequestError:
    """The one error to report: a missing field first, then the first error in field order.

    When the error lies inside a union (``stop: str | list[str]``), the members are compared: the member whose error
    lies deepest in the value (``stop[1]`` for ``["a", 5]``) is the one the client meant and its error is reported;
    at the same depth, a member whose value fits its type but breaks a rule (``weights[1]`` not finite, for
    ``list[float] | list[list[float]]``) beats one whose type does not fit; when no member fits the value's JSON
    type, or several fit equally, the union itself is named with what it accepts (``Invalid type for 'stop':
    expected a string or a list of strings, got an integer.``).
    """
    first = next((x for x in located if x.kind == "missing" and len(x.unions) <= level), located[0])
    if len(first.unions) <= level:
        return _as_api_error(first)
    where, _, union = first.unions[level]
    group = [x for x in located if len(x.unions) > level and x.unions[level][0] == where]
    depth: dict[str, int] = {}
    for x in group:
        d = len(x.path) - len(where)
        # ranks: -1 the value's type does not fit the member at all; then by depth, a broken rule above a type error
        d = -1 if d == 0 and _is_type_error(x.kind) else 2 * d + (0 if _is_type_error(x.kind) else 1)
        tag = x.unions[level][1]
        depth[tag] = max(depth.get(tag, -2), d)
    best = max(depth.values())
    winners = [tag for tag, d in depth.items() if d == best]
    if best >= 0 and len(winners) == 1:
        return _choose([x for x in group if x.unions[level][1] == winners[0]], body, level + 1)
    param = param_path(where) or None
    accepts = describe(union)
    got = _json_kind(_value_at(body, where))
    if all(_is_type_error(x.kind) for x in group):
        return InvalidRequestError(
            f"Invalid type for '{param}': expected {accepts}, got {got}.", param=param, code="invalid_type"
        )
    return InvalidRequestError(f"Invalid value for '{param}': expected {accepts}.", param=param)


def first_error(model_cls: type[BaseModel], body: Any, exc: ValidationError) -> InvalidRequestError:
    """The OpenAI error for a failed validation: one error, its ``param`` a path of the request (never the name of
    an internal type), its message saying what the field accepts."""
    located = [_locate(model_cls, e) for e in exc.errors(include_url=False)]
    return _choose(located, body)
