"""Hypothesis strategies of batch input files for ``/v1/chat/completions`` (issue 18, item 3): valid lines mixed
with mutated ones, and the oracle that says what an error line must name. Shared by the property tests
(``tests/unit/test_batch_lines_property.py``, ``tests/e2e/test_schema_fuzz.py``) and the fuzz target
(``tools/fuzz.py``).

A :class:`Line` is the raw bytes of one line plus what the generator knows: ``valid`` is True for an unmutated line
(it must run), False for a mutation that can only be refused, None when a mutation may or may not leave the line
valid (a removed optional field); ``obj`` is the line's JSON object when it has one (to check an error's ``param``).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

ENDPOINT = "/v1/chat/completions"
#: The model the fuzzed server serves (``tiny_server_process``'s default name).
MODEL = "tiny"
#: ``BATCH_MAX_LINE_BYTES``'s default: an upload with a longer line is refused whole (413), so lines stay below it.
MAX_LINE_BYTES = 1 << 20
#: Codes of errors about the line as a whole (no JSON object to name a field of).
WHOLE_LINE_CODES = {"invalid_json_line", "invalid_encoding"}
#: A placeholder that a mutation replaces in the encoded line (with text json.dumps cannot write).
HOLE = "\u2400HOLE\u2400"


@dataclass(frozen=True)
class Line:
    """One generated line: its bytes, whether it must run (True), must be refused (False) or either (None), the
    mutation that made it (``"valid"`` for none), and its JSON object when it has one."""

    raw: bytes
    valid: bool | None
    mutation: str
    obj: dict[str, Any] | None


# -- text -----------------------------------------------------------------------------------------------------------

#: Characters of every plane (no surrogates: those come as their own mutation).
ANY_CHAR = st.characters(min_codepoint=0, max_codepoint=0x10FFFF, exclude_categories=("Cs",))
PLANES = st.sampled_from([0x41, 0xE9, 0x4E2D, 0x1F600, 0x20000, 0x30000, 0xE0001, 0xF0000, 0x10FFFD]).map(chr)
TEXT = st.text(st.one_of(ANY_CHAR, PLANES), max_size=24)
#: Text a valid line carries: short, from the Basic Multilingual Plane, no control characters (a NUL in a prompt is
#: refused by some tokenizers; the mutations bring control characters and the other planes on their own). Two
#: messages of it stay far below the fuzzed model's context.
CLEAN_TEXT = st.text(
    st.characters(min_codepoint=0x20, max_codepoint=0xFFFD, exclude_categories=("Cs", "Cc")), min_size=1, max_size=12
)


# -- valid lines ----------------------------------------------------------------------------------------------------

MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": CLEAN_TEXT})
VALID_BODY = st.fixed_dictionaries(
    {"model": st.just(MODEL), "messages": st.lists(MESSAGE, min_size=1, max_size=2)},
    optional={
        "max_tokens": st.integers(1, 3),
        "temperature": st.sampled_from([0.0, 0.7, 1.0]),
        "seed": st.integers(0, 2**31),
        "top_p": st.sampled_from([0.5, 1.0]),
        "stop": st.sampled_from(["\n", ["a", "b"]]),
    },
)


def encode(obj: Any) -> bytes:
    """A JSON line as a client writes it (non-ASCII kept as UTF-8)."""
    return json.dumps(obj, ensure_ascii=False).encode()


def valid_object(custom_id: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": ENDPOINT, "body": {**body, "max_tokens": 2}}


# -- mutations ------------------------------------------------------------------------------------------------------

OTHER_TYPES = [None, True, 0, -1, 1.5, "s", [], {}, [1, "x"], {"k": "v"}]
NUMBER_FIELDS = ["max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "n", "top_logprobs"]
HUGE_NUMBERS = [10**40, -(10**40), -1, -0.5, 2**63, -(2**63) - 1, 1e308, -1e308, 0, math.inf, -math.inf, math.nan]


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path to a value inside ``obj`` (dict keys and list indexes)."""
    out: list[tuple[Any, ...]] = []
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else []
    for key, value in items:
        out.append((*prefix, key))
        out.extend(_paths(value, (*prefix, key)))
    return out


def _set(obj: Any, path: tuple[Any, ...], value: Any) -> None:
    for key in path[:-1]:
        obj = obj[key]
    obj[path[-1]] = value


def _delete(obj: Any, path: tuple[Any, ...]) -> None:
    for key in path[:-1]:
        obj = obj[key]
    del obj[path[-1]]


def _copy(obj: Any) -> Any:
    return json.loads(json.dumps(obj))


@st.composite
def mutated(draw: st.DrawFn, base: dict[str, Any]) -> Line:
    """``base`` (a valid line object) changed by one mutation."""
    kind = draw(
        st.sampled_from(
            [
                "wrong_type",
                "missing",
                "extra",
                "number",
                "deep",
                "surrogate",
                "control",
                "bom",
                "not_object",
                "bad_utf8",
                "line_field",
                "unicode",
                "near_limit",
                "stream",
            ]
        )
    )
    obj = _copy(base)
    if kind == "wrong_type":
        path = draw(st.sampled_from(_paths(obj)))
        value = draw(st.sampled_from(OTHER_TYPES))
        _set(obj, path, value)
        return Line(encode(obj), None, f"wrong_type {path}", obj)
    if kind == "missing":
        path = draw(st.sampled_from([p for p in _paths(obj) if not isinstance(p[-1], int)]))
        _delete(obj, path)
        return Line(encode(obj), None, f"missing {path}", obj)
    if kind == "extra":
        where = draw(st.sampled_from([(), ("body",), ("body", "messages", 0)]))
        key = "x_" + draw(TEXT)
        _set(obj, (*where, key), draw(st.sampled_from(OTHER_TYPES)))
        return Line(encode(obj), False, f"extra {where}", obj)
    if kind == "number":
        field = draw(st.sampled_from(NUMBER_FIELDS))
        value = draw(st.sampled_from(HUGE_NUMBERS))
        obj["body"][field] = value
        raw = json.dumps(obj, ensure_ascii=False).encode()  # inf and nan become Infinity and NaN
        return Line(raw, None, f"number {field}={value!r}", obj)
    if kind == "deep":
        depth = draw(st.sampled_from([64, 1000, 100_000]))
        obj["body"]["messages"][0]["content"] = HOLE
        raw = encode(obj).replace(b'"' + HOLE.encode() + b'"', b"[" * depth + b"]" * depth)
        return Line(raw, False, f"deep {depth}", None)
    if kind == "surrogate":
        escape = draw(st.sampled_from(["\\ud800", "\\udfff", "\\ud83d", "\\ude00x"]))
        where = draw(st.sampled_from([("body", "messages", 0, "content"), ("custom_id",), ("body", "model")]))
        _set(obj, where, HOLE)
        raw = encode(obj).replace(HOLE.encode(), escape.encode())
        return Line(raw, False, f"surrogate {where}", None)
    if kind == "control":
        char = draw(st.sampled_from(["\x00", "\x01", "\x1f", "\t", "\x0b", "\x0c"]))
        text = encode(obj).decode().replace('"content": "', '"content": "' + char, 1)
        return Line(text.encode(), False, f"control {ord(char):#x}", None)
    if kind == "bom":
        bom = draw(st.sampled_from([b"\xef\xbb\xbf", b"\xff\xfe", b"\xfe\xff"]))
        return Line(bom + encode(obj), False, f"bom {bom!r}", None)
    if kind == "not_object":
        raw = draw(st.sampled_from([b"[]", b"1", b"null", b'"x"', b"true", b"{", b"{}x", b"[1, 2]"]))
        return Line(raw, False, f"not_object {raw!r}", None)
    if kind == "bad_utf8":
        junk = draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80"]))
        raw = encode(obj).replace(b'"content": "', b'"content": "' + junk, 1)
        return Line(raw, False, f"bad_utf8 {junk!r}", None)
    if kind == "line_field":
        field, value = draw(
            st.sampled_from(
                [
                    ("custom_id", ""),
                    ("custom_id", "x" * 65),
                    ("custom_id", 7),
                    ("method", "GET"),
                    ("method", None),
                    ("url", "/v1/completions"),
                    ("url", "/chat/completions"),
                    ("body", []),
                    ("body", "x"),
                ]
            )
        )
        obj[field] = value
        return Line(encode(obj), False, f"line_field {field}={value!r}", obj)
    if kind == "unicode":
        obj["body"]["messages"][0]["content"] = draw(TEXT)
        return Line(encode(obj), None, "unicode", obj)
    if kind == "near_limit":
        room = MAX_LINE_BYTES - 1 - len(encode(obj)) - draw(st.integers(0, 64))
        obj["body"]["messages"][0]["content"] += "a" * room
        return Line(encode(obj), None, "near_limit", obj)
    obj["body"]["stream"] = True
    return Line(encode(obj), False, "stream", obj)


@st.composite
def batch_file(draw: st.DrawFn, min_lines: int = 1, max_lines: int = 12, max_near_limit: int = 1) -> list[Line]:
    """A batch file's lines: at least one valid line, the rest valid or mutated (unique custom_ids throughout; a
    mutation may break that, which the duplicate check then refuses). At most ``max_near_limit`` lines near the
    1 MiB limit."""
    count = draw(st.integers(min_lines, max_lines))
    lines: list[Line] = []
    near = 0
    for i in range(count):
        base = valid_object(f"row-{i}", draw(VALID_BODY))
        if i == 0 or draw(st.booleans()):
            lines.append(Line(encode(base), True, "valid", base))
            continue
        line = draw(mutated(base))
        if line.mutation == "near_limit":
            near += 1
            if near > max_near_limit:
                line = Line(encode(base), True, "valid", base)
        lines.append(line)
    return lines


# -- the oracle -----------------------------------------------------------------------------------------------------


def parse_param(param: str) -> tuple[Any, ...]:
    """``messages[0].content`` -> ``("messages", 0, "content")``."""
    out: list[Any] = []
    for name, index in re.findall(r"([^.\[\]]+)|\[(\d+)\]", param):
        out.append(int(index) if index else name)
    return tuple(out)


def _exists(obj: Any, path: tuple[Any, ...]) -> bool:
    for key in path:
        in_dict = isinstance(obj, dict) and isinstance(key, str) and key in obj
        in_list = isinstance(obj, list) and isinstance(key, int) and 0 <= key < len(obj)
        if not (in_dict or in_list):
            return False
        obj = obj[key]
    return True


def param_problem(line: Line, code: str | None, param: str | None) -> str | None:
    """Why an error's ``param`` does not name a field of the line (None when it does). A param names a field of the
    line (``custom_id``, ``body``...) or of its body (``messages[0].content``); a missing parameter names a field
    whose parent exists; only an error about the whole line (not JSON, not UTF-8) names none."""
    if not code:
        return f"no code (param {param!r})"
    if param is None:
        if line.obj is None or code in WHOLE_LINE_CODES or code == "invalid_type":
            return None
        return f"code {code} names no param"
    if line.obj is None:
        return None  # the line has no object to look in (a surrogate or deep nesting: the param names where)
    path = parse_param(param)
    for root in (line.obj, line.obj.get("body")):
        if _exists(root, path):
            return None
        if code == "missing_required_parameter" and _exists(root, path[:-1]):
            return None
    return f"param {param!r} (code {code}) is not a field of the line"
