"""Admission: one gate per engine, with slots, and interactive requests before batch chunks (DESIGN §5).

A synchronous request takes a slot for its own duration; a batch runner takes one slot for a whole chunk and runs the
chunk's rows under it. When a slot frees, the oldest waiting interactive request gets it before any batch chunk;
within a class, first come first served. An *exclusive* holder (a weight write, a model load) takes every slot: it
waits until the holders before it are done and no one is admitted beside it.

The resident engine's gate is wide (``MISERVER_MAX_SEQUENCES`` + 1): its own step scheduler admits each sequence at
a decode step, interactive first, so an interactive request never waits for a batch chunk there; the gate then only
keeps model-life operations apart from forward passes. An upstream pool's gate has one slot per place in flight.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from enum import IntEnum


class Priority(IntEnum):
    """Admission classes; a lower value is served first."""

    INTERACTIVE = 0
    BATCH = 1


class Slot:
    """Proof that the holder has a slot of a gate (passed to services so a chunk's rows do not queue again);
    ``exclusive``: every slot of it."""

    def __init__(self, gate: AdmissionGate, priority: Priority, exclusive: bool = False) -> None:
        self.gate = gate
        self.priority = priority
        self.exclusive = exclusive


class AdmissionGate:
    """A counting gate with two priority classes.

    ``slots`` is the number of requests the engine runs at once (1 for the resident model). ``admission_check``,
    when set, is called by :meth:`hold` for an interactive request before it waits and again once it has its slot;
    it raises (an ``APIError``) to refuse the request: the resident weights are mid-write, for instance.
    """

    def __init__(self, slots: int = 1) -> None:
        if slots < 1:
            raise ValueError("an admission gate needs at least one slot")
        self.admission_check: Callable[[], None] | None = None
        self.slots = slots
        self._free = slots
        self._waiters: dict[Priority, deque[asyncio.Future[None]]] = {p: deque() for p in Priority}
        self._exclusive: set[asyncio.Future[None]] = set()  # waiters that need every slot
        self.granted: dict[Priority, int] = {p: 0 for p in Priority}

    def queue_length(self, priority: Priority) -> int:
        """Requests of ``priority`` waiting for a slot now."""
        return sum(1 for f in self._waiters[priority] if not f.done())

    @property
    def in_use(self) -> int:
        return self.slots - self._free

    async def acquire(self, priority: Priority, *, exclusive: bool = False) -> Slot:
        """Wait for a slot (``exclusive``: for every slot). Raises ``asyncio.CancelledError`` if the waiter is
        cancelled (nothing is held then)."""
        width = self.slots if exclusive else 1
        ahead = any(self.queue_length(p) for p in Priority if p <= priority)
        if self._free >= width and not ahead:
            self._free -= width
            self.granted[priority] += 1
            return Slot(self, priority, exclusive)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters[priority].append(fut)
        if exclusive:
            self._exclusive.add(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                # The slots were handed to us just as we were cancelled: pass them on.
                self._free += width
                self._dispatch()
            raise
        finally:
            with suppress(ValueError):
                self._waiters[priority].remove(fut)
            self._exclusive.discard(fut)
        self.granted[priority] += 1
        return Slot(self, priority, exclusive)

    def _dispatch(self) -> None:
        """Hand free slots to the waiters, interactive first, oldest first; the first waiter that does not fit (an
        exclusive one while slots are held) stops the hand-out, so nobody overtakes it."""
        for priority in Priority:
            for fut in self._waiters[priority]:
                if fut.done():
                    continue
                width = self.slots if fut in self._exclusive else 1
                if self._free < width:
                    return
                self._free -= width
                fut.set_result(None)

    def release(self, slot: Slot) -> None:
        """Give the slot (every slot, for an exclusive one) back; it goes to the first interactive waiter, else the
        first batch waiter."""
        if slot.gate is not self:
            raise ValueError("slot belongs to another gate")
        self._free += self.slots if slot.exclusive else 1
        self._dispatch()

    @asynccontextmanager
    async def hold(
        self, priority: Priority, slot: Slot | None = None, *, check: bool = True, exclusive: bool = False
    ) -> AsyncIterator[Slot]:
        """Hold a slot (``exclusive``: every slot) for the block; if ``slot`` (already held by the caller) is given,
        reuse it. An interactive request passes ``admission_check`` before and after waiting, unless ``check`` is
        false (a model load, which is what makes the weights whole again)."""
        if slot is not None:
            yield slot
            return
        guard = self.admission_check if check and priority == Priority.INTERACTIVE else None
        if guard is not None:
            guard()
        held = await self.acquire(priority, exclusive=exclusive)
        try:
            if guard is not None:
                guard()
            yield held
        finally:
            self.release(held)
