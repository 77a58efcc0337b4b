"""Pydantic models of the accounts API: API keys (``/api/keys``, admin only), the caller's own key
(``/api/account``), usage rollups (``/api/usage``) and a batch input file's cost estimate
(``/v1/files/{id}/cost_estimate``). Money is in micro-units of the price table's currency (integers)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, RootModel

from .common import ALWAYS_STRICT, RequestModel, ResponseModel

#: The longest key name, in characters.
MAX_KEY_NAME_CHARS = 128
#: The largest amount of money or quota a request may set (2**53 - 1: exact in every JSON reader, and far from the
#: 64-bit columns' end however often a balance is topped up).
MAX_AMOUNT = 2**53 - 1

#: What a key may be allowed to use (OpenAI's project keys have permissions alike): ``inference`` (the synchronous
#: inference routes and the model list), ``batches`` (Batches and Message Batches), ``files`` (the Files API),
#: ``models:write`` (loading, unloading, weight writes, checkpoints, the catalogue and the model lease, all
#: of which change the model for every tenant) and ``admin`` (keys, everyone's usage).
Scope = Literal["inference", "batches", "files", "models:write", "admin"]
SCOPES: tuple[str, ...] = ("inference", "batches", "files", "models:write", "admin")
#: A key made with no ``scopes``, and every key made before scopes existed: everything but models:write and admin.
MEMBER_DEFAULT_SCOPES: tuple[str, ...] = ("inference", "batches", "files")


class KeyCreateRequest(RequestModel):
    """``POST /api/keys``: ``name`` (1-128 characters), ``admin``, ``balance`` (micro-units; null: unlimited) and
    the queue quotas (null: none). Always strict: an unknown field is refused (400 ``unknown_parameter``)."""

    model_config = ALWAYS_STRICT

    name: str = Field(min_length=1, max_length=MAX_KEY_NAME_CHARS)
    admin: bool = False
    balance: int | None = Field(default=None, ge=0, le=MAX_AMOUNT)
    max_pending_batches: int | None = Field(default=None, ge=0, le=MAX_AMOUNT)
    max_enqueued_tokens: int | None = Field(default=None, ge=0, le=MAX_AMOUNT)
    #: the scopes the key may use (null: the member default; ``admin`` here is the same as ``admin: true``)
    scopes: list[Scope] | None = Field(default=None, min_length=1)


class TopUpRequest(RequestModel):
    """``POST /api/keys/{id}/top_up``: ``amount`` micro-units (above 0) added to the key's balance. Always strict."""

    model_config = ALWAYS_STRICT

    amount: int = Field(ge=1, le=MAX_AMOUNT)


class KeyObject(ResponseModel):
    """An API key as the API shows it: never the key itself, except ``key`` in the answer of its creation (shown
    this once). ``balance`` null: unlimited; quotas null: none; ``revoked_at`` (Unix seconds) null while live."""

    id: str
    object: Literal["api_key"] = "api_key"
    name: str
    prefix: str
    admin: bool
    #: the scopes the key may use now (an admin key: every scope)
    scopes: list[str]
    balance: int | None
    max_pending_batches: int | None
    max_enqueued_tokens: int | None
    created_at: int
    revoked_at: int | None
    key: str | None = Field(default=None, description="The key itself: only in the answer of POST /api/keys.")


class KeyList(ResponseModel):
    """``GET /api/keys``: every key (revoked ones too), oldest first."""

    object: Literal["list"] = "list"
    data: list[KeyObject]


class AnonymousAccount(ResponseModel):
    """``GET /api/account`` on a server without API keys: the anonymous admin, unlimited."""

    id: None = None
    object: Literal["api_key"] = "api_key"
    name: str
    admin: Literal[True] = True
    balance: None = None


class Account(RootModel[KeyObject | AnonymousAccount]):
    """``GET /api/account``: the calling key's object, or the anonymous admin on a server without keys."""


class UsageRow(ResponseModel):
    """One group of a usage rollup: its group value (``day`` as ``YYYY-MM-DD``, ``model``, or ``key_id``, null for
    the anonymous caller; only the one of the rollup's ``group_by``) and its sums (``cost`` in micro-units)."""

    day: str | None = None
    model: str | None = None
    key_id: str | None = None
    requests: int
    input_tokens: int
    output_tokens: int
    cost: int


class UsageRollup(ResponseModel):
    """``GET /api/usage``: the usage summed per ``group_by``, ordered by the group."""

    object: Literal["list"] = "list"
    group_by: Literal["day", "model", "key"]
    currency: str
    data: list[UsageRow]


class CostEstimate(ResponseModel):
    """``GET /v1/files/{id}/cost_estimate``: the request lines of a batch input file, their input tokens (the
    resident model's tokenizer over the prompt text), an upper bound of their output tokens (each row's
    ``max_tokens`` times ``n``) and the batch's estimated cost in micro-units at the current batch prices (an upper
    bound when every row sets ``max_tokens``)."""

    object: Literal["batch.cost_estimate"] = "batch.cost_estimate"
    file_id: str
    endpoint: str
    rows: int
    skipped_lines: int
    input_tokens: int
    output_tokens_upper_bound: int
    rows_without_max_tokens: int
    estimated_cost: int
    estimated_cost_is_upper_bound: bool
    currency: str
    batch_discount: float
    note: str
