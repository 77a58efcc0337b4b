"""The log filter: a credential in a message, its arguments or a traceback reads ``***``; the rest is kept."""

from __future__ import annotations

import io
import logging

from miserver.log_redaction import RedactingFilter, redact

KEY = "sk-" + "AbCdEfGh12345678" * 2


def test_redact_masks_credentials_and_keeps_the_rest() -> None:
    assert (
        redact(f"GET /v1/files?api_key={KEY}&limit=2&max_tokens=5") == "GET /v1/files?api_key=***&limit=2&max_tokens=5"
    )
    assert redact("?token=t0k&session_id=s1&password=p&x=1") == "?token=***&session_id=***&password=***&x=1"
    assert redact(f"upstream said: bad key {KEY}") == "upstream said: bad key sk-***"
    assert redact("Authorization: Bearer abc.def") == "Authorization: Bearer ***"
    assert redact("cookie miserver_console=abcd; other=1") == "cookie miserver_console=***; other=1"
    assert redact("whsec_c2VjcmV0LXZhbHVl") == "whsec_***"


def test_the_filter_rewrites_arguments_and_tracebacks() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(RedactingFilter())
    logger = logging.getLogger("tests.log_redaction")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("%s - %s", "127.0.0.1", f"/v1/files/{KEY}")
        try:
            raise ValueError(f"refused {KEY}")
        except ValueError:
            logger.exception("failed for %r", {"api_key": KEY})
    finally:
        logger.removeHandler(handler)
    out = stream.getvalue()
    assert KEY not in out and KEY[3:11] not in out
    assert "/v1/files/sk-***" in out and "ValueError: refused sk-***" in out
