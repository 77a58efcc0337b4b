"""Cost estimates of a batch before it is created: the input tokens of an uploaded file's rows (the resident
model's tokenizer over the prompt text), an upper bound of their output tokens, and the cost at batch prices."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from ...errors import InvalidRequestError
from ...protocol.accounts import CostEstimate
from ...store import Store
from ..accounts.prices import PriceTable, cost
from ..inference.context import ServiceContext


def _texts(value: Any, out: list[str], ids: list[int]) -> None:
    if isinstance(value, str):
        out.append(value)
    elif isinstance(value, list):
        if value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            ids.append(len(value))
        else:
            for v in value:
                _texts(v, out, ids)
    elif isinstance(value, dict):
        for k in ("content", "text", "input", "prompt"):
            if k in value:
                _texts(value[k], out, ids)


#: Body fields whose text is the prompt, on every batch endpoint.
PROMPT_FIELDS = ("messages", "prompt", "input", "system", "instructions")


def estimate_input_tokens(tokenize: Callable[[str], list[int]], body: dict[str, Any]) -> int:
    """Input tokens of a request body, counted with the model's tokenizer over its prompt text (messages, prompt,
    input, system, instructions; token-id lists by length). The chat template's few tokens are not counted."""
    texts: list[str] = []
    ids: list[int] = []
    for name in PROMPT_FIELDS:
        if name in body:
            _texts(body[name], texts, ids)
    return sum(len(tokenize(t)) for t in texts if t) + sum(ids)


def max_output_tokens(body: dict[str, Any], default: int) -> int:
    """The most output tokens a body may produce: ``max_completion_tokens``/``max_tokens``/``max_output_tokens``
    times ``n``; ``default`` when it sets none; 0 for embeddings and probes (no ``max_*`` field, no generation)."""
    limit = body.get("max_completion_tokens") or body.get("max_tokens") or body.get("max_output_tokens")
    if limit is None:
        return default if "messages" in body or "prompt" in body else 0
    n = body.get("n") or 1
    return int(limit) * int(n)


async def estimate_file_cost(store: Store, ctx: ServiceContext, file_id: str, endpoint: str) -> dict[str, Any]:
    """The estimated cost of a batch over the input file ``file_id`` on ``endpoint`` at the current batch prices.

    Counts the request lines (JSON objects with a ``body``; other lines are skipped and counted as ``skipped_lines``),
    their input tokens (the resident model's tokenizer over the prompt text, :func:`estimate_input_tokens`) and an
    upper bound of their output tokens (each row's ``max_tokens`` times ``n``; rows that set none are counted in
    ``rows_without_max_tokens`` and bounded by nothing). Raises 400 for an endpoint a batch does not accept, 404 for
    a file that is not the caller's, 404 ``file_expired``, 503 when no model is resident (no tokenizer)."""
    from ...protocol.batches import BATCH_ENDPOINTS
    from . import files as files_service

    if endpoint not in BATCH_ENDPOINTS:
        raise InvalidRequestError(
            f"Invalid 'endpoint': {endpoint!r}. Supported: {', '.join(BATCH_ENDPOINTS)}.", param="endpoint"
        )
    _record, content = await files_service.open_content(store, file_id)
    engine = ctx.require_engine()
    prices = ctx.prices or PriceTable()
    rows = skipped = unbounded = input_tokens = output_tokens = total_cost = 0
    buffer = b""

    def account(raw: bytes) -> None:
        nonlocal rows, skipped, unbounded, input_tokens, output_tokens, total_cost
        if not raw.strip():
            return
        try:
            line = json.loads(raw)
            body = line["body"]
            assert isinstance(body, dict)
        except (ValueError, KeyError, TypeError, AssertionError):
            skipped += 1
            return
        rows += 1
        i = estimate_input_tokens(engine.tokenize, body)
        o = max_output_tokens(body, -1)
        if o < 0:
            unbounded += 1
            o = 0
        input_tokens += i
        output_tokens += o
        model = str(body.get("model") or engine.info.model_id)
        total_cost += cost(prices.batch(model), i, o)

    async for piece in content:
        buffer += piece
        *lines, buffer = buffer.split(b"\n")
        for raw in lines:
            account(raw)
    account(buffer)
    return CostEstimate(
        file_id=file_id,
        endpoint=endpoint,
        rows=rows,
        skipped_lines=skipped,
        input_tokens=input_tokens,
        output_tokens_upper_bound=output_tokens,
        rows_without_max_tokens=unbounded,
        estimated_cost=total_cost,
        estimated_cost_is_upper_bound=unbounded == 0,
        currency=prices.currency,
        batch_discount=prices.batch_discount,
        note="Input tokens are counted with the resident model's tokenizer over the prompt text (chat template "
        "tokens excluded); output tokens are each row's max_tokens, an upper bound of what it may produce.",
    ).model_dump()
