"""Text that is valid JSON but not valid Unicode: a JSON ``\\ud800``-``\\udfff`` escape that is not one half of a
surrogate pair decodes into a Python string no UTF-8 encoder accepts. Every request body is checked here before
anything else reads it."""

from __future__ import annotations

from typing import Any, NamedTuple

from ..errors import InvalidRequestError
from .common import param_path


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
