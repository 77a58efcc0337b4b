"""Admission: a waiting interactive request always gets the slot before the next batch chunk."""

from __future__ import annotations

import asyncio

import pytest

from miserver.scheduling.admission import AdmissionGate, Priority
from tests.support.waiting import until


async def queued(gate: AdmissionGate, priority: Priority, n: int) -> None:
    """Wait until ``n`` requests of ``priority`` wait at ``gate``."""
    await until(lambda: gate.queue_length(priority), lambda k: k == n, what=f"{n} {priority.name} waiters")


async def test_interactive_goes_before_waiting_batch() -> None:
    gate = AdmissionGate(1)
    order: list[str] = []
    first = await gate.acquire(Priority.BATCH)

    async def take(name: str, priority: Priority) -> None:
        slot = await gate.acquire(priority)
        order.append(name)
        gate.release(slot)

    batch = asyncio.create_task(take("batch-2", Priority.BATCH))
    await queued(gate, Priority.BATCH, 1)  # the batch request waits first
    interactive = asyncio.create_task(take("chat", Priority.INTERACTIVE))
    await queued(gate, Priority.INTERACTIVE, 1)
    assert gate.queue_length(Priority.BATCH) == 1
    gate.release(first)
    await asyncio.gather(batch, interactive)
    assert order == ["chat", "batch-2"]


async def test_fifo_within_a_class() -> None:
    gate = AdmissionGate(1)
    held = await gate.acquire(Priority.INTERACTIVE)
    order: list[int] = []

    async def take(i: int) -> None:
        async with gate.hold(Priority.INTERACTIVE):
            order.append(i)

    tasks = []
    for i in range(5):  # each arrives once the one before it waits: the arrival order is 0, 1, 2, 3, 4
        tasks.append(asyncio.create_task(take(i)))
        await queued(gate, Priority.INTERACTIVE, i + 1)
    gate.release(held)
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2, 3, 4]


async def test_new_arrival_does_not_jump_the_queue() -> None:
    gate = AdmissionGate(1)
    held = await gate.acquire(Priority.BATCH)
    waiter = asyncio.create_task(gate.acquire(Priority.INTERACTIVE))
    await queued(gate, Priority.INTERACTIVE, 1)
    gate.release(held)  # handed to the waiter, not left free
    assert gate.in_use == 1
    newcomer = asyncio.create_task(gate.acquire(Priority.INTERACTIVE))
    await queued(gate, Priority.INTERACTIVE, 1)  # it waits: the slot went to the waiter before it
    slot = await waiter
    assert not newcomer.done()
    gate.release(slot)
    gate.release(await newcomer)
    assert gate.in_use == 0


async def test_a_newcomer_does_not_overtake_a_waiting_exclusive_holder() -> None:
    """Two slots, one held: a weight write (exclusive: every slot) waits for it. A chat arriving now finds a slot free
    yet queues behind the write (taking it would hold the write back for as long as chats keep coming); the write
    gets both slots once the holder is done, and the chat runs after it."""
    gate = AdmissionGate(2)
    held = await gate.acquire(Priority.BATCH)
    write = asyncio.create_task(gate.acquire(Priority.INTERACTIVE, exclusive=True))
    await queued(gate, Priority.INTERACTIVE, 1)
    chat = asyncio.create_task(gate.acquire(Priority.INTERACTIVE))
    state = await until(
        lambda: (chat.done(), gate.queue_length(Priority.INTERACTIVE)),
        lambda s: s[0] or s[1] == 2,
        what="the chat admitted or queued",
    )
    assert state == (False, 2), "the chat queued behind the write although a slot was free"
    assert gate.in_use == 1
    gate.release(held)
    exclusive = await asyncio.wait_for(write, 10)
    assert gate.in_use == 2 and not chat.done()
    gate.release(exclusive)
    gate.release(await asyncio.wait_for(chat, 10))
    assert gate.in_use == 0


async def test_cancelled_waiter_leaves_no_slot_behind() -> None:
    gate = AdmissionGate(1)
    held = await gate.acquire(Priority.BATCH)
    waiter = asyncio.create_task(gate.acquire(Priority.INTERACTIVE))
    await queued(gate, Priority.INTERACTIVE, 1)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    gate.release(held)
    assert gate.in_use == 0
    again = await asyncio.wait_for(gate.acquire(Priority.BATCH), 1)
    gate.release(again)


async def test_held_slot_is_reused_not_requeued() -> None:
    gate = AdmissionGate(1)
    async with gate.hold(Priority.BATCH) as slot, gate.hold(Priority.INTERACTIVE, slot) as inner:
        assert inner is slot and gate.in_use == 1
    assert gate.in_use == 0
