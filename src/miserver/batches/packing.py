"""Packing in the batch runner (DESIGN §4 "Packing"): which batches pack, how packs are planned, and how a packed
window of rows is run and recorded.

A ``pack: true`` batch on an endpoint whose service has a many-rows call (chat and text completions, embeddings)
claims a *window* of ``BATCH_PACK_WINDOW_ROWS`` rows instead of a ``BATCH_CHUNK_ROWS`` chunk. The service checks every
row as its synchronous route does and hands :func:`budget_packs` the token lengths of the packable units (the
prompts of scoring rows, every embedding input). Because a pack is as wide as its longest row, the planner is
length-aware: it sorts the window's units by length and cuts packs whose ``rows x longest row`` stays within
``BATCH_PACK_TOKEN_BUDGET`` and whose padding stays within ``BATCH_PACK_MAX_PADDING`` of that (a unit longer than the
budget runs alone). Generation rows (``max_tokens`` > 1) of the window decode together, ``BATCH_GENERATE_SLOTS``
sequences per forward pass, a finished sequence's slot going to the next row (continuous batching, see
``docs/packing.md``); probe rows never pack (their service has no many-rows call).

Rows finish in pack order; the one row loop (:mod:`miserver.batches.chunks`) records each as soon as it finishes, in
its own transaction fenced by the claim token (exactly once), and the output file is written in input order whatever
the recording order. :func:`fixed_packs` and :func:`sorted_packs` are the plain schemes the benchmark compares
against (``bench/packing.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from ..services.inference.many import PackPlan, Plan
from ..services.inference.registry import SERVICES
from ..settings import Settings
from ..store.batches import BatchRecord


def fixed_packs(lengths: Sequence[int], size: int) -> list[list[int]]:
    """Packs of ``size`` units in the given order (the plain scheme: a pack is as wide as its longest unit)."""
    return [list(range(i, min(i + size, len(lengths)))) for i in range(0, len(lengths), size)]


def sorted_packs(lengths: Sequence[int], size: int) -> list[list[int]]:
    """Packs of ``size`` units of similar length: the units sorted by length (stable), then cut every ``size``."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return [order[i : i + size] for i in range(0, len(order), size)]


def budget_packs(lengths: Sequence[int], budget: int, max_padding: float = 1.0) -> list[list[int]]:
    """Length-aware packs: units sorted by length, each pack grown while it stays within ``budget`` tokens
    (``units x longest unit``) and padding stays at most ``max_padding`` of those tokens.

    Sorting puts units of similar length together; the budget bounds the work and memory of a pack (``[units,
    longest]`` token ids), so short units go in wide packs and long ones in narrow packs; the padding cap closes a
    pack rather than let a much longer unit widen it. A unit longer than ``budget`` forms a pack by itself. Every
    index appears in exactly one pack.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    packs: list[list[int]] = []
    current: list[int] = []
    tokens = 0
    for i in order:
        size = (len(current) + 1) * lengths[i]
        if current and (size > budget or size - tokens - lengths[i] > max_padding * size):
            packs.append(current)
            current, tokens = [], 0
        current.append(i)
        tokens += lengths[i]
    if current:
        packs.append(current)
    return packs


def runner_plan(settings: Settings) -> PackPlan:
    """The runner's planner: :func:`budget_packs` with ``BATCH_PACK_TOKEN_BUDGET`` and ``BATCH_PACK_MAX_PADDING``,
    and ``BATCH_GENERATE_SLOTS`` sequences per decode step for generation rows."""
    packs = partial(budget_packs, budget=settings.batch_pack_token_budget, max_padding=settings.batch_pack_max_padding)
    return PackPlan(packs, settings.batch_generate_slots)


def batch_plan(settings: Settings, batch: BatchRecord) -> Plan | None:
    """The plan a batch's rows run with: :func:`runner_plan` when it packs, else None (each row alone, exactly as
    the synchronous route computes it)."""
    return runner_plan(settings) if packs(batch) else None


def packs(batch: BatchRecord) -> bool:
    """Whether ``batch`` runs its rows through the packed path (``pack: true`` and a packable endpoint)."""
    service = SERVICES.get(batch.endpoint)
    return bool(batch.pack) and service is not None and service.packable


def claim_limit(settings: Settings, batch: BatchRecord) -> int:
    """Rows to claim per admission slot: the packing window for a packed batch, else the chunk."""
    return settings.batch_pack_window_rows if packs(batch) else settings.batch_chunk_rows
