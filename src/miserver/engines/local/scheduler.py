"""The resident engine's step scheduler: every generation request in one continuous batch, admitted at each step.

vLLM's idea (admit, step, retire) in one loop. A request (a synchronous chat or completion, streamed or not, or a
batch row) becomes a :class:`Ticket` that waits in its priority class. The loop, a task on the event loop, repeats
while anything waits or runs:

1. **leave**: tickets whose consumer went away (an HTTP client that hung up cancels its task), or whose group says
   stop (a batch cancelled, paused or expired, a claim lost), leave at this step and free their slots;
2. **admit**: interactive tickets first, oldest first, while the slots in flight stay within ``max_sequences``;
   then batch tickets, round robin over their fairness keys, while the batch class holds at most ``batch_slots``
   sequences and their prompts stay within ``prefill_tokens`` a step (the first batch ticket of a step is never held
   back by it). An interactive ticket therefore starts at the next step even when every batch slot is busy, and no
   batch sequence is ever stopped to make room for it. While interactive tickets are in flight or waiting, the batch
   is held back: no batch ticket starts (a prefill runs inside its step and would delay every sequence of it), and
   only the earliest ``interactive_batch_rows`` batch sequences in flight decode (0 by default: on a CPU every row
   lengthens the step); the others sit the step out, keeping their slots and caches. Every ``batch_hold_steps``
   steps comes the batch's turn: every batch sequence in flight decodes and, when none is in flight, one batch
   ticket starts, so that a batch always progresses;
3. **step**: one :meth:`~miserver.engines.local.steps.StepBatch.step` on the engine thread (prefill of the admitted,
   one decode token for the others but those sitting out); other engine work (scoring and pooling packs, weight
   edits) queues on the same thread between two steps. A step of batch sequences only gives its decode up between
   two layers when an interactive ticket arrives (its sequences decode that token at a later step, as if they had
   sat the step out), so an interactive request waits for about one layer, not for the batch's whole step; any step
   gives its decode up once every request decoding in it was cancelled (a client that hung up mid-step);
4. **retire**: deltas go to their tickets (streams see them at once); a finished ticket gets its result.

The scheduler sees a priority class, a fairness key and the batch-invariant switch on each request, never a batch.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from miserver.engines.base import GenerationRequest, GenerationResult, StreamDelta
from miserver.engines.local.steps import Start, Update
from miserver.scheduling.admission import Priority

log = logging.getLogger("miserver.engine")

#: Sequences in flight at once, every class together (the default of ``MISERVER_MAX_SEQUENCES``).
DEFAULT_MAX_SEQUENCES = 24
#: Batch sequences in flight at once (the default of ``BATCH_GENERATE_SLOTS``).
DEFAULT_BATCH_SLOTS = 16
#: Batch prompt tokens prefilled in one step at most (the default of ``BATCH_PREFILL_TOKENS``).
DEFAULT_PREFILL_TOKENS = 256
#: Steps of interactive work between two batch rows started beside it (the default of ``BATCH_HOLD_STEPS``).
DEFAULT_BATCH_HOLD_STEPS = 64
#: Batch sequences that keep decoding while interactive requests run (the default of
#: ``BATCH_ROWS_BESIDE_INTERACTIVE``).
DEFAULT_BATCH_ROWS_BESIDE_INTERACTIVE = 0

#: Runs one step on the engine thread: (starts, drops, paused, stop) -> updates; raises what the step raised. ``stop``,
#: when given, turns true once the step's decode should be given up (see ``StepBatch.step``).
StepRunner = Callable[[list[Start], list[int], list[int], Callable[[], bool] | None], Awaitable[list[Update]]]


@dataclass
class Group:
    """Tickets submitted together (a batch chunk's packed rows): ``should_stop()`` true drops them all at the next
    step, ``should_drain()`` true withdraws those still waiting (those in flight finish) once one of them has started
    (a group always makes progress); ``slots`` caps the group's sequences in flight."""

    should_stop: Callable[[], bool] | None = None
    should_drain: Callable[[], bool] | None = None
    slots: int | None = None
    in_flight: int = 0
    started: int = 0

    def stopped(self) -> bool:
        return self.should_stop is not None and self.should_stop()

    def draining(self) -> bool:
        return self.started > 0 and self.should_drain is not None and self.should_drain()


@dataclass(eq=False)
class Ticket:
    """One request in the scheduler: waiting, in flight, then done (``result`` set, or ``error``).

    ``deltas`` receives every delta as its step ends (for streams); ``withdrawn`` turns true when it left without a
    result (cancelled, drained, dropped)."""

    number: int
    request: GenerationRequest
    group: Group | None = None
    deltas: asyncio.Queue[StreamDelta | None] = field(default_factory=asyncio.Queue)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    result: GenerationResult | ValueError | None = None
    error: BaseException | None = None
    packed: bool = False
    started: bool = False
    cancelled: bool = False
    withdrawn: bool = False
    #: the step count at which it was admitted (tests read it: who started at which step)
    admitted_at: int | None = None

    @property
    def priority(self) -> Priority:
        return self.request.priority

    def cancel(self) -> None:
        """The consumer went away: leave at the next step (nothing more is delivered)."""
        if not self.done.is_set():
            self.cancelled = True

    async def outcome(self) -> GenerationResult | ValueError:
        """Wait for the result; raises the step's error, or ``asyncio.CancelledError`` when withdrawn."""
        await self.done.wait()
        if self.error is not None:
            raise self.error
        if self.result is None:
            raise asyncio.CancelledError("the request left the engine before it finished")
        return self.result


class StepScheduler:
    """Admission and the step loop (see the module). ``run_step`` runs one step on the engine thread;
    ``on_start(request)`` is called as each request is admitted (the engine counts executions there);
    ``on_generated(tokens)`` after each step."""

    def __init__(
        self,
        run_step: StepRunner,
        *,
        max_sequences: int,
        batch_slots: int,
        prefill_tokens: int = DEFAULT_PREFILL_TOKENS,
        batch_hold_steps: int = DEFAULT_BATCH_HOLD_STEPS,
        interactive_batch_rows: int = DEFAULT_BATCH_ROWS_BESIDE_INTERACTIVE,
        on_start: Callable[[GenerationRequest], None] | None = None,
        on_generated: Callable[[int], None] | None = None,
    ) -> None:
        if max_sequences < 1 or batch_slots < 1:
            raise ValueError("the step scheduler needs at least one slot")
        if prefill_tokens < 1:
            raise ValueError("prefill_tokens must be positive")
        if batch_hold_steps < 0:
            raise ValueError("batch_hold_steps must not be negative")
        if interactive_batch_rows < 0:
            raise ValueError("interactive_batch_rows must not be negative")
        self.interactive_batch_rows = interactive_batch_rows
        self.prefill_tokens = prefill_tokens
        self.batch_hold_steps = batch_hold_steps
        #: the step since which interactive work has held batch tickets back (None: not held)
        self._held_since: int | None = None
        #: whether this step is the batch's turn beside interactive work (see ``_admit``)
        self._turn = False
        #: set when an interactive ticket arrives; a batch-only step in flight gives its decode up when it is set
        self._arrived = threading.Event()
        self.run_step = run_step
        self.max_sequences = max_sequences
        self.batch_slots = min(batch_slots, max_sequences)
        self.on_start = on_start
        self.on_generated = on_generated
        self.steps = 0
        self._numbers = itertools.count()
        self._interactive: deque[Ticket] = deque()
        self._batch: dict[str, deque[Ticket]] = {}
        self._active: dict[int, Ticket] = {}
        #: tickets a failed or cancelled step left on the engine thread: dropped at the next step
        self._orphans: list[int] = []
        self._loop: asyncio.Task[None] | None = None

    # --- the consumer's side ---------------------------------------------------------------------------------------

    def submit(self, request: GenerationRequest, group: Group | None = None) -> Ticket:
        """Queue ``request`` in its class (``request.priority``; batch tickets by ``request.fairness_key``)."""
        ticket = Ticket(next(self._numbers), request, group)
        if request.priority == Priority.INTERACTIVE:
            self._interactive.append(ticket)
            self._arrived.set()
        else:
            self._batch.setdefault(request.fairness_key, deque()).append(ticket)
        loop = asyncio.get_running_loop()
        if self._loop is None or self._loop.done() or self._loop.get_loop() is not loop:
            self._loop = loop.create_task(self._run(), name="miserver-step-loop")
        return ticket

    def interrupt(self) -> None:
        """An interactive request for the engine thread outside the step loop (a scoring pass) is waiting: a step of
        batch sequences only in flight gives its decode up, so that the request runs after it."""
        self._arrived.set()

    @property
    def in_flight(self) -> int:
        """Sequences in flight now."""
        return sum(t.request.n for t in self._active.values())

    def waiting(self, priority: Priority) -> int:
        """Tickets of ``priority`` waiting to start."""
        if priority == Priority.INTERACTIVE:
            return sum(1 for t in self._interactive if not t.cancelled)
        return sum(1 for q in self._batch.values() for t in q if not t.cancelled)

    async def idle(self) -> None:
        """Wait until the loop has nothing left (tests; close)."""
        if self._loop is not None:
            await asyncio.shield(self._loop)

    # --- the loop --------------------------------------------------------------------------------------------------

    async def _run(self) -> None:
        while self._active or self._interactive or any(self._batch.values()):
            drops = self._leaving() + self._orphans
            self._orphans = []
            starts = self._admit()
            if not starts and not self._active:
                if drops:
                    await self.run_step([], drops, [], None)
                continue
            paused = self._paused()
            try:
                updates = await self.run_step(
                    [Start(t.number, t.request, t.request.invariant) for t in starts],
                    drops,
                    paused,
                    self._give_up(paused),
                )
            except BaseException as exc:
                self._fail(exc, [t.number for t in starts])
                if not isinstance(exc, Exception):
                    raise
                continue
            self.steps += 1
            self._deliver(updates)

    def _give_up(self, paused: list[int]) -> Callable[[], bool]:
        """When the step about to run gives its decode up between two layers (asked on the engine thread): once every
        request decoding in it has been cancelled (its client left while the step ran: nobody waits for its token),
        and, in a step of batch sequences only, once an interactive ticket arrives."""
        sitting_out = set(paused)
        decoding = [t for n, t in self._active.items() if n not in sitting_out]
        arrived = self._arrived
        batch_only = all(t.priority != Priority.INTERACTIVE for t in self._active.values())

        def stop() -> bool:
            if batch_only and arrived.is_set():
                return True
            return bool(decoding) and all(t.cancelled for t in decoding)

        return stop

    def _leaving(self) -> list[int]:
        """Withdraw waiting tickets that were cancelled or whose group stops or drains; the in-flight tickets that
        leave at this step (cancelled, or their group stops)."""
        for queue in [self._interactive, *self._batch.values()]:
            for t in list(queue):
                if t.cancelled or (t.group is not None and (t.group.stopped() or t.group.draining())):
                    queue.remove(t)
                    self._withdraw(t)
        self._batch = {k: q for k, q in self._batch.items() if q}
        drops = [n for n, t in self._active.items() if t.cancelled or (t.group is not None and t.group.stopped())]
        for n in drops:
            self._withdraw(self._active.pop(n))
        return drops

    def _admit(self) -> list[Ticket]:
        """Interactive first within ``max_sequences``; then batch round robin over fairness keys within
        ``batch_slots`` and ``prefill_tokens`` (a request wider than the free room starts only when its class has
        nothing in flight); while interactive work runs or waits, none but at the batch's turn (every
        ``batch_hold_steps`` steps, which sets ``_turn``), and then one when no batch sequence is in flight."""
        self._arrived.clear()  # every interactive ticket waiting now is seen here (this runs on the event loop)
        used = self.in_flight
        batch_used = sum(t.request.n for t in self._active.values() if t.priority != Priority.INTERACTIVE)
        prefill = 0  # batch prompt tokens admitted at this step
        starts: list[Ticket] = []
        for t in list(self._interactive):  # oldest first; one held back by its group's cap lets the next go
            n = t.request.n
            if used + n > self.max_sequences and (used > 0 or starts):
                break
            if not self._group_room(t):
                continue
            self._interactive.remove(t)
            self._take(t, starts)
            used += n
        interactive = used > batch_used or bool(self._interactive)  # in flight (or starting), or still waiting
        if not (interactive and (self._batch or batch_used)):
            self._held_since = None
        elif self._held_since is None:
            self._held_since = self.steps
        self._turn = self._held_since is not None and self.steps - self._held_since >= self.batch_hold_steps
        if self._turn:
            self._held_since = self.steps  # the next turn comes batch_hold_steps steps later
        elif self._held_since is not None:
            return starts
        progressed = True
        while progressed and self._batch:  # one ticket per key per pass: round robin over the fairness keys
            progressed = False
            for key in list(self._batch):
                if interactive and batch_used > 0:
                    return starts
                queue = self._batch[key]
                t = queue[0]
                n = t.request.n
                room = min(self.batch_slots - batch_used, self.max_sequences - used)
                alone = batch_used == 0 and used == 0  # a request wider than the room starts when nothing runs
                tokens = len(t.request.prompt_ids)
                if prefill > 0 and prefill + tokens > self.prefill_tokens:
                    return starts
                if (n > room and not alone) or not self._group_room(t):
                    continue
                queue.popleft()
                del self._batch[key]
                if queue:
                    self._batch[key] = queue  # to the back of the rotation
                self._take(t, starts)
                used += n
                batch_used += n
                prefill += tokens
                progressed = True
        return starts

    def _paused(self) -> list[int]:
        """The batch tickets in flight that sit this step out: while an interactive ticket is in flight (or starts at
        this step), all but the earliest admitted ones, ``interactive_batch_rows`` sequences of them, except at the
        batch's turn (see :meth:`_admit`), when every one decodes. They keep their slots and caches."""
        if self._turn or all(t.priority != Priority.INTERACTIVE for t in self._active.values()):
            return []
        paused, decoding = [], 0
        for number, t in self._active.items():  # in admission order
            if t.priority == Priority.INTERACTIVE:
                continue
            if decoding + t.request.n > self.interactive_batch_rows:
                paused.append(number)
            else:
                decoding += t.request.n
        return paused

    def _take(self, t: Ticket, starts: list[Ticket]) -> None:
        """``t`` starts at this step."""
        if t.group is not None:
            t.group.in_flight += t.request.n
            t.group.started += 1
        t.started = True
        t.admitted_at = self.steps
        self._active[t.number] = t
        starts.append(t)
        if self.on_start is not None:
            self.on_start(t.request)

    @staticmethod
    def _group_room(t: Ticket) -> bool:
        """Whether ``t``'s group may have its sequences in flight too (a group wider than its cap starts alone)."""
        g = t.group
        return g is None or g.slots is None or g.in_flight == 0 or g.in_flight + t.request.n <= g.slots

    def _deliver(self, updates: list[Update]) -> None:
        generated = 0
        for u in updates:
            t = self._active.get(u.ticket)
            if t is None:
                continue
            generated += u.generated
            t.packed = t.packed or u.packed
            for delta in u.deltas:
                t.deltas.put_nowait(delta)
            if u.result is not None:
                del self._active[u.ticket]
                self._release_group(t)
                t.result = u.result
                t.deltas.put_nowait(None)
                t.done.set()
        if self.on_generated is not None and generated:
            self.on_generated(generated)

    def _withdraw(self, t: Ticket) -> None:
        if t.started:
            self._release_group(t)
        t.withdrawn = True
        t.deltas.put_nowait(None)
        t.done.set()

    def _release_group(self, t: Ticket) -> None:
        if t.group is not None and t.started:
            t.group.in_flight -= t.request.n

    def _fail(self, exc: BaseException, starts: list[int]) -> None:
        """A step raised (or the loop was cancelled while it ran): every ticket in flight fails with ``exc``, and the
        engine thread drops them at the next step (a cancelled wait leaves the step running there)."""
        if isinstance(exc, Exception):
            log.error("a step failed; %d requests in flight fail with it: %r", len(self._active), exc)
        self._orphans += [*self._active, *starts]
        for t in self._active.values():
            self._release_group(t)
            t.error = exc
            t.deltas.put_nowait(None)
            t.done.set()
        self._active.clear()
