"""The resident engine's step scheduler (``engines/local/scheduler.py``) over a fake step: who is admitted at which
step, interactive first above the batch slots, batch turns by fairness key, and leaving at the next step."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from miserver.engines.base import GenerationRequest, GenerationResult, SamplingParams
from miserver.engines.local.scheduler import Group, StepScheduler
from miserver.engines.local.steps import Start, Update
from miserver.scheduling.admission import Priority


class FakeSteps:
    """Each request runs ``max_tokens`` steps (its first one included); records the starts and drops of each step.

    The call numbered ``hold_at`` (0 first; drop-only calls count) sets ``held`` and waits for ``go`` before it
    steps: the test acts while that step is "on the engine thread", at a step it names."""

    def __init__(self, hold_at: int | None = None) -> None:
        self.left: dict[int, int] = {}
        #: the tickets each call paused
        self.paused: list[list[int]] = []
        #: per call, whether its ``stop()`` was true as it stepped (None: it had none)
        self.stopped: list[bool | None] = []
        self.log: list[tuple[list[int], list[int]]] = []
        self.hold_at = hold_at
        self.held = asyncio.Event()
        self.go = asyncio.Event()

    async def holding(self) -> None:
        """Wait until the held call has started (raises ``TimeoutError`` after 10 s)."""
        await asyncio.wait_for(self.held.wait(), 10)

    async def __call__(
        self, starts: list[Start], drops: list[int], paused: list[int], stop: Callable[[], bool] | None
    ) -> list[Update]:
        await asyncio.sleep(0)  # a step hands the event loop over, as the engine thread's job does
        if len(self.log) == self.hold_at:
            self.held.set()
            await self.go.wait()
        self.stopped.append(None if stop is None else stop())
        self.log.append(([s.ticket for s in starts], list(drops)))
        self.paused.append(list(paused))
        for d in drops:
            self.left.pop(d, None)
        for s in starts:
            self.left[s.ticket] = s.request.params.max_tokens
        updates = []
        for ticket in list(self.left):
            if ticket in paused:
                continue
            self.left[ticket] -= 1
            if self.left[ticket] == 0:
                del self.left[ticket]
                updates.append(Update(ticket, result=GenerationResult([], 1), generated=1))
        return updates


def request(tokens: int, priority: Priority = Priority.BATCH, key: str = "a") -> GenerationRequest:
    return GenerationRequest((1,), SamplingParams(max_tokens=tokens), priority=priority, fairness_key=key)


async def test_an_interactive_request_starts_at_the_next_step_while_every_batch_slot_is_busy() -> None:
    steps = FakeSteps(hold_at=2)
    s = StepScheduler(steps, max_sequences=4, batch_slots=2)
    batch = [s.submit(request(10)) for _ in range(3)]
    await steps.holding()  # two steps done, the third on the engine thread
    assert (s.steps, s.in_flight, s.waiting(Priority.BATCH)) == (2, 2, 1), "every batch slot busy, one row waits"
    chat = s.submit(request(2, Priority.INTERACTIVE))
    steps.go.set()
    await chat.outcome()
    assert batch[0].admitted_at == batch[1].admitted_at == 0
    assert chat.admitted_at == 3, "at the next step after it arrived"
    assert not any(b.withdrawn for b in batch), "no batch sequence left to make room"
    for b in batch:
        await b.outcome()
    assert batch[2].admitted_at == 12, "the third batch row waits for a batch slot (the two sat out the chat's steps)"


async def test_batch_sequences_take_turns_by_fairness_key() -> None:
    steps = FakeSteps()
    s = StepScheduler(steps, max_sequences=8, batch_slots=1)
    big = [s.submit(request(1, key="big")) for _ in range(4)]
    small = [s.submit(request(1, key="small")) for _ in range(2)]
    for t in big + small:
        await t.outcome()
    order = sorted(big + small, key=lambda t: t.admitted_at or 0)
    assert [("big" if t in big else "small") for t in order] == ["big", "small", "big", "small", "big", "big"]


async def test_a_cancelled_or_stopped_request_leaves_at_the_next_step() -> None:
    steps = FakeSteps(hold_at=3)
    s = StepScheduler(steps, max_sequences=8, batch_slots=8, batch_hold_steps=0)  # the batch row starts beside b
    stop = False
    group = Group(should_stop=lambda: stop)
    a = s.submit(request(50, key="x"), group)
    b = s.submit(request(50, Priority.INTERACTIVE))
    await steps.holding()  # three steps done, the fourth on the engine thread; both in flight
    assert s.in_flight == 2 and not a.done.is_set() and not b.done.is_set()
    b.cancel()
    stop = True
    steps.go.set()
    await asyncio.gather(a.done.wait(), b.done.wait())
    await s.idle()
    assert a.withdrawn and b.withdrawn and a.result is None and b.result is None
    assert len(steps.log) == 5, "the step in progress, then one call that drops them, then nothing"
    starts, drops = steps.log[4]
    assert starts == [] and sorted(drops) == sorted([a.number, b.number]), "both dropped at the next step"
    assert [d for _, drops in steps.log[:4] for d in drops] == [], "neither left before it was told to"
    assert s.in_flight == 0 and steps.left == {}


def prompt(tokens: int, length: int, priority: Priority = Priority.BATCH) -> GenerationRequest:
    return GenerationRequest(tuple(range(1, length + 1)), SamplingParams(max_tokens=tokens), priority=priority)


async def test_batch_prompts_start_within_the_prefill_budget_of_a_step() -> None:
    steps = FakeSteps()
    s = StepScheduler(steps, max_sequences=16, batch_slots=8, prefill_tokens=100)
    rows = [s.submit(prompt(20, length)) for length in (60, 30, 20, 150, 10)]
    for t in rows:
        await t.outcome()
    assert [t.admitted_at for t in rows] == [0, 0, 1, 2, 3], "60 + 30 fit a step; + 20 would not; 150 starts alone"


async def test_no_batch_prefill_joins_a_step_while_an_interactive_request_runs() -> None:
    steps = FakeSteps(hold_at=1)
    s = StepScheduler(steps, max_sequences=8, batch_slots=4)
    first = s.submit(request(10, key="a"))
    await steps.holding()  # step 0 started the first batch row; step 1 is on the engine thread
    chat = s.submit(request(4, Priority.INTERACTIVE))
    later = s.submit(request(2, key="b"))
    steps.go.set()
    await chat.outcome()
    await later.outcome()
    await first.outcome()
    assert (first.admitted_at, chat.admitted_at) == (0, 2)
    assert later.admitted_at == 6, "not beside the chat (steps 2-5) while a batch row ran; at the step after it"
    assert [starts for starts, _ in steps.log[2:6]] == [[chat.number], [], [], []]


async def test_batch_rows_wait_for_a_short_interactive_request() -> None:
    steps = FakeSteps()
    s = StepScheduler(steps, max_sequences=8, batch_slots=4)
    chat = s.submit(request(6, Priority.INTERACTIVE))
    rows = [s.submit(request(2, key="a")) for _ in range(2)]
    for t in [chat, *rows]:
        await t.outcome()
    assert chat.admitted_at == 0
    assert [t.admitted_at for t in rows] == [6, 6], "no batch prefill while the chat runs (steps 0-5); both after it"


async def test_a_batch_held_back_by_long_interactive_work_starts_one_row_each_hold() -> None:
    steps = FakeSteps()
    s = StepScheduler(steps, max_sequences=8, batch_slots=4, batch_hold_steps=10)
    chat = s.submit(request(40, Priority.INTERACTIVE))
    rows = [s.submit(request(2, key="a")) for _ in range(4)]
    for t in [chat, *rows]:
        await t.outcome()
    assert chat.admitted_at == 0
    assert [t.admitted_at for t in rows] == [10, 30, 40, 40], "a row starts at the batch's turn (every 10 steps)"
    assert steps.paused[11:20] == [[rows[0].number]] * 9 and steps.paused[20] == [], "and decodes at its turns"


async def test_while_an_interactive_request_runs_only_the_earliest_batch_rows_decode() -> None:
    """The batch rows in flight beyond ``interactive_batch_rows`` sit out the interactive request's steps (none leaves
    or starts over), and all decode again at the step after it."""
    steps = FakeSteps(hold_at=2)
    s = StepScheduler(steps, max_sequences=8, batch_slots=4, interactive_batch_rows=2)
    rows = [s.submit(request(10)) for _ in range(3)]
    await steps.holding()  # two steps done, the third on the engine thread
    chat = s.submit(request(3, Priority.INTERACTIVE))
    steps.go.set()
    await chat.outcome()
    for t in rows:
        await t.outcome()
    assert chat.admitted_at == 3
    assert steps.paused[:3] == [[], [], []], "no interactive request yet: every row decodes"
    assert steps.paused[3:6] == [[rows[2].number]] * 3, "the chat's three steps: the third row waits"
    assert steps.paused[6:] == [[]] * (len(steps.paused) - 6), "then every row decodes again"
    assert not any(t.withdrawn for t in rows), "no row left to make room"
    assert len(steps.log) == 13, "rows 1 and 2 end at step 9, row 3 three steps later"


async def test_a_batch_always_progresses_beside_interactive_work() -> None:
    """With no batch row decoding beside interactive requests (the default), the batch rows in flight still decode at
    the batch's turn, one step in every ``batch_hold_steps``, however long the interactive work."""
    steps = FakeSteps(hold_at=1)
    s = StepScheduler(steps, max_sequences=8, batch_slots=4, batch_hold_steps=3)
    rows = [s.submit(request(4)) for _ in range(2)]
    await steps.holding()  # both rows in flight, the second step on the engine thread
    chat = s.submit(request(30, Priority.INTERACTIVE))
    steps.go.set()
    for t in rows:
        await t.outcome()
    assert not chat.done.is_set(), "both rows ended while the chat ran"
    both = sorted(t.number for t in rows)
    assert [sorted(p) for p in steps.paused[2:9]] == [both, both, both, [], both, both, []]
    assert len(steps.log) == 9, "rows of 4 tokens: steps 0, 1, 5 and 8"
    await chat.outcome()


async def test_an_interactive_arrival_gives_up_the_batch_step_in_flight() -> None:
    """A step of batch sequences only may be given up (``stop()``) once an interactive ticket arrives, and is not
    before; a step with an interactive sequence in it is never given up."""
    steps = FakeSteps(hold_at=2)
    s = StepScheduler(steps, max_sequences=8, batch_slots=4)
    rows = [s.submit(request(6)) for _ in range(2)]
    await steps.holding()  # the third step, batch rows only, is on the engine thread
    chat = s.submit(request(3, Priority.INTERACTIVE))
    steps.go.set()
    await chat.outcome()
    for t in rows:
        await t.outcome()
    assert steps.stopped[:2] == [False, False], "batch-only steps, nothing arrived"
    assert steps.stopped[2] is True, "the step in flight when the chat arrived"
    assert steps.stopped[3:6] == [False, False, False], "the chat's steps are not given up for it"
    assert chat.admitted_at == 3


async def test_a_step_whose_every_request_was_cancelled_is_given_up() -> None:
    """A client that hangs up while its step runs: once every request decoding in the step is cancelled, its decode
    is given up (nobody waits for it); while one of them is still wanted, it is not."""
    steps = FakeSteps(hold_at=2)
    s = StepScheduler(steps, max_sequences=8, batch_slots=4)
    chat = s.submit(request(10, Priority.INTERACTIVE))
    await steps.holding()
    chat.cancel()
    steps.go.set()
    await s.idle()
    assert steps.stopped == [False, False, True, None], "the step in flight when it left, then the drop alone"
    assert steps.log[3] == ([], [chat.number]) and chat.withdrawn

    steps = FakeSteps(hold_at=2)
    s = StepScheduler(steps, max_sequences=8, batch_slots=4)
    left, stays = s.submit(request(10, Priority.INTERACTIVE)), s.submit(request(6, Priority.INTERACTIVE))
    await steps.holding()
    left.cancel()
    steps.go.set()
    await stays.outcome()
    assert steps.stopped[2] is False, "one of its requests still waits for its token"
    assert steps.log[3] == ([], [left.number])


async def test_an_interactive_request_outside_the_loop_gives_up_the_batch_step_too() -> None:
    """``interrupt()`` (an interactive scoring pass waiting for the engine thread) makes the batch-only step in
    flight give up, as an interactive ticket does."""
    steps = FakeSteps(hold_at=1)
    s = StepScheduler(steps, max_sequences=8, batch_slots=4)
    row = s.submit(request(4))
    await steps.holding()
    s.interrupt()
    steps.go.set()
    await row.outcome()
    assert steps.stopped == [False, True, False, False], "the step in flight when it came, and no other"
