"""Webhook rules (issue 14): destinations, the retry schedule, Standard Webhooks signatures, the event shape."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
from standardwebhooks.webhooks import Webhook

from miserver.errors import InvalidRequestError
from miserver.jobs.webhook_delivery import MAX_ATTEMPTS, retry_delay, signed_headers
from miserver.services.batch_api import webhooks
from miserver.store.outbox import Delivery, event_payload


async def test_private_and_loopback_destinations_are_refused_unless_allowed() -> None:
    for url in ("http://127.0.0.1:9/x", "http://10.1.2.3/x", "http://[::1]/x", "http://169.254.169.254/latest"):
        with pytest.raises(webhooks.DestinationRefused, match="MISERVER_WEBHOOK_ALLOW_PRIVATE"):
            await webhooks.check_destination(url, allow_private=False)
        await webhooks.check_destination(url, allow_private=True)
    with pytest.raises(webhooks.DestinationRefused, match="does not resolve"):
        await webhooks.check_destination("http://no-such-host.invalid/x", allow_private=True)


def test_create_bodies_are_checked_naming_the_param() -> None:
    cases = [
        ({"url": "ftp://example.com/x", "events": ["batch.completed"]}, "url"),
        ({"url": "https://example.com/x", "events": []}, "events"),
        ({"url": "https://example.com/x", "events": ["batch.completed", "batch.completed"]}, "events"),
        ({"url": "https://example.com/x", "events": ["batch.completed", "batch.nope"]}, "events[1]"),
        ({"url": "https://example.com/x", "events": ["batch.failed"], "secret": "mine"}, "secret"),
    ]
    assert webhooks.check({"url": "https://example.com/x", "events": ["batch.progress"]}).events == ["batch.progress"]
    for body, param in cases:
        with pytest.raises(InvalidRequestError) as caught:
            webhooks.check(body)
        assert caught.value.param == param, body


def test_at_least_five_attempts_within_the_first_hour() -> None:
    delays = [retry_delay(n, 10.0) for n in range(1, MAX_ATTEMPTS + 1)]
    assert delays[-1] is None and all(d is not None for d in delays[:-1])
    elapsed, within_hour = 0.0, 1
    for d in delays[:-1]:
        assert d is not None
        elapsed += d
        within_hour += elapsed <= 3600
    assert within_hour >= 5


def test_signed_delivery_verifies_with_the_library_and_has_openai_event_shape() -> None:
    secret = webhooks.new_secret()
    payload = event_payload("evt_1", "batch.completed", "batch_1", 1_700_000_000)
    delivery = Delivery("msg_1", "evt_1", "batch.completed", "batch_1", payload, 0, "https://example.com", secret)
    at = datetime.now(UTC)
    headers = signed_headers(delivery, at)
    assert headers["webhook-id"] == "msg_1" and headers["webhook-timestamp"] == str(int(at.timestamp()))
    decoded = Webhook(secret).verify(payload, headers)
    assert decoded == json.loads(payload)
    assert decoded == {
        "id": "evt_1",
        "object": "event",
        "created_at": 1_700_000_000,
        "type": "batch.completed",
        "data": {"id": "batch_1"},
    }
