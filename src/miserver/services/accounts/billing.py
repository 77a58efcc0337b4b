"""Prices, usage records, balances and queue quotas (issue 13).

Money is integer micro-units of the price table's currency (1 unit = 1,000,000 micro-units). The price table is a
JSON file (``MISERVER_PRICES_FILE``)::

    {"currency": "USD", "batch_discount": 0.5,
     "models": {"my-model": {"input": 150000, "output": 600000}, "*": {"input": 0, "output": 0}}}

``input``/``output`` are micro-units per million tokens at the realtime price; batch rows pay ``batch_discount``
times that (default 0.5: half price). ``"*"`` prices every model not listed; a model with no price costs nothing.
A line's cost is ``round((input_tokens * input + output_tokens * output) / 1e6)``, half up.

A batch's prices are fixed at its creation (:meth:`PriceTable.batch_snapshot`, stored on the batch): a later change
of the table does not re-price it. Usage records are written by :func:`record_realtime` (a synchronous request,
after its success, keyed by its request id) and by the batch runner in the transaction that records a row
(:func:`row_usage`, keyed by batch and line); see :mod:`miserver.store.usage`.
"""

from __future__ import annotations

import asyncio
import datetime
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection

from ...clock import now
from ...errors import InsufficientQuotaError, InvalidRequestError, NotFoundError, QueueQuotaError
from ...ids import random_id
from ...protocol.accounts import CostEstimate, UsageRow
from ...scheduling.admission import Priority
from ...store import Store
from ...store import keys as store_keys
from ...store import usage as store_usage
from ...store.usage import GROUPS, Usage
from ..inference.context import Call, ServiceContext, ServiceResult, StreamResult
from . import keys as accounts

MICRO = 1_000_000
#: The key a price table uses for "every other model".
ANY_MODEL = "*"


class PriceFileError(ValueError):
    """The price file cannot be read or does not have the documented shape (the message says where)."""


@dataclass(frozen=True)
class PriceTable:
    """Realtime prices per model (micro-units per million tokens: ``(input, output)``), the batch discount (a
    fraction of the realtime price, 0..1) and the currency's name."""

    models: dict[str, tuple[int, int]] = field(default_factory=dict)
    batch_discount: float = 0.5
    currency: str = "USD"

    @classmethod
    def load(cls, path: Path | None) -> PriceTable:
        """The table in ``path`` (None: an empty table, everything free). Raises :class:`PriceFileError`."""
        if path is None:
            return cls()
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise PriceFileError(f"price file {path}: {exc}") from None
        return cls.parse(raw, str(path))

    @classmethod
    def parse(cls, raw: Any, where: str = "price table") -> PriceTable:
        """The table of a decoded JSON document. Raises :class:`PriceFileError` naming the bad field."""
        if not isinstance(raw, dict):
            raise PriceFileError(f"{where}: expected a JSON object")
        unknown = set(raw) - {"currency", "batch_discount", "models"}
        if unknown:
            raise PriceFileError(f"{where}: unknown field {sorted(unknown)[0]!r}")
        discount = raw.get("batch_discount", 0.5)
        if isinstance(discount, bool) or not isinstance(discount, int | float) or not 0 <= discount <= 1:
            raise PriceFileError(f"{where}: 'batch_discount' must be a number from 0 to 1")
        currency = raw.get("currency", "USD")
        if not isinstance(currency, str):
            raise PriceFileError(f"{where}: 'currency' must be a string")
        models_raw = raw.get("models", {})
        if not isinstance(models_raw, dict):
            raise PriceFileError(f"{where}: 'models' must be an object of model id -> {{input, output}}")
        models: dict[str, tuple[int, int]] = {}
        for model, price in models_raw.items():
            if not isinstance(price, dict) or set(price) - {"input", "output"}:
                raise PriceFileError(f'{where}: models[{model!r}] must be {{"input": int, "output": int}}')
            values = [price.get("input", 0), price.get("output", 0)]
            if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values):
                raise PriceFileError(f"{where}: models[{model!r}] prices must be integers >= 0 (micro-units)")
            models[model] = (values[0], values[1])
        return cls(models=models, batch_discount=float(discount), currency=currency)

    def realtime(self, model: str) -> tuple[int, int]:
        """``(input, output)`` realtime price of ``model`` per million tokens (``"*"``, else free)."""
        return self.models.get(model, self.models.get(ANY_MODEL, (0, 0)))

    def batch(self, model: str) -> tuple[int, int]:
        """``(input, output)`` batch price of ``model``: the realtime price times the discount, rounded."""
        i, o = self.realtime(model)
        return round(i * self.batch_discount), round(o * self.batch_discount)

    def batch_snapshot(self) -> dict[str, list[int]]:
        """Every batch price now, as stored on a batch at its creation (``{model: [input, output]}``)."""
        return {model: list(self.batch(model)) for model in self.models}

    @property
    def enabled(self) -> bool:
        """Whether any price is set (an empty table makes every line free)."""
        return bool(self.models)


def price_from_snapshot(snapshot: dict[str, list[int]] | None, model: str) -> tuple[int, int]:
    """A batch's price for ``model`` from the snapshot taken at its creation (``"*"``, else free)."""
    if not snapshot:
        return 0, 0
    price = snapshot.get(model, snapshot.get(ANY_MODEL, [0, 0]))
    return int(price[0]), int(price[1])


def cost(price: tuple[int, int], input_tokens: int, output_tokens: int) -> int:
    """Micro-units for the tokens at ``price`` (per million), rounded half up."""
    return (input_tokens * price[0] + output_tokens * price[1] + MICRO // 2) // MICRO


def result_model(result: ServiceResult) -> str:
    """The model that served a result: its ``X-miLLM-Model`` header, else the body's ``model``."""
    return str(result.headers.get("X-miLLM-Model") or result.body.get("model") or "")


# -- realtime -----------------------------------------------------------------------------------------------------


async def record_realtime(
    store: Store,
    prices: PriceTable,
    principal: accounts.Principal,
    endpoint: str,
    model: str,
    input_tokens: int,
    output_tokens: int,
    request_id: str,
) -> bool:
    """Write the usage record of a successful synchronous request of ``principal`` and charge it (one transaction,
    unique per ``request_id``). Nothing for a caller without a key. Returns whether a record was written."""
    if principal.key_id is None:
        return False
    usage = Usage(
        key_id=principal.key_id,
        model=model,
        kind="realtime",
        endpoint=endpoint,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        cost=cost(prices.realtime(model), input_tokens, output_tokens),
        created_at=now(),
        request_id=request_id,
    )
    async with store.tx() as conn:
        return await store_usage.record_usage(conn, usage)


def _stream_usage(payload: str) -> tuple[int, int] | None:
    """``(input, output)`` tokens of a streamed event that reports usage (chat and completions with
    ``include_usage``, Responses' ``response.completed``, Anthropic's ``message_delta``); None otherwise."""
    if '"usage"' not in payload:
        return None
    text = payload.split("data: ", 1)[-1] if payload.startswith("event:") else payload
    try:
        event = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(event, dict):
        return None
    nested = event.get("response") or event.get("message") or {}
    usage = event.get("usage") or (nested.get("usage") if isinstance(nested, dict) else None)
    if not isinstance(usage, dict):
        return None
    i = usage.get("prompt_tokens", usage.get("input_tokens", 0)) or 0
    o = usage.get("completion_tokens", usage.get("output_tokens", 0)) or 0
    return int(i), int(o)


Create = Callable[[ServiceContext, Any, Call], Awaitable[ServiceResult | StreamResult]]


def billed(endpoint: str, create: Create) -> Create:
    """``create`` of an endpoint service, recording the usage of each successful synchronous call of a key (a
    stream: when it ends, from the producer's own count (:class:`StreamUsage`), else from the usage its events
    report). Batch calls (priority batch) pass through: the runner records
    their usage with the row."""

    async def run(ctx: ServiceContext, body: Any, call: Call) -> ServiceResult | StreamResult:
        result = await create(ctx, body, call)
        principal = accounts.current()
        if principal.key_id is None or call.priority is Priority.BATCH or ctx.store is None:
            return result
        store, prices = ctx.store, ctx.prices or PriceTable()
        if isinstance(result, ServiceResult):
            if result.status_code == 200:
                model = result_model(result)
                await record_realtime(
                    store,
                    prices,
                    principal,
                    endpoint,
                    model,
                    result.prompt_tokens,
                    result.completion_tokens,
                    random_id("req_"),
                )
            return result
        model = str(result.headers.get("X-miLLM-Model", ""))

        async def events() -> AsyncIterator[str]:
            # The last event is held back until the usage is recorded, so a client that has read the whole stream
            # can already see its usage. A client that goes away midway (its response task cancelled, or the
            # stream closed) is charged for the tokens computed until then.
            seen: tuple[int, int] | None = None  # Anthropic's stream tells input and output in separate events
            held: str | None = None
            try:
                async for payload in result.events:
                    found = _stream_usage(payload)
                    if found is not None:
                        seen = found if seen is None else (max(seen[0], found[0]), max(seen[1], found[1]))
                    if held is not None:
                        yield held
                    held = payload
            except (asyncio.CancelledError, GeneratorExit):
                so_far = (result.usage.prompt_tokens, result.usage.completion_tokens)
                if seen is not None:
                    so_far = (max(so_far[0], seen[0]), max(so_far[1], seen[1]))
                if any(so_far):  # runs to its end although this task is being cancelled
                    charge = record_realtime(store, prices, principal, endpoint, model, *so_far, random_id("req_"))
                    await store.finish(charge)
                raise
            if result.usage.known:  # the producer's own count, whether or not the client asked to see usage
                seen = (result.usage.prompt_tokens, result.usage.completion_tokens)
            if seen is not None:
                await store.finish(record_realtime(store, prices, principal, endpoint, model, *seen, random_id("req_")))
            if held is not None:
                yield held

        return StreamResult(events(), result.headers, result.usage)

    return run


# -- batches --------------------------------------------------------------------------------------------------------


def row_usage(
    *,
    owner: str | None,
    prices: dict[str, list[int]] | None,
    endpoint: str,
    batch_id: str,
    line: int,
    model: str,
    input_tokens: int,
    output_tokens: int,
) -> Usage | None:
    """The usage record of a successful batch row at the batch's own prices (None for a batch without an owner)."""
    if owner is None:
        return None
    return Usage(
        key_id=owner,
        model=model,
        kind="batch",
        endpoint=endpoint,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        cost=cost(price_from_snapshot(prices, model), input_tokens, output_tokens),
        created_at=now(),
        batch_id=batch_id,
        line=line,
    )


async def check_batch_create(conn: AsyncConnection, principal: accounts.Principal) -> None:
    """Before a batch of ``principal`` is created: 402 ``insufficient_quota`` when its balance is zero or below;
    429 when it already has its maximum of pending batches (``pending_batch_limit_exceeded``) or of enqueued input
    tokens (``token_limit_exceeded``); the message names the limit and the current value."""
    if principal.key_id is None:
        return
    key = await store_keys.get_key(conn, principal.key_id)
    if key is None:
        return
    if key.balance is not None and key.balance <= 0:
        raise InsufficientQuotaError(
            f"You exceeded your current quota: the balance of this API key is {key.balance} micro-units. "
            "Top it up to create batches."
        )
    if key.max_pending_batches is None and key.max_enqueued_tokens is None:
        return
    use = await store_keys.queue_use(conn, principal.key_id)
    if key.max_pending_batches is not None and use.pending_batches >= key.max_pending_batches:
        raise QueueQuotaError(
            f"Pending batch limit reached: this API key has {use.pending_batches} batches not yet finished; its limit "
            f"is {key.max_pending_batches}. Wait for one to finish or cancel one.",
            code="pending_batch_limit_exceeded",
        )
    if key.max_enqueued_tokens is not None and use.enqueued_tokens >= key.max_enqueued_tokens:
        raise QueueQuotaError(
            f"Enqueued token limit reached: this API key has {use.enqueued_tokens} input tokens in batches not yet "
            f"finished; its limit is {key.max_enqueued_tokens}.",
            code="token_limit_exceeded",
        )


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


def check_usage_query(group_by: str, kind: str | None, start: str | None, end: str | None) -> None:
    """``GET /api/usage`` parameters: ``group_by`` one of day/model/key, ``kind`` realtime/batch, days as
    ``YYYY-MM-DD``; else 400 naming the parameter."""
    if group_by not in GROUPS:
        raise InvalidRequestError(
            f"Invalid 'group_by': {group_by!r}. Use one of {', '.join(GROUPS)}.", param="group_by"
        )
    if kind is not None and kind not in ("realtime", "batch"):
        raise InvalidRequestError(f"Invalid 'kind': {kind!r}. Use 'realtime' or 'batch'.", param="kind")
    for name, value in (("start", start), ("end", end)):
        if value is None:
            continue
        try:
            datetime.date.fromisoformat(value)
        except ValueError:
            raise InvalidRequestError(f"Invalid '{name}': {value!r}. Use a day as YYYY-MM-DD.", param=name) from None


async def usage_rollup(
    store: Store,
    *,
    group_by: str,
    start: str | None,
    end: str | None,
    key: str | None,
    model: str | None,
    kind: str | None,
    currency: str,
) -> dict[str, Any]:
    """The usage rollup the current caller may read: its own key's (a ``key`` naming another key is refused with
    404, as if it did not exist), or any key's for an admin. Returns ``{object: "list", group_by, currency, data}``."""
    check_usage_query(group_by, kind, start, end)
    s = accounts.scope()
    if s is not None and key is not None and key != s:
        raise NotFoundError(f"No such API key: {key}", param="key", code="not_found")
    key_filter = key if s is None else s
    async with store.read() as conn:
        data = await store_usage.rollup(
            conn, group_by=group_by, start=start, end=end, key_id=key_filter, model=model, kind=kind
        )
    rows = [UsageRow(**row).model_dump(exclude_unset=True) for row in data]  # only the group_by's group field
    return {"object": "list", "group_by": group_by, "currency": currency, "data": rows}


async def estimate_file_cost(store: Store, ctx: ServiceContext, file_id: str, endpoint: str) -> dict[str, Any]:
    """The estimated cost of a batch over the input file ``file_id`` on ``endpoint`` at the current batch prices.

    Counts the request lines (JSON objects with a ``body``; other lines are skipped and counted as ``skipped_lines``),
    their input tokens (the resident model's tokenizer over the prompt text, :func:`estimate_input_tokens`) and an
    upper bound of their output tokens (each row's ``max_tokens`` times ``n``; rows that set none are counted in
    ``rows_without_max_tokens`` and bounded by nothing). Raises 400 for an endpoint a batch does not accept, 404 for
    a file that is not the caller's, 404 ``file_expired``, 503 when no model is resident (no tokenizer)."""
    from ...protocol.batches import BATCH_ENDPOINTS
    from ..batch_api import files as files_service

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


@dataclass(frozen=True)
class BatchStop:
    """Why a running batch ends ``failed`` because of its key: ``code`` (also the unrun rows' code) and
    ``message``."""

    code: str
    message: str

    def as_batch_error(self) -> dict[str, object]:
        """The ``batch.errors.data`` entry."""
        return {"code": self.code, "message": self.message, "param": None, "line": None}


@dataclass(frozen=True)
class BatchVerdict:
    """The owner key's say on a running batch before a chunk: ``fail`` (end it now), ``waiting`` (run nothing:
    ``insufficient_balance``), or neither (go on)."""

    fail: BatchStop | None = None
    waiting: bool = False


def batch_verdict(key: store_keys.KeyRecord | None, batch: Any, *, now: int, grace_seconds: float) -> BatchVerdict:
    """Pure rule: a missing or revoked key fails the batch (``key_revoked``); a balance at zero or below makes it
    wait (``insufficient_balance``) and, once it has waited ``grace_seconds`` (since ``batch.balance_waiting_since``;
    0: at once), fails it (``insufficient_quota``); otherwise it goes on."""
    if key is None or key.revoked_at is not None:
        return BatchVerdict(
            fail=BatchStop(
                "key_revoked",
                "The API key that created this batch was revoked; the batch stopped. Completed requests are in the "
                "output file and were billed; the others were not run and cost nothing.",
            )
        )
    if key.balance is None or key.balance > 0:
        return BatchVerdict()
    since = batch.balance_waiting_since
    if grace_seconds <= 0 or (since is not None and now - since >= grace_seconds):
        return BatchVerdict(
            fail=BatchStop(
                "insufficient_quota",
                f"The balance of this batch's API key ran out ({key.balance} micro-units) and was not topped up "
                "in time. Completed requests are in the output file and were billed; the others were not run and "
                "cost nothing.",
            )
        )
    return BatchVerdict(waiting=True)
