"""Group commit of a read-ahead chunk (``batches.chunks.grouped``): outcomes that finish while the recorder is busy
are recorded together; a lone outcome is not held back; errors and closing behave as the row loop needs."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from miserver.batches.chunks import grouped, one_by_one
from miserver.errors import EngineUnavailableError, InvalidRequestError
from miserver.services.inference.many import Outcome
from tests.support.waiting import stays, until


def outcome(i: int) -> Outcome:
    return Outcome(i, InvalidRequestError(f"row {i}"), False)


class Source:
    """An outcome source the test feeds by hand (``release(n)`` lets ``n`` more rows finish); it notes whether it
    was closed, and ``sent`` counts the outcomes it handed out (:meth:`sent_reaches` waits for a count)."""

    def __init__(self, total: int, fail_after: int | None = None) -> None:
        self.total = total
        self.fail_after = fail_after
        self.ready = asyncio.Semaphore(0)
        self.closed = False
        self.sent = 0

    def release(self, n: int) -> None:
        for _ in range(n):
            self.ready.release()

    async def sent_reaches(self, n: int) -> None:
        """Wait until ``n`` outcomes were handed out. The reader puts each one in its queue before it can be
        suspended again (no await between), so once this returns those outcomes are in the queue."""
        await until(lambda: self.sent, lambda k: k >= n, what=f"{n} outcomes handed out")

    async def outcomes(self) -> AsyncIterator[Outcome]:
        try:
            for i in range(self.total):
                if self.fail_after is not None and i == self.fail_after:
                    raise EngineUnavailableError("gone")
                await self.ready.acquire()
                self.sent += 1
                yield outcome(i)
        finally:
            self.closed = True


async def test_outcomes_that_finish_while_the_recorder_is_busy_come_as_one_group() -> None:
    source = Source(6)
    groups = grouped(source.outcomes(), window=0)
    source.release(1)
    assert [o.index for o in await anext(groups)] == [0]  # without a window a lone outcome is yielded at once
    source.release(3)  # three rows finish while the first group is being recorded
    await source.sent_reaches(4)
    assert [o.index for o in await anext(groups)] == [1, 2, 3]
    source.release(2)
    assert [o.index for o in await anext(groups)] == [4, 5]
    await groups.aclose()  # type: ignore[attr-defined]
    assert source.closed


async def test_a_group_waits_its_window_for_more_outcomes() -> None:
    source = Source(5)
    groups = grouped(source.outcomes(), limit=3, window=3600)
    source.release(1)
    first = asyncio.ensure_future(anext(groups))
    await source.sent_reaches(1)
    await stays(first.done, lambda done: not done, what="the group open: more rows are in flight")
    source.release(2)  # two more finish within the window: the group is full
    assert [o.index for o in await asyncio.wait_for(first, 10)] == [0, 1, 2]
    source.release(2)  # the chunk's last rows: the group closes when the outcomes end, not at the window's end
    assert [o.index for o in await asyncio.wait_for(anext(groups), 10)] == [3, 4]
    await groups.aclose()  # type: ignore[attr-defined]


async def test_a_group_closes_at_the_end_of_its_window() -> None:
    source = Source(3)
    groups = grouped(source.outcomes(), window=0.01)
    source.release(1)
    assert [o.index for o in await asyncio.wait_for(anext(groups), 10)] == [0]  # nothing more came in time
    await groups.aclose()  # type: ignore[attr-defined]


async def test_a_group_holds_at_most_its_limit() -> None:
    source = Source(5)
    source.release(5)
    sizes = [len(g) async for g in grouped(source.outcomes(), limit=2, window=0)]
    assert sizes == [2, 2, 1]


async def test_an_error_of_the_source_comes_after_what_finished_before_it() -> None:
    source = Source(5, fail_after=3)
    source.release(5)
    seen: list[int] = []
    with pytest.raises(EngineUnavailableError):
        async for group in grouped(source.outcomes(), window=0):
            seen += [o.index for o in group]
    assert seen == [0, 1, 2]
    assert source.closed


async def test_closing_early_stops_reading_and_closes_the_source() -> None:
    source = Source(10)
    source.release(1)
    groups = grouped(source.outcomes(), window=0)
    assert len(await anext(groups)) == 1
    await groups.aclose()  # type: ignore[attr-defined]
    assert source.closed
    source.release(9)
    await stays(lambda: source.sent, lambda n: n == 1, what="nothing read after the close")


async def test_one_by_one_asks_for_the_next_outcome_only_when_the_caller_is_done() -> None:
    source = Source(3)
    source.release(3)
    groups = one_by_one(source.outcomes())
    assert [o.index for o in await anext(groups)] == [0]
    await stays(lambda: source.sent, lambda n: n == 1, what="no read ahead: the next row not asked for")
    await groups.aclose()  # type: ignore[attr-defined]
    assert source.closed
