"""The waiting helpers (tests/support/waiting.py) fail when the condition never comes, naming the last state seen.

Every test that waits on a condition relies on this: a helper that returned quietly at its deadline would let the
test go on as if the condition had come (the old ``eventually`` of test_runner_rules did exactly that).
"""

from __future__ import annotations

import time

import pytest

from tests.support.waiting import eventually, stays, until


async def test_until_returns_the_value_that_satisfied_it() -> None:
    seen = iter(range(100))
    assert await until(lambda: next(seen), lambda n: n >= 3, timeout=5) == 3


async def test_until_raises_with_the_last_observed_value_when_time_runs_out() -> None:
    seen = iter(range(10**9))
    started = time.monotonic()
    expected = r"the counter at 10\*\*9 did not happen within 0.05 s; last observed: \d+"
    with pytest.raises(AssertionError, match=expected):
        await until(lambda: next(seen), lambda n: n >= 10**9, what="the counter at 10**9", timeout=0.05)
    assert time.monotonic() - started < 5, "it gave up at its timeout"


async def test_eventually_returns_the_awaited_value_that_satisfied_it() -> None:
    seen = iter(range(100))

    async def observe() -> int:
        return next(seen)

    assert await eventually(observe, lambda n: n >= 3, timeout=5) == 3


async def test_eventually_raises_with_the_last_observed_value_when_time_runs_out() -> None:
    observed: list[str] = []

    async def observe() -> str:
        observed.append(f"state-{len(observed)}")
        return observed[-1]

    with pytest.raises(AssertionError) as raised:
        await eventually(observe, lambda s: s == "never", what="the batch completed", timeout=0.05)
    message = str(raised.value)
    assert message.startswith("the batch completed did not happen within 0.05 s"), message
    assert f"last observed: {observed[-1]!r}" in message, "it names the last state observed, not an earlier one"
    assert len(observed) >= 2, "it kept observing until the time ran out"


async def test_eventually_with_the_default_predicate_raises_on_a_falsy_value() -> None:
    async def observe() -> int:
        return 0

    with pytest.raises(AssertionError, match="last observed: 0"):
        await eventually(observe, timeout=0.02)


async def test_stays_returns_while_the_condition_holds_and_raises_once_it_breaks() -> None:
    assert await stays(lambda: 1, lambda n: n == 1, seconds=0.02) == 1
    seen = iter(range(10**9))
    with pytest.raises(AssertionError, match=r"nothing read no longer held; observed: 3"):
        await stays(lambda: next(seen), lambda n: n < 3, what="nothing read", seconds=10)
