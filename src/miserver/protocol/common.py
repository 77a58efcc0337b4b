"""Shared pieces of the protocol layer: the strict request base, parsing into OpenAI errors, usage.

Request models accept unknown fields (``extra="allow"``) so that strict mode can name them: a synchronous route
ignores them unless the request carries ``X-miLLM-Strict: true``; a batch line is always strict. Known fields that
the engine cannot honour are refused by the service with ``unsupported_parameter`` in both modes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from types import UnionType
from typing import Annotated, Any, Literal, NamedTuple, TypeVar, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, Tag, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails

from ..errors import (
    InvalidRequestError,
    MissingParameterError,
    UnknownParameterError,
    UnsupportedValueError,
)


class RequestModel(BaseModel):
    """Base of every request body: strict types (no ``"1"`` for a number), unknown fields kept for strict mode, and
    finite numbers only: Python's JSON reader turns ``NaN``, ``Infinity``, ``-Infinity`` and ``1e999`` into floats
    that no field means, so every float of every request model refuses them (400 naming the field)."""

    model_config = ConfigDict(strict=True, extra="allow", frozen=True, allow_inf_nan=False)


class ResponseModel(BaseModel):
    """Base of every response body."""

    model_config = ConfigDict(extra="forbid")


R = TypeVar("R", bound=RequestModel)

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


# -- text that is valid JSON but not valid Unicode ------------------------------------------------------------------


def _surrogate_at(text: str) -> int | None:
    """The index of the first unpaired surrogate in ``text`` (JSON's ``"\\ud800"``), or None when it encodes."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def printable(text: str) -> str:
    """``text`` with unpaired surrogates written as ``\\udXXX`` escapes (safe in a message, a log or a database)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class Unencodable(NamedTuple):
    """Where a decoded JSON value holds an unpaired surrogate: the path, the string, the index in it, and whether the
    string is a field name (then the path's last part is that name written with :func:`printable`)."""

    loc: tuple[int | str, ...]
    text: str
    at: int
    is_key: bool


def _any_surrogate(value: Any) -> bool:
    """Whether any string of a decoded JSON value (field names included) holds an unpaired surrogate: the walk of
    :func:`find_unpaired_surrogate` without building a path per node (measured at about 40% of ``json.loads`` per
    line of a 4 kB chat line, against more than 100% with paths), so the common case stays cheap."""
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            if not node.isascii() and _surrogate_at(node) is not None:
                return True
        elif isinstance(node, dict):
            stack.extend(node.values())
            stack.extend(node.keys())
        elif isinstance(node, list):
            stack.extend(node)
    return False


def find_unpaired_surrogate(value: Any, loc: tuple[int | str, ...] = ()) -> Unencodable | None:
    """The first string of a decoded JSON value, field name or value, that holds an unpaired surrogate, in document
    order; None when every string encodes as UTF-8. JSON allows ``"\\ud800"``, but no Unicode text holds it: it
    cannot be tokenised, stored or logged. Iterative, so that no nesting depth the JSON parser accepts overflows it.
    """
    if not _any_surrogate(value):
        return None  # the common case, walked without building a path per node
    stack: list[tuple[tuple[int | str, ...], Any] | Unencodable] = [(loc, value)]
    while stack:
        entry = stack.pop()
        if isinstance(entry, Unencodable):
            return entry
        where, node = entry
        if isinstance(node, str):
            at = _surrogate_at(node)
            if at is not None:
                return Unencodable(where, node, at, False)
        elif isinstance(node, dict):
            children: list[tuple[tuple[int | str, ...], Any] | Unencodable] = []
            for key, item in node.items():  # a key comes after the values of the keys before it
                if isinstance(key, str) and (at := _surrogate_at(key)) is not None:
                    children.append(Unencodable((*where, printable(key)), key, at, True))
                    break
                children.append(((*where, key), item))
            stack.extend(reversed(children))
        elif isinstance(node, list):
            stack.extend(((*where, i), item) for i, item in reversed(list(enumerate(node))))
    return None


def check_text(value: Any, loc: tuple[int | str, ...] = ()) -> None:
    """Raise 400 ``invalid_value`` naming the first string of ``value`` (a decoded JSON body) that holds an unpaired
    surrogate; the message says where in the text it is. ``loc`` is the path of ``value`` itself."""
    found = find_unpaired_surrogate(value, loc)
    if found is None:
        return
    param = param_path(found.loc) or None
    char = f"\\u{ord(found.text[found.at]):04x}"
    what = "field name" if found.is_key else "text"
    raise InvalidRequestError(
        f"Invalid value for '{param}': the {what} holds an unpaired surrogate ({char} at character {found.at}), "
        "which is not valid Unicode. Send UTF-8 text: a JSON \\ud800-\\udfff escape must be one half of a surrogate "
        "pair.",
        param=param,
    )


# -- validation errors as OpenAI errors -----------------------------------------------------------------------------


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


def _first_error(model_cls: type[BaseModel], body: Any, exc: ValidationError) -> InvalidRequestError:
    """The OpenAI error for a failed validation: one error, its ``param`` a path of the request (never the name of
    an internal type), its message saying what the field accepts."""
    located = [_locate(model_cls, e) for e in exc.errors(include_url=False)]
    return _choose(located, body)


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
        raise _first_error(model_cls, body, exc) from None
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
