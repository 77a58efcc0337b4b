"""Helpers of the end-to-end batch tests: build JSON Lines inputs, submit, wait, read result files (with the SDK)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import openai
from openai.types import Batch

from miserver.protocol.batches import TERMINAL
from tests.support.server import wait_for

#: The order in which a batch may pass through its statuses (DESIGN §4), for checking an observed sequence.
STATUS_ORDER = {
    "validating": 0,
    "in_progress": 1,
    "finalizing": 2,
    "cancelling": 3,
    "completed": 4,
    "failed": 4,
    "expired": 4,
    "cancelled": 4,
}


def chat_body(content: str, *, model: str = "tiny", max_tokens: int = 2, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, **extra}


def line(custom_id: Any, body: dict[str, Any], *, url: str = "/v1/chat/completions", **extra: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body, **extra}


def jsonl(lines: Iterable[dict[str, Any] | str]) -> bytes:
    """One JSON document (or a raw string, kept as is) per line, each ending with a newline."""
    return "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()


def submit(client: openai.OpenAI, data: bytes, *, endpoint: str = "/v1/chat/completions", **create: Any) -> Batch:
    """Upload ``data`` and create a batch over it (``completion_window`` 24h unless given)."""
    uploaded = client.files.create(file=("input.jsonl", data), purpose="batch")
    create.setdefault("completion_window", "24h")
    return client.batches.create(input_file_id=uploaded.id, endpoint=endpoint, **create)  # type: ignore[arg-type]


def wait_terminal(client: openai.OpenAI, batch_id: str, timeout: float = 120.0) -> Batch:
    """Poll until the batch reaches a terminal status; returns it."""
    return wait_for(  # type: ignore[no-any-return]
        lambda: (b := client.batches.retrieve(batch_id)).status in TERMINAL and b, timeout=timeout
    )


def read_lines(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    """The decoded lines of a result file; ``[]`` for ``None`` (no such file)."""
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def api_error(fn: Any, *args: Any, **kwargs: Any) -> openai.APIStatusError:
    """Call ``fn`` and return the SDK's status error it raised (the test fails when it succeeds)."""
    try:
        fn(*args, **kwargs)
    except openai.APIStatusError as exc:
        return exc
    raise AssertionError(f"{getattr(fn, '__qualname__', fn)} succeeded; an error status was expected")


def error_of(exc: openai.APIStatusError) -> dict[str, Any]:
    """The ``error`` object of an SDK status error's body (the SDK unwraps the envelope into ``body``)."""
    body = exc.body
    assert isinstance(body, dict), body
    if "error" in body and isinstance(body["error"], dict):
        return body["error"]  # type: ignore[no-any-return]
    return body
