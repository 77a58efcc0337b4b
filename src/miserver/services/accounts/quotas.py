"""Create-time quotas of a key: its balance, its pending batches and its enqueued input tokens."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncConnection

from ...errors import InsufficientQuotaError, QueueQuotaError
from ...store import keys as store_keys
from . import keys as accounts


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
