"""The model lease belongs to the key that took it: its holder names that tenant's object, so no other tenant reads
it (a neutral word instead, in refusals too), and the same holder name renews it only for its owner."""

from __future__ import annotations

import pytest

from miserver.errors import ConflictError
from miserver.model_lease import NEUTRAL_BATCH_HOLDER, NEUTRAL_HOLDER, LeaseManager, shown_holder


def test_a_holder_is_shown_to_its_owner_and_to_an_unscoped_caller_only() -> None:
    leases = LeaseManager(clock=lambda: 1000.0)
    batch = leases.acquire("millm-batch:batch_abc", 60, "key_a")
    assert shown_holder(batch, "key_a") == "millm-batch:batch_abc"
    assert shown_holder(batch, None) == "millm-batch:batch_abc"  # an admin, or a server with no keys
    assert shown_holder(batch, "key_b") == NEUTRAL_BATCH_HOLDER
    leases.release(batch.lease)
    other = leases.acquire("deploy-7", 60, "key_a")
    assert shown_holder(other, "key_b") == NEUTRAL_HOLDER


def test_a_refusal_names_the_holder_only_to_its_owner() -> None:
    leases = LeaseManager(clock=lambda: 1000.0)
    leases.acquire("millm-batch:batch_abc", 60, "key_a")
    with pytest.raises(ConflictError) as refused:
        leases.acquire("mine", 60, "key_b")
    assert "batch_abc" not in refused.value.message and NEUTRAL_BATCH_HOLDER in refused.value.message
    with pytest.raises(ConflictError) as required:
        leases.require(None, "key_b")
    assert "batch_abc" not in required.value.message
    with pytest.raises(ConflictError) as own:
        leases.require(None, "key_a")
    assert "batch_abc" in own.value.message


def test_the_same_holder_name_renews_only_for_its_owner() -> None:
    leases = LeaseManager(clock=lambda: 1000.0)
    first = leases.acquire("deploy", 60, "key_a")
    assert leases.acquire("deploy", 120, "key_a").lease == first.lease  # the owner renews
    with pytest.raises(ConflictError):
        leases.acquire("deploy", 60, "key_b")  # another key never gets the token by naming the holder
    assert leases.current() is not None and leases.current().owner == "key_a"  # type: ignore[union-attr]


def test_a_server_with_no_keys_behaves_as_before() -> None:
    leases = LeaseManager(clock=lambda: 1000.0)
    first = leases.acquire("deploy", 60)
    assert leases.acquire("deploy", 60).lease == first.lease
    with pytest.raises(ConflictError) as refused:
        leases.acquire("other", 60)
    assert "'deploy'" in refused.value.message
