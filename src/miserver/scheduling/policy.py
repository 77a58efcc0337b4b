"""Which batch runs next: the pure policy of DESIGN §10 (priority, deadlines, batch hours, fair share) and the ETA.

No I/O and no clock of its own: the runner passes the candidates, the time (Unix seconds, from an injectable clock)
and the measured rates, and gets back a :class:`Decision`: the batches that may run now, best first, the waiting
reason of each batch that may not (``off_peak``, ``paused``), and each batch's estimated completion time.

The rules, in order:

1. A paused batch never runs (``paused``).
2. ``priority`` (an integer, higher first) orders batches before anything else.
3. A batch is *urgent* when its deadline needs it to run now: its estimated time to finish alone (pending rows over
   the measured rows/s of its model and endpoint), stretched by the safety margin, reaches the time left before its
   ``expires_at``. Urgent batches run earliest ``expires_at`` first, ahead of the others of their priority.
   A batch whose rate is not measured yet counts as urgent once half its window has passed.
4. Outside the batch hours (``MISERVER_BATCH_HOURS``) a batch that is not urgent waits (``off_peak``).
5. Batches that are not urgent are of equal urgency and share the engine fairly: round robin in rows served, per
   owner (its API key; the batch itself on a server without keys), then per batch of an owner. A newcomer starts
   two chunks ahead of the least-served active owner (it is not owed the past, but gets its first rows soon), so a
   10-row batch does not wait behind a 50,000-row one. The counts are the database's (``store.fair_share``), so
   every worker on one database ranks by the same shares.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, time, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

#: ``HH:MM-HH:MM`` (24-hour clock; the end may be earlier than the start: the window crosses midnight).
HOURS_PATTERN = re.compile(r"^([01][0-9]|2[0-3]):([0-5][0-9])-([01][0-9]|2[0-3]|24):([0-5][0-9])$")
#: A rate estimate: rows per second of a batch's model and endpoint, or None when not measured yet.
RateOf = Callable[["Candidate"], float | None]


@dataclass(frozen=True)
class BatchHours:
    """The daily window in which batches run without a deadline forcing them (``22:00-07:00`` in ``tz``)."""

    start: time
    end: time
    tz: ZoneInfo

    @classmethod
    def parse(cls, text: str | None, tz: str = "UTC") -> BatchHours | None:
        """``"22:00-07:00"`` -> the window; None, ``""`` or ``"always"`` -> None (always open).

        Raises ``ValueError`` naming the expected form for anything else, or for an unknown time zone."""
        if text is None or text.strip().lower() in ("", "always"):
            return None
        m = HOURS_PATTERN.match(text.strip())
        if not m:
            raise ValueError(f"batch hours {text!r}: expected HH:MM-HH:MM, e.g. 22:00-07:00, or 'always'")
        try:
            zone = ZoneInfo(tz)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"unknown time zone {tz!r}: use an IANA name such as UTC or Europe/Paris") from None
        h1, m1, h2, m2 = (int(g) for g in m.groups())
        start = time(h1, m1)
        end = time(0, 0) if h2 == 24 else time(h2, m2)
        if start == end:
            raise ValueError(f"batch hours {text!r}: the window is empty (start equals end); use 'always'")
        return cls(start, end, zone)

    def is_open(self, at: float) -> bool:
        """Whether the window is open at Unix time ``at``."""
        local = datetime.fromtimestamp(at, self.tz).time()
        if self.start < self.end:
            return self.start <= local < self.end
        return local >= self.start or local < self.end

    def next_open(self, at: float) -> float:
        """The first Unix time at or after ``at`` when the window is open."""
        if self.is_open(at):
            return at
        local = datetime.fromtimestamp(at, self.tz)
        opening = datetime.combine(local.date(), self.start, self.tz)
        if opening <= local:
            opening += timedelta(days=1)
        return opening.timestamp()


@dataclass(frozen=True)
class Candidate:
    """An ``in_progress`` batch as the policy sees it. Times are Unix seconds; ``pending`` counts rows not yet run;
    ``window`` is the completion window in seconds; ``owner`` is what fair share is counted per."""

    id: str
    priority: int
    created_at: int
    expires_at: int
    pending: int
    owner: str
    paused: bool = False

    @property
    def window(self) -> int:
        return max(1, self.expires_at - self.created_at)


@dataclass(frozen=True)
class Margin:
    """The safety margin of deadline decisions: a batch must start once the time left is no more than its estimated
    time to finish times ``1 + fraction``, plus ``seconds``."""

    fraction: float = 0.25
    seconds: float = 60.0

    def needed(self, work_seconds: float) -> float:
        return work_seconds * (1.0 + self.fraction) + self.seconds


@dataclass
class FairShare:
    """Rows served per owner and per batch (``owners``: owner -> rows, ``batches``: batch id -> rows).

    The runner fills it from the database before each plan (every worker on the database reads the same counts) and
    writes back the newcomers :meth:`admit` starts; :meth:`charge` is for a caller that keeps the counts here alone.
    ``credit_rows`` is the head start of a newcomer over the least-served active owner (the runner gives two chunks:
    a small batch created beside a large one then finishes in about its own time plus one chunk of the other)."""

    credit_rows: int = 16
    owners: dict[str, float] = field(default_factory=dict)
    batches: dict[str, float] = field(default_factory=dict)

    def charge(self, candidate: Candidate, rows: int) -> None:
        """Count ``rows`` served to ``candidate`` (after its chunk)."""
        self.owners[candidate.owner] = self.owners.get(candidate.owner, 0.0) + rows
        self.batches[candidate.id] = self.batches.get(candidate.id, 0.0) + rows

    def admit(self, candidates: Iterable[Candidate]) -> FairShare:
        """Start newcomers ``credit_rows`` ahead of the least-served active owner (batch); forget owners and batches no
        longer active. Returns the newcomers alone, with their starting counts (for a caller that stores them)."""
        active = list(candidates)
        owners = {c.owner for c in active}
        ids = {c.id for c in active}
        self.owners = {o: v for o, v in self.owners.items() if o in owners}
        self.batches = {b: v for b, v in self.batches.items() if b in ids}
        new = FairShare(credit_rows=self.credit_rows)
        floor = min(self.owners.values(), default=float(self.credit_rows))
        for owner in sorted(owners - self.owners.keys()):
            self.owners[owner] = new.owners[owner] = max(0.0, floor - self.credit_rows)
        owner_of = {c.id: c.owner for c in active}
        for c in active:
            if c.id not in self.batches:
                same = [v for b, v in self.batches.items() if owner_of.get(b) == c.owner]
                start = max(0.0, min(same, default=float(self.credit_rows)) - self.credit_rows)
                self.batches[c.id] = new.batches[c.id] = start
        return new

    def key(self, c: Candidate) -> tuple[float, float]:
        return self.owners.get(c.owner, 0.0), self.batches.get(c.id, 0.0)


@dataclass(frozen=True)
class Decision:
    """``order``: the batches that may run now, best first; ``queued``: those of them that wait for a batch ranked
    strictly ahead (higher priority, or a deadline that needs it first) rather than share with it; ``waiting``:
    id -> waiting reason of the others (``off_peak``, ``paused``); ``eta``: id -> estimated completion (Unix
    seconds), None when unknown."""

    order: tuple[str, ...]
    waiting: Mapping[str, str]
    eta: Mapping[str, float | None]
    queued: frozenset[str] = frozenset()


def eta_from_progress(*, recorded: int, pending: int, since: int | None, now: float) -> float | None:
    """When a batch finishes at the rate it has kept so far: ``recorded`` rows in the ``now - since`` seconds since
    it started running (Unix seconds), ``pending`` rows to go. None before it has recorded a row. For a batch whose
    rows run on upstream pools, which run side by side and do not share the resident engine's measured rate."""
    if since is None or recorded <= 0 or now <= since:
        return None
    return now + pending * (now - since) / recorded


def work_seconds(c: Candidate, rate: float | None) -> float | None:
    """Seconds to run ``c``'s pending rows alone at ``rate`` rows/s; None when the rate is unknown."""
    if rate is None or rate <= 0 or not math.isfinite(rate):
        return None
    return c.pending / rate


def urgent(c: Candidate, rate: float | None, now: float, margin: Margin) -> bool:
    """Whether ``c``'s deadline needs it to run now (rule 3)."""
    left = c.expires_at - now
    work = work_seconds(c, rate)
    if work is None:
        return left <= c.window / 2
    return left <= margin.needed(work)


def start_by(c: Candidate, rate: float | None, margin: Margin) -> float:
    """The latest Unix time at which ``c`` may still start and finish in its window (rule 3's trigger)."""
    work = work_seconds(c, rate)
    if work is None:
        return c.expires_at - c.window / 2
    return c.expires_at - margin.needed(work)


def plan(
    candidates: Iterable[Candidate],
    *,
    now: float,
    rate_of: RateOf,
    fair: FairShare,
    hours: BatchHours | None = None,
    margin: Margin | None = None,
) -> Decision:
    """Decide which batches may run now and in which order, and estimate when each one completes (see the module
    docstring for the rules). ``fair`` is updated for newcomers and departed batches (the runner has admitted them
    already, from the database's counts)."""
    margin = margin or Margin()
    active = list(candidates)
    fair.admit(active)
    rates = {c.id: rate_of(c) for c in active}
    is_urgent = {c.id: urgent(c, rates[c.id], now, margin) for c in active}
    open_now = hours is None or hours.is_open(now)
    waiting: dict[str, str] = {}
    runnable: list[Candidate] = []
    for c in active:
        if c.paused:
            waiting[c.id] = "paused"
        elif not open_now and not is_urgent[c.id]:
            waiting[c.id] = "off_peak"
        else:
            runnable.append(c)

    def rank(c: Candidate) -> tuple[int, int, float, float, float, str]:
        if is_urgent[c.id]:
            return (-c.priority, 0, float(c.expires_at), 0.0, 0.0, c.id)
        owner_served, batch_served = fair.key(c)
        return (-c.priority, 1, 0.0, owner_served, batch_served, c.id)

    runnable.sort(key=rank)
    eta: dict[str, float | None] = {}
    for c in active:
        if c.id in waiting:
            eta[c.id] = _eta_waiting(c, rates[c.id], now, hours, margin) if waiting[c.id] == "off_peak" else None
        else:
            eta[c.id] = _eta_running(c, runnable, rates, is_urgent, now)
    queued = frozenset(c.id for c in runnable if any(_ahead(o, c, is_urgent) for o in runnable if o.id != c.id))
    return Decision(tuple(c.id for c in runnable), waiting, eta, queued)


def _eta_waiting(
    c: Candidate, rate: float | None, now: float, hours: BatchHours | None, margin: Margin
) -> float | None:
    work = work_seconds(c, rate)
    if work is None:
        return None
    opens = hours.next_open(now) if hours is not None else now
    return min(opens, max(now, start_by(c, rate, margin))) + work


def _eta_running(
    c: Candidate,
    runnable: list[Candidate],
    rates: Mapping[str, float | None],
    is_urgent: Mapping[str, bool],
    now: float,
) -> float | None:
    """Processor sharing: every batch ranked strictly ahead of ``c`` (higher priority, or urgent while ``c`` is not,
    or urgent with an earlier deadline) runs all its rows first; a batch sharing fairly with ``c`` runs as many rows
    as ``c`` has left (or its own, if fewer) meanwhile."""
    own = work_seconds(c, rates[c.id])
    if own is None:
        return None
    total = own
    for o in runnable:
        if o.id == c.id:
            continue
        other_rate = rates[o.id]
        if other_rate is None or other_rate <= 0:
            continue
        if _ahead(o, c, is_urgent):
            total += o.pending / other_rate
        elif o.priority == c.priority and not is_urgent[o.id] and not is_urgent[c.id]:
            total += min(o.pending, c.pending) / other_rate
    return now + total


def _ahead(o: Candidate, c: Candidate, is_urgent: Mapping[str, bool]) -> bool:
    if o.priority != c.priority:
        return o.priority > c.priority
    if is_urgent[o.id] != is_urgent[c.id]:
        return is_urgent[o.id]
    return is_urgent[o.id] and (o.expires_at, o.id) < (c.expires_at, c.id)


def estimate_new(
    rows: int,
    *,
    priority: int,
    rate: float,
    others: Iterable[tuple[Candidate, float | None]],
) -> float:
    """Seconds a new batch of ``rows`` rows at ``priority`` needs to finish at ``rate`` rows/s, counting the rows
    ahead of it: every row of a batch of higher priority, and of a batch of the same priority the rows it runs while
    sharing fairly with the new one (as many as the new one has, or its own, if fewer). ``others`` pairs each active
    batch with its rate (None: its rows are counted at ``rate``)."""
    total = rows / rate
    for o, r in others:
        other_rate = r if r is not None and r > 0 else rate
        if o.priority > priority:
            total += o.pending / other_rate
        elif o.priority == priority:
            total += min(o.pending, rows) / other_rate
    return total
