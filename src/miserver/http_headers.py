"""Header values made from user text, encoded so that any text can travel in an HTTP header.

An HTTP header carries bytes that servers and clients read as ISO-8859-1, and a name such as ``données_測試_😀.jsonl``
has no such form: building the header raises (``UnicodeEncodeError``) and the request answers 500. Every header
value that holds text a user chose (a file name, a model id, a weights revision) goes through here:

- :func:`content_disposition`: RFC 6266 with RFC 5987's ``filename*=UTF-8''…`` for any name that is not plain ASCII,
  beside an ASCII ``filename="…"`` fallback for clients that read only that;
- :func:`header_value`: printable ASCII as it is; any other value percent-encoded as UTF-8 (RFC 3986), so a client
  decodes it with ``urllib.parse.unquote``.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Mapping
from urllib.parse import quote

#: Characters RFC 5987's ``attr-char`` allows unencoded besides letters and digits.
_ATTR_CHARS = "!#$&+-.^_`|~"
#: What the ASCII fallback keeps: letters, digits and a few punctuation marks; anything else becomes ``_``.
_FALLBACK_UNSAFE = re.compile(r"[^A-Za-z0-9._\- ()\[\]+,]")
_PRINTABLE_ASCII = re.compile(r"[\x20-\x7e]*")


def content_disposition(filename: str, disposition: str = "attachment") -> str:
    """``attachment; filename="<ascii>"`` for a plain name; for any other name the ASCII fallback (accents dropped,
    other characters ``_``) plus ``filename*=UTF-8''<percent-encoded>`` (RFC 6266 §4.3: a client that knows
    ``filename*`` uses it). A name with nothing ASCII left falls back to ``download``."""
    decomposed = unicodedata.normalize("NFKD", filename).encode("ascii", "ignore").decode("ascii")
    fallback = _FALLBACK_UNSAFE.sub("_", decomposed).strip() or "download"
    value = f'{disposition}; filename="{fallback}"'
    if fallback != filename:
        value += f"; filename*=UTF-8''{quote(filename, safe=_ATTR_CHARS)}"
    return value


def header_value(text: str) -> str:
    """``text`` when it is printable ASCII (``\\x20``-``\\x7e``), else its UTF-8 percent-encoded (RFC 3986) form, which
    is printable ASCII too: never a character a header cannot carry, never a line break."""
    if _PRINTABLE_ASCII.fullmatch(text):
        return text
    return quote(text, safe="".join(chr(c) for c in range(0x21, 0x7F) if chr(c) != "%"))


def header_values(headers: Mapping[str, str]) -> dict[str, str]:
    """Every value of ``headers`` through :func:`header_value` (the names are ours, always ASCII)."""
    return {name: header_value(value) for name, value in headers.items()}
