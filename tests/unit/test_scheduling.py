"""The scheduling policy (issue 14), pure: batch hours on an injected clock, deadlines, priority, fair share, ETA."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from miserver.scheduling.policy import (
    BatchHours,
    Candidate,
    FairShare,
    Margin,
    RateOf,
    estimate_new,
    eta_from_progress,
    plan,
)

NOON = datetime(2026, 12, 1, 12, 0, tzinfo=UTC).timestamp()
DAY = 86400


def batch(
    batch_id: str, *, pending: int = 100, created: float = NOON - 60, window: int = DAY, **kw: object
) -> Candidate:
    values: dict[str, object] = {
        "id": batch_id,
        "priority": 0,
        "created_at": int(created),
        "expires_at": int(created) + window,
        "pending": pending,
        "owner": batch_id,
    }
    values.update(kw)
    return Candidate(**values)  # type: ignore[arg-type]


def rate(value: float | None) -> RateOf:
    return lambda _c: value


def test_batch_hours_parse_and_cross_midnight() -> None:
    assert BatchHours.parse(None) is None and BatchHours.parse("always") is None
    hours = BatchHours.parse("22:00-07:00", "Europe/Paris")
    assert hours is not None
    paris_23 = datetime(2026, 12, 1, 22, 0, tzinfo=UTC).timestamp()  # 23:00 in Paris (UTC+1 in December)
    assert hours.is_open(paris_23)
    assert not hours.is_open(NOON)  # 13:00 in Paris
    assert hours.next_open(NOON) == datetime(2026, 12, 1, 21, 0, tzinfo=UTC).timestamp()  # 22:00 Paris
    for bad in ("22-07", "25:00-01:00", "10:00-10:00"):
        with pytest.raises(ValueError, match="batch hours"):
            BatchHours.parse(bad)
    with pytest.raises(ValueError, match="time zone"):
        BatchHours.parse("22:00-07:00", "Mars/Olympus")


def test_off_peak_waits_then_starts_when_the_window_opens() -> None:
    hours = BatchHours.parse("22:00-07:00")
    b = batch("b", pending=100)
    day = plan([b], now=NOON, rate_of=rate(10.0), fair=FairShare(), hours=hours)
    assert day.order == () and day.waiting == {"b": "off_peak"}
    opens = datetime(2026, 12, 1, 22, 0, tzinfo=UTC).timestamp()
    assert day.eta["b"] == pytest.approx(opens + 10.0)  # starts when the window opens, 100 rows at 10 rows/s
    night = plan([b], now=opens + 1, rate_of=rate(10.0), fair=FairShare(), hours=hours)
    assert night.order == ("b",) and not night.waiting


def test_a_near_deadline_starts_a_batch_outside_batch_hours() -> None:
    hours = BatchHours.parse("22:00-07:00")
    margin = Margin(fraction=0.25, seconds=60)
    # 3,600 rows at 1 row/s: one hour of work, needing 4,560 s with the margin
    late = batch("late", pending=3600, created=NOON - DAY + 4000)  # 4,000 s left
    early = batch("early", pending=3600, created=NOON - DAY + 5000)  # 5,000 s left
    decision = plan([late, early], now=NOON, rate_of=rate(1.0), fair=FairShare(), hours=hours, margin=margin)
    assert decision.order == ("late",) and decision.waiting == {"early": "off_peak"}
    # the waiting one starts by its own trigger time, before the window opens
    assert decision.eta["early"] == pytest.approx(late.expires_at + 1000 - 4560 + 3600)
    # an unmeasured rate: urgent once half the window has passed
    unknown = plan([late, early], now=NOON, rate_of=rate(None), fair=FairShare(), hours=hours)
    assert set(unknown.order) == {"late", "early"} and unknown.eta == {"late": None, "early": None}


def test_priority_first_then_earliest_deadline_among_urgent_batches() -> None:
    low_urgent = batch("low", pending=3600, created=NOON - DAY + 1000)
    high = batch("high", pending=10, priority=5)
    urgent_later = batch("u2", pending=3600, created=NOON - DAY + 2000)
    relaxed = batch("relaxed", pending=10)
    decision = plan([relaxed, urgent_later, low_urgent, high], now=NOON, rate_of=rate(1.0), fair=FairShare())
    assert decision.order == ("high", "low", "u2", "relaxed")
    assert decision.queued == {"low", "u2", "relaxed"}
    assert decision.eta["high"] == pytest.approx(NOON + 10)
    assert decision.eta["low"] == pytest.approx(NOON + 10 + 3600)


def test_paused_batches_never_run() -> None:
    decision = plan([batch("p", paused=True), batch("r")], now=NOON, rate_of=rate(5.0), fair=FairShare())
    assert decision.order == ("r",) and decision.waiting == {"p": "paused"} and decision.eta["p"] is None


def test_fair_share_gives_a_newcomer_its_rows_before_a_large_batch_goes_on() -> None:
    """A 10-row batch created beside a 1,000-row one that already ran 400 rows: with chunks of 8, the small one runs
    its two chunks first (its head start), then they alternate."""
    fair = FairShare(credit_rows=16)
    big = batch("big", pending=1000)
    first = plan([big], now=NOON, rate_of=rate(10.0), fair=fair)
    assert first.order == ("big",)
    fair.charge(big, 400)
    small = batch("small", pending=10, created=NOON)
    served: list[str] = []
    pending = {"big": 600, "small": 10}
    for _ in range(6):
        cands = [batch(b, pending=n, created=NOON - 60 if b == "big" else NOON) for b, n in pending.items() if n]
        decision = plan(cands, now=NOON, rate_of=rate(10.0), fair=fair)
        chosen = next(c for c in cands if c.id == decision.order[0])
        rows = min(8, pending[chosen.id])
        pending[chosen.id] -= rows
        fair.charge(chosen, rows)
        served.append(chosen.id)
    assert served[:2] == ["small", "small"] and pending["small"] == 0
    assert served[2:] == ["big"] * 4
    assert small.id not in fair.batches, "a batch no longer active is forgotten"


def test_processor_sharing_eta_and_the_estimate_at_create() -> None:
    a, b = batch("a", pending=100), batch("b", pending=40)
    decision = plan([a, b], now=NOON, rate_of=rate(10.0), fair=FairShare())
    assert decision.eta["b"] == pytest.approx(NOON + 4 + 4)  # its 40 rows and 40 of a's, alongside
    assert decision.eta["a"] == pytest.approx(NOON + 10 + 4)
    higher = batch("h", pending=50, priority=1)
    seconds = estimate_new(20, priority=0, rate=10.0, others=[(a, None), (higher, 5.0)])
    assert seconds == pytest.approx(2 + 2 + 10)  # its own 20, a's 20 alongside, all 50 of the higher at 5/s


def test_eta_from_progress_keeps_the_rate_so_far() -> None:
    # 30 rows in 60 s: 0.5 rows/s, so 10 more take 20 s
    assert eta_from_progress(recorded=30, pending=10, since=1_000, now=1_060.0) == 1_080.0
    assert eta_from_progress(recorded=30, pending=0, since=1_000, now=1_060.0) == 1_060.0
    for recorded, since, now in ((0, 1_000, 1_060.0), (5, None, 1_060.0), (5, 1_060, 1_060.0)):
        assert eta_from_progress(recorded=recorded, pending=3, since=since, now=now) is None
