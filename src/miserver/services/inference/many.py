"""The many-rows call of every endpoint service (DESIGN §2 and §4): the one way the batch runner runs rows.

Every endpoint service exposes ``create_many(ctx, bodies, call, plan)``, an async iterator of one
:class:`Outcome` per body. With ``plan=None`` (``pack: false``) each row is checked, tokenised and seeded once by the
service's ``prepare`` and computed by its ``execute``: exactly the synchronous route's code (``create`` is
``prepare`` then ``execute``), in row order. With a planner (``pack: true``), a packable service also turns each
checked row into *units* (one engine request per prompt or input) plus a builder that makes the row's response from
its units' results with the synchronous route's own code; :func:`run_rows` asks the planner to group the units into
packs (an engine capability: ``score_many``, ``embed_many``) and yields each row as soon as all its units are done.

A row refused at checking fails alone (its error is the synchronous route's). When the engine fails on a whole pack
(a server fault such as running out of memory) the pack's units are retried one at a time. An
:class:`~miserver.errors.EngineUnavailableError` (no model resident) is not a row's fault: it propagates, and the
caller leaves the rows not yet yielded unrun. Before each row or pack ``call.stopped()`` is asked; once true, the
rows not yet complete are not yielded (the runner's time bound, cancel and interactive-first rules live there).
The consumer (``batches.chunks``) does not care in which order or with what concurrency outcomes arrive, so an
executor that keeps several requests in flight plugs in behind the same iterator.

Generation rows (batched generation): under a :class:`PackPlan` with ``generate_slots`` above 1 and an
engine with the :class:`~miserver.engines.base.GeneratesMany` capability, a service's generation rows (``Packing.
generations``) decode together through ``generate_many`` (continuous batching, :func:`run_generations`), each row
yielded as soon as its sequences are done. ``call.interrupted()`` is asked before every decode step; once true the
rows in flight are dropped (never yielded, so never recorded: they stay pending and run again later); ``call.stopped()``
alone (the time bound) only stops new rows from starting.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Generic, Protocol, TypeVar

from ...engines.base import Engine, GeneratesMany, GenerationRequest, GenerationResult
from ...errors import SERVER_ERROR_MESSAGE, APIError, EngineUnavailableError, ServerError
from .context import Call, ServiceContext, ServiceResult, StreamResult

log = logging.getLogger("miserver.services")

U = TypeVar("U")  # a unit: one engine request
PU = TypeVar("PU", bound="Unit")  # a packable unit: one engine request over its prompt's tokens
R = TypeVar("R")  # a unit's engine result
P = TypeVar("P", bound="Prepared")  # a checked row, as the service's own ``_prepare`` makes it

#: A planner: the units' token lengths -> packs, each a list of unit indices; every index in exactly one pack.
Plan = Callable[[Sequence[int]], list[list[int]]]


@dataclass(frozen=True)
class PackPlan:
    """A planner (``packs``, called as the plan) with the width of batched generation: ``generate_slots``
    sequences decode in one forward pass (1: generation rows run one at a time). A plain :data:`Plan` means 1."""

    packs: Plan
    generate_slots: int = 1

    def __call__(self, lengths: Sequence[int]) -> list[list[int]]:
        return self.packs(lengths)


def generate_slots(plan: Plan | None) -> int:
    """The batched-generation width of ``plan``: its ``generate_slots`` for a :class:`PackPlan`, else 1."""
    return plan.generate_slots if isinstance(plan, PackPlan) else 1


def batched_generator(engine: object) -> GeneratesMany | None:
    """``engine`` when it has the batched-generation capability (``generate_many``), else None."""
    return engine if isinstance(engine, GeneratesMany) else None


def _no_generations(prepared: Any) -> None:
    return None


@dataclass(frozen=True)
class Outcome:
    """One row's answer: ``index`` is its position among the bodies given; ``packed`` whether any of its units ran
    in a pack with other units (a row whose units all ran alone, in packs of one, is exactly the synchronous
    result and says ``packed: false``)."""

    index: int
    result: ServiceResult | APIError
    packed: bool


@dataclass
class RowUnits(Generic[U, R]):
    """A checked row: its position, its units (at least one) and the builder of its response."""

    index: int
    units: list[U]
    build: Callable[[list[R]], ServiceResult]


class Unit(Protocol):
    """A packable engine request: packs are planned by the length of ``prompt_ids``."""

    @property
    def prompt_ids(self) -> tuple[int, ...]: ...


class Prepared(Protocol):
    """A checked row: whatever a service's ``_prepare`` returns, as long as it names the engine that serves it."""

    @property
    def engine(self) -> Engine: ...


Create = Callable[[ServiceContext, Any, Call], Awaitable[ServiceResult | StreamResult]]


@dataclass(frozen=True)
class Packing(Generic[P, PU, R]):
    """How a packable service runs many rows (its ``create_many``): the service's own pieces, put together by
    :func:`run_many`.

    - ``prepare(ctx, body, call)``: the synchronous route's checking and tokenising (raises ``APIError``);
    - ``units(prepared)``: the row's engine requests when it can pack, ``None`` when it runs alone through ``create``
      (a generation row, a stream);
    - ``build(prepared, results)``: the row's response from its units' results, in unit order;
    - ``run_pack(engine, units)`` / ``run_one(engine, unit)``: the engine calls for a pack and for one unit;
    - ``execute(ctx, prepared, call)``: the synchronous route's computation of one prepared row (takes the
      admission gate, or uses ``call.slot``), for the rows that do not pack;
    - ``generations(prepared)``: the row's generation requests when it can join batched generation, else None;
      ``build_generated(prepared, results)`` its response from their results, in order (the synchronous code).
    """

    prepare: Callable[[ServiceContext, Any, Call], P]
    units: Callable[[P], list[PU] | None]
    build: Callable[[P, list[R]], ServiceResult]
    run_pack: Callable[[Engine, list[PU]], Awaitable[list[R]]]
    run_one: Callable[[Engine, PU], Awaitable[R]]
    execute: Callable[[ServiceContext, P, Call], Awaitable[ServiceResult]]
    generations: Callable[[P], list[GenerationRequest] | None] = _no_generations
    build_generated: Callable[[P, list[GenerationResult]], ServiceResult] | None = None


async def run_many(
    packing: Packing[P, PU, R], ctx: ServiceContext, bodies: list[Any], call: Call, plan: Plan | None
) -> AsyncIterator[Outcome]:
    """Many rows at once: each body checked as its synchronous route checks it (once); with ``plan`` None every row
    through ``packing.execute`` in row order (the synchronous computation); with a planner the units of the
    packable rows in the packs it makes (:func:`run_rows`, packs started in the order of their first row), and the
    other rows one at a time through ``execute``, each run before the first packed row after it is yielded (or at
    the end). Yields every row at most once (none after ``call.stopped()``); rows complete in no particular order.

    Only rows served by one engine pack together (the first row's); a row for another engine runs alone.
    Raises :class:`~miserver.errors.EngineUnavailableError` when the engine cannot take a row now.
    """
    rows: list[RowUnits[PU, R]] = []
    singles: list[tuple[int, P]] = []
    generating: list[tuple[int, P, list[GenerationRequest]]] = []
    slots = generate_slots(plan)
    engine: Engine | None = None
    for i, body in enumerate(bodies):
        try:
            p = packing.prepare(ctx, body, call)
        except EngineUnavailableError:
            raise
        except APIError as exc:
            yield Outcome(i, exc, False)
            continue
        except Exception:
            yield server_error(i, "checking failed")
            continue
        engine = engine or p.engine
        units = packing.units(p) if plan is not None and p.engine is engine else None
        gens = None
        if units is None and slots > 1 and p.engine is engine and batched_generator(engine) is not None:
            gens = packing.generations(p)
        if units is not None:
            rows.append(RowUnits(i, units, partial(packing.build, p)))
        elif gens is not None:
            generating.append((i, p, gens))
        else:
            singles.append((i, p))
    packed = (
        run_rows(
            ctx,
            call,
            rows,
            run_pack=partial(packing.run_pack, engine),
            run_one=partial(packing.run_one, engine),
            length=lambda u: len(u.prompt_ids),
            plan=plan,
        )
        if engine is not None and rows and plan is not None
        else None
    )
    # Interleave the singles with the packs by row order: a single row runs once every pack holding an earlier row
    # has run (``run_rows`` starts its packs in the order of their first row, see ``_ordered``).
    try:
        pending = sorted(singles, key=lambda s: s[0])
        if packed is not None:
            async for outcome in packed:
                while pending and pending[0][0] < outcome.index and not call.stopped():
                    i, p = pending.pop(0)
                    yield await run_single(packing.execute, ctx, p, call, i)
                yield outcome
    finally:
        if packed is not None:
            await packed.aclose()  # type: ignore[attr-defined]
    generator = batched_generator(engine)
    if generating and generator is not None and not call.stopped():
        generated = run_generations(packing, ctx, call, generator, generating, slots)
        try:
            async for outcome in generated:
                yield outcome
        finally:
            await generated.aclose()  # type: ignore[attr-defined]
    for i, p in pending:
        if call.stopped():
            return
        yield await run_single(packing.execute, ctx, p, call, i)


async def run_each(
    create: Create, ctx: ServiceContext, bodies: list[Any], call: Call, plan: Plan | None = None
) -> AsyncIterator[Outcome]:
    """The many-rows call of a service that never packs (probes): every row through the synchronous route's
    ``create``, in row order (``plan`` is accepted for the common signature and ignored: nothing here can pack)."""
    del plan
    for i, body in enumerate(bodies):
        if call.stopped():
            return
        yield await run_single(create, ctx, body, call, i)


async def run_generations(
    packing: Packing[P, Any, Any],
    ctx: ServiceContext,
    call: Call,
    engine: GeneratesMany,
    rows: list[tuple[int, P, list[GenerationRequest]]],
    slots: int,
) -> AsyncIterator[Outcome]:
    """Batched generation of ``rows`` (``(row index, prepared row, its generation requests)``) under the admission
    gate (or ``call.slot``): their requests go to ``engine.generate_many`` with ``slots``; a row is yielded once all
    its requests are done, built by ``packing.build_generated``, ``packed`` when any of its sequences shared a
    forward pass. Before every decode step ``call.interrupted()`` is asked, and once true the rows in flight are
    dropped (never yielded); once ``call.stopped()`` alone is true (the time bound) no new row starts and the rows in
    flight finish.

    A request the engine refuses (``ValueError``) fails its row as a server error, as the synchronous route does; when
    the whole batched run fails (a server fault), the rows not yet yielded run one at a time through ``execute``.
    Re-raises :class:`~miserver.errors.EngineUnavailableError`.
    """
    build = packing.build_generated
    assert build is not None, "a service with generations must say how to build their rows"
    flat = [(r, k) for r, (_, _, gens) in enumerate(rows) for k in range(len(gens))]
    requests = [rows[r][2][k] for r, k in flat]
    results: list[list[GenerationResult | ValueError | None]] = [[None] * len(gens) for _, _, gens in rows]
    left = [len(gens) for _, _, gens in rows]
    packed = [False] * len(rows)
    done = [False] * len(rows)
    failed = False
    async with ctx.gate.hold(call.priority, call.slot):
        drain = call.time_up or call.stopped
        stream = engine.generate_many(requests, slots=slots, should_stop=call.interrupted, should_drain=drain)
        try:
            async for item in stream:
                r, k = flat[item.index]
                results[r][k] = item.result
                packed[r] = packed[r] or item.packed
                left[r] -= 1
                if left[r] == 0:
                    done[r] = True
                    yield _finish_generated(build, rows[r][0], rows[r][1], results[r], packed[r])
        except EngineUnavailableError:
            raise
        except Exception:
            log.exception("batched generation of %d rows failed; running the rest one at a time", len(rows))
            failed = True
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
    if failed:
        for r, (index, p, _) in enumerate(rows):
            if not done[r] and not call.stopped():
                yield await run_single(packing.execute, ctx, p, call, index)


def _finish_generated(
    build: Callable[[Any, list[GenerationResult]], ServiceResult],
    index: int,
    prepared: Any,
    results: list[GenerationResult | ValueError | None],
    packed: bool,
) -> Outcome:
    failed = next((x for x in results if not isinstance(x, GenerationResult)), None)
    if failed is not None:
        log.error("row %d: the engine refused a generation: %r", index, failed)
        return Outcome(index, ServerError(SERVER_ERROR_MESSAGE), False)
    try:
        return Outcome(index, build(prepared, [x for x in results if isinstance(x, GenerationResult)]), packed)
    except APIError as exc:
        return Outcome(index, exc, False)
    except Exception:
        return server_error(index, "building the response failed")


def server_error(index: int, what: str) -> Outcome:
    """A row that failed on the server (logged with its traceback): 500 ``internal_error``."""
    log.exception("row %d: %s", index, what)
    return Outcome(index, ServerError(SERVER_ERROR_MESSAGE), False)


def check_partition(packs: list[list[int]], count: int) -> None:
    """``ValueError`` unless ``packs`` hold every index ``0..count-1`` exactly once (a planner's contract)."""
    seen = sorted(i for pack in packs for i in pack)
    if seen != list(range(count)) or any(not pack for pack in packs):
        raise ValueError("a packing plan must put every unit in exactly one non-empty pack")


async def run_rows(
    ctx: ServiceContext,
    call: Call,
    rows: list[RowUnits[U, R]],
    *,
    run_pack: Callable[[list[U]], Awaitable[list[R]]],
    run_one: Callable[[U], Awaitable[R]],
    length: Callable[[U], int],
    plan: Plan,
) -> AsyncIterator[Outcome]:
    """Run the units of ``rows`` in the packs ``plan`` makes of their lengths; yield each row when it is complete.

    Each pack takes the admission gate (or uses ``call.slot``); rows are yielded between packs, never while the
    gate is held. Rows complete in pack order, not row order: the caller keeps the order (by ``Outcome.index``).
    Before each pack ``call.stopped()`` is asked; once true, the rows not yet complete are not yielded.
    """
    flat = [(r, j) for r, row in enumerate(rows) for j in range(len(row.units))]
    packs = plan([length(rows[r].units[j]) for r, j in flat])
    check_partition(packs, len(flat))
    packs.sort(key=lambda pack: min(flat[k][0] for k in pack))  # start packs in the order of their first row
    results: list[list[Any]] = [[None] * len(row.units) for row in rows]
    left = [len(row.units) for row in rows]
    packed = [False] * len(rows)
    for pack in packs:
        if call.stopped():
            return
        units = [rows[flat[k][0]].units[flat[k][1]] for k in pack]
        alone = len(units) == 1  # a pack of one computes exactly what the unit computes alone
        async with ctx.gate.hold(call.priority, call.slot):
            try:
                answers: list[Any] = [await run_one(units[0])] if alone else list(await run_pack(units))
            except EngineUnavailableError:
                raise
            except Exception:
                log.exception("a pack of %d units failed; running them one at a time", len(units))
                alone = True
                answers = []
                for unit in units:
                    try:
                        answers.append(await run_one(unit))
                    except Exception as exc:  # recorded as this row's server error below
                        answers.append(exc)
        done = []
        for k, answer in zip(pack, answers):
            r, j = flat[k]
            results[r][j] = answer
            left[r] -= 1
            packed[r] = packed[r] or not alone
            if left[r] == 0:
                done.append(r)
        for r in done:
            yield _finish(rows[r], results[r], packed[r])


def _finish(row: RowUnits[Any, Any], results: list[Any], packed: bool) -> Outcome:
    failed = next((x for x in results if isinstance(x, BaseException)), None)
    if failed is not None:
        log.error("row %d: the engine failed: %r", row.index, failed)
        return Outcome(row.index, ServerError(SERVER_ERROR_MESSAGE), False)
    try:
        return Outcome(row.index, row.build(results), packed)
    except APIError as exc:
        return Outcome(row.index, exc, False)
    except Exception:
        return server_error(row.index, "building the response failed")


async def run_single(
    run: Callable[[ServiceContext, Any, Call], Awaitable[ServiceResult | StreamResult]],
    ctx: ServiceContext,
    row: Any,
    call: Call,
    index: int,
) -> Outcome:
    """A row that does not pack, through ``run`` (a service's ``execute`` of a prepared row, or its ``create`` of a
    body): ``packed`` false. Re-raises :class:`~miserver.errors.EngineUnavailableError`."""
    try:
        result = await run(ctx, row, call)
    except EngineUnavailableError:
        raise
    except APIError as exc:
        return Outcome(index, exc, False)
    except Exception:
        return server_error(index, "failed on the server")
    if not isinstance(result, ServiceResult):
        return Outcome(index, ServerError("A batch row cannot stream."), False)
    return Outcome(index, result, False)
