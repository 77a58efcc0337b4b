"""Continuous batching in the local engine (``engines/local/steps.py``) on the tiny random Llama, float32, CPU, over
each step-loop cache (the slot forward and transformers' cache).

Packed and single runs agree at temperature 0 (same tokens, text, finish reason and usage for every row; logprobs
within float32 rounding); per-row seeds, stops and limits hold; a finished sequence's slot is refilled at once; a
request that never shared a forward pass is the synchronous result bit for bit; a stop ends at a step boundary.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from miserver.engines.base import (
    Generated,
    GeneratesMany,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    ScoreRequest,
)
from miserver.engines.local.decoding import DecodeOptions, DecodePath, make_slots
from miserver.engines.local.engine import LocalEngine
from miserver.engines.local.loader import load_model, resolve_model_source
from miserver.engines.local.slots import SlotModel
from miserver.engines.local.steps import Start, StepBatch, Update
from miserver.scheduling.admission import Priority

PROMPTS = [
    "hello there",
    "tell me about the sea and the ships on it, and the sailors",
    "why",
    "what is the capital of France?",
    "ok then",
    "a b c d e f g",
]


@pytest.fixture(scope="module", params=["slots", "transformers"])
def engine(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[LocalEngine]:
    """The tiny model decoded by each step-loop cache in turn: the slot forward, and transformers' own cache."""
    loaded = load_model(resolve_model_source(str(tiny_model_dir), None), tmp_path_factory.mktemp("cache"), "cpu")
    eng = LocalEngine.from_loaded(loaded, "tiny", decode=DecodeOptions(request.param))
    yield eng
    asyncio.run(eng.close())


def req(engine: LocalEngine, text: str, n: int = 1, **params: object) -> GenerationRequest:
    return GenerationRequest(tuple(engine.tokenize(text)), SamplingParams(**params), n)  # type: ignore[arg-type]


async def many(engine: LocalEngine, requests: list[GenerationRequest], slots: int = 4) -> list[Generated]:
    return [g async for g in engine.generate_many(requests, slots=slots)]


def own_steps(engine: LocalEngine, positions: int) -> StepBatch:
    """A step batch of its own over ``engine``'s model and kind of cache, ``positions`` tokens a slot."""
    kind: DecodePath = "slots" if isinstance(engine._steps.cache, SlotModel) else "transformers"
    return StepBatch(
        make_slots(engine.loaded.model, positions, DecodeOptions(kind)),
        engine.loaded.tokenizer,
        engine.loaded.model.device,
        max_positions=positions,
    )


def by_index(done: list[Generated]) -> dict[int, GenerationResult]:
    out = {}
    for g in done:
        assert isinstance(g.result, GenerationResult)
        out[g.index] = g.result
    return out


def assert_same(single: GenerationResult, packed: GenerationResult) -> None:
    """Same tokens, text, finish reason, stop string and usage; logprobs within float32 rounding."""
    assert packed.prompt_tokens == single.prompt_tokens
    assert len(packed.sequences) == len(single.sequences)
    for a, b in zip(single.sequences, packed.sequences, strict=True):
        assert (b.text, b.token_ids, b.finish_reason, b.stop_sequence) == (
            a.text,
            a.token_ids,
            a.finish_reason,
            a.stop_sequence,
        )
        assert b.completion_tokens == a.completion_tokens
        assert (a.logprobs is None) == (b.logprobs is None)
        for x, y in zip(a.logprobs or [], b.logprobs or [], strict=True):
            assert (x.token, x.token_bytes, x.text, [t[0] for t in x.top]) == (
                y.token,
                y.token_bytes,
                y.text,
                [t[0] for t in y.top],
            )
            assert abs(x.logprob - y.logprob) < 1e-4
    assert packed.completion_tokens == single.completion_tokens


async def test_packed_equals_single_at_temperature_zero(engine: LocalEngine) -> None:
    assert isinstance(engine, GeneratesMany)
    requests = [
        req(engine, t, max_tokens=3 + 3 * i, temperature=0, logprobs=2 if i % 3 == 1 else None)
        for i, t in enumerate(PROMPTS)
    ]
    singles = [await engine.generate(r) for r in requests]
    done = await many(engine, requests, slots=4)
    assert sorted(g.index for g in done) == list(range(len(requests)))
    assert all(g.packed for g in done)
    results = by_index(done)
    for i, single in enumerate(singles):
        assert_same(single, results[i])


async def test_per_row_stops_limits_seeds_and_n(engine: LocalEngine) -> None:
    free = await engine.generate(req(engine, PROMPTS[1], max_tokens=12, temperature=0))
    text = free.sequences[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # a stop string that the row meets halfway
    assert stop and stop in text
    requests = [
        req(engine, PROMPTS[1], max_tokens=12, temperature=0, stop=(stop,)),
        req(engine, PROMPTS[0], max_tokens=2, temperature=0),
        req(engine, PROMPTS[2], n=2, max_tokens=3, temperature=1.0, top_p=0.9, seed=7, logprobs=0),
        req(engine, PROMPTS[3], max_tokens=3, temperature=0.8, seed=123),
    ]
    singles = [await engine.generate(r) for r in requests]
    first = by_index(await many(engine, requests, slots=3))
    again = by_index(await many(engine, requests, slots=3))
    assert first[0].sequences[0].finish_reason == "stop" and first[0].sequences[0].stop_sequence == stop
    assert first[0].sequences[0].text == text[: text.index(stop)]
    assert first[1].completion_tokens == 2 and first[1].sequences[0].finish_reason == "length"
    for i, single in enumerate(singles):
        assert_same(single, first[i])  # sampled rows too: their own generators, logits within rounding
        assert_same(first[i], again[i])  # same seed, same output within packed mode
    seqs = first[2].sequences
    assert len({tuple(s.token_ids) for s in seqs}) > 1, "the n samples use seeds seed and seed+1"


async def test_a_finished_row_frees_its_slot_for_the_next(engine: LocalEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    requests = [
        req(engine, PROMPTS[1], max_tokens=24, temperature=0),
        req(engine, PROMPTS[0], max_tokens=2, temperature=0),
        req(engine, PROMPTS[3], max_tokens=5, temperature=0),
    ]
    started: dict[int, int] = {}  # row -> the step (numbered from this test's first) it started in
    finished: dict[int, int] = {}  # row -> the step its result came out of
    rows: dict[int, int] = {}  # ticket -> row
    real = engine.scheduler.run_step
    first = engine.scheduler.steps

    async def spy(
        starts: list[Start], drops: list[int], paused: list[int], stop: Callable[[], bool] | None
    ) -> list[Update]:
        step = engine.scheduler.steps - first
        for s in starts:
            rows[s.ticket] = next(i for i, r in enumerate(requests) if r is s.request)
            started[rows[s.ticket]] = step
        updates = await real(starts, drops, paused, stop)
        finished.update({rows[u.ticket]: step for u in updates if u.result is not None})
        return updates

    monkeypatch.setattr(engine.scheduler, "run_step", spy)
    order = [g.index for g in await many(engine, requests, slots=2)]
    # Two slots: the long row and the 2-token row start; the 2-token row finishes first and the third row takes its
    # slot at the very next step, finishing long before the 24-token row.
    assert started[0] == started[1] == 0, started
    assert started[2] == finished[1] + 1, f"the freed slot is taken at the next step: {started}, {finished}"
    assert finished[0] > started[2], "while the long row is still in flight"
    assert order == [1, 2, 0]


async def test_a_row_alone_is_the_synchronous_result_bit_for_bit(engine: LocalEngine) -> None:
    request = req(engine, PROMPTS[4], max_tokens=8, temperature=0, logprobs=3)
    single = await engine.generate(request)
    (only,) = await many(engine, [request], slots=4)
    assert only.packed is False and only.result == single
    assert [g.result == single for g in await many(engine, [request], slots=1)] == [True]


async def test_refusals_and_empty_requests_fail_alone(engine: LocalEngine) -> None:
    requests = [
        GenerationRequest((), SamplingParams(max_tokens=4, temperature=0)),
        req(engine, PROMPTS[0], max_tokens=0),
        req(engine, PROMPTS[2], max_tokens=3, temperature=0),
    ]
    done = {g.index: g.result for g in await many(engine, requests)}
    assert isinstance(done[0], ValueError)
    assert isinstance(done[1], GenerationResult) and done[1].completion_tokens == 0
    assert done[1].sequences[0].finish_reason == "length"
    assert done[2] == await engine.generate(requests[2])


async def test_prompts_starting_in_one_step_share_one_prefill(engine: LocalEngine) -> None:
    """The prompts of requests that may share, admitted at one step, go through one ``prefill_many`` of the cache,
    a batch-invariant request's prompt alone; a prompt the context cannot hold is refused alone; every first token
    is the one the request gets alone."""
    steps = own_steps(engine, 12)
    calls: list[tuple[str, int]] = []
    for name in ("prefill", "prefill_many"):
        real = getattr(steps.cache, name)

        def counted(*args: Any, _real: Any = real, _name: str = name) -> Any:
            calls.append((_name, len(args[1]) if _name == "prefill_many" else 1))
            return _real(*args)

        setattr(steps.cache, name, counted)
    greedy = {"max_tokens": 1, "temperature": 0, "logprobs": 0}
    shared = [req(engine, PROMPTS[i], **greedy) for i in (0, 2, 4)]
    too_long = GenerationRequest(tuple(range(20)), SamplingParams(**greedy))  # type: ignore[arg-type]
    invariant = dataclasses.replace(req(engine, PROMPTS[5], **greedy), invariant=True)
    with torch.inference_mode():
        updates = steps.step([Start(i, r, r.invariant) for i, r in enumerate([*shared, invariant])], [])
        assert calls.count(("prefill_many", 3)) == 1 and ("prefill", 1) in calls
        if isinstance(steps.cache, SlotModel):  # (transformers' cache runs its prompts one by one inside)
            assert sorted(calls) == [("prefill", 1), ("prefill_many", 3)]
        calls.clear()
        refused = steps.step([Start(10, shared[0]), Start(11, too_long)], [])
    assert ("prefill", 1) in calls  # the shared prefill refused a prompt: each ran alone
    results = {u.ticket: u.result for u in updates + refused}
    assert isinstance(results[11], ValueError)
    for ticket, r in [*enumerate([*shared, invariant]), (10, shared[0])]:
        result = results[ticket]
        assert isinstance(result, GenerationResult)
        assert result == await engine.generate(r), ticket


async def test_a_stop_ends_at_the_next_step_and_drops_the_rows_in_flight(engine: LocalEngine) -> None:
    requests = [req(engine, PROMPTS[0], max_tokens=2, temperature=0)] + [
        req(engine, t, max_tokens=20, temperature=0) for t in PROMPTS[1:4]
    ]
    first = engine.scheduler.steps
    before = engine.executions
    seen = [
        g.index
        async for g in engine.generate_many(requests, slots=2, should_stop=lambda: engine.scheduler.steps - first >= 2)
    ]
    # step 0 starts rows 0 and 1 (two slots) and row 0 ends (2 tokens); step 1 gives its slot to row 2; before step 2
    # the stop is seen: rows 1 and 2 leave unfinished and row 3 never starts
    assert seen == [0], "the short row, then the stop: the long rows in flight are not yielded"
    assert engine.executions - before == 3
    await engine.scheduler.idle()
    assert engine.scheduler.steps - first == 2, "no step ran after the stop"
    assert engine.scheduler.in_flight == 0


async def test_an_invariant_sequence_decodes_in_a_pass_of_its_own(engine: LocalEngine) -> None:
    """A batch-invariant request decodes in a forward pass of its own beside the others' shared pass, on every cache,
    and is the synchronous result bit for bit, reported as not shared."""
    steps = own_steps(engine, 64)
    passes: list[int] = []
    real = steps.cache.decode

    def counted(slots: Any, tokens: Any, stop: Any = None) -> torch.Tensor:
        passes.append(len(slots))
        return real(slots, tokens, stop)

    steps.cache.decode = counted  # type: ignore[method-assign]
    greedy = {"max_tokens": 6, "temperature": 0, "logprobs": 2}
    requests = [req(engine, PROMPTS[i], **greedy) for i in (0, 2)]
    requests.append(dataclasses.replace(req(engine, PROMPTS[5], **greedy), invariant=True))
    results: dict[int, GenerationResult] = {}
    packed: dict[int, bool] = {}
    with torch.inference_mode():
        updates = steps.step([Start(i, r, r.invariant) for i, r in enumerate(requests)], [])
        while len(results) < len(requests):
            for u in updates:
                if isinstance(u.result, GenerationResult):
                    results[u.ticket], packed[u.ticket] = u.result, u.packed
            updates = steps.step([], []) if len(results) < len(requests) else []
    assert passes, "the requests decoded"
    assert 1 in passes and 2 in passes, "the invariant request in a pass of its own"
    assert packed == {0: True, 1: True, 2: False}
    assert results[2] == await engine.generate(requests[2]), "bit for bit the synchronous result"


async def test_a_paused_sequence_keeps_its_slot_and_resumes_where_it_stopped(engine: LocalEngine) -> None:
    """A request paused for some steps (the scheduler's interactive steps) decodes nothing in them, keeps its slot and
    cache, and then ends with the tokens it would have had unpaused, as its neighbours do."""
    steps = own_steps(engine, 64)
    greedy = {"max_tokens": 8, "temperature": 0}
    requests = [req(engine, PROMPTS[i], **greedy) for i in (0, 1, 3)]
    results: dict[int, GenerationResult] = {}
    generated: list[dict[int, int]] = []
    with torch.inference_mode():
        updates = steps.step([Start(i, r) for i, r in enumerate(requests)], [])
        for number in range(1, 40):
            for u in updates:
                if isinstance(u.result, GenerationResult):
                    results[u.ticket] = u.result
            if len(results) == len(requests):
                break
            updates = steps.step([], [], paused={1} if number <= 3 else ())
            generated.append({u.ticket: u.generated for u in updates})
    assert all(1 not in g for g in generated[:3]), "nothing decoded for the paused request in its three steps"
    assert all(g.get(0) == 1 for g in generated[:3]), "its neighbours decoded meanwhile"
    for i, r in enumerate(requests):
        alone = await engine.generate(r)
        assert [s.token_ids for s in results[i].sequences] == [s.token_ids for s in alone.sequences]
        assert results[i].completion_tokens == alone.completion_tokens


async def test_warming_the_steps_leaves_no_trace(engine: LocalEngine) -> None:
    """``StepBatch.warm`` runs a one-token prompt and forgets it: no slot stays taken, the next request is the
    synchronous result, and it is refused while a request is in flight."""
    steps = own_steps(engine, 64)
    request = req(engine, PROMPTS[3], max_tokens=5, temperature=0)
    with torch.inference_mode():
        steps.warm(engine.pad_id)
        steps.warm(engine.pad_id)
        updates = steps.step([Start(0, request)], [])
        with pytest.raises(ValueError, match="before any request"):
            steps.warm(engine.pad_id)
        while not any(u.result is not None for u in updates):
            updates = steps.step([], [])
    result = next(u.result for u in updates if u.result is not None)
    assert result == await engine.generate(request)
    assert steps.tickets() == [] and steps._next_slot == 1, "the warm-up's slot went to the request"


async def test_a_step_given_up_part_way_is_as_if_its_sequences_sat_it_out(engine: LocalEngine) -> None:
    """A step whose ``stop()`` is true decodes nothing for its sequences on the slot forward (transformers' forward
    is never given up), and the requests then end with the tokens they would have had."""
    steps = own_steps(engine, 64)
    slot_forward = isinstance(steps.cache, SlotModel)
    requests = [req(engine, PROMPTS[i], max_tokens=6, temperature=0) for i in (0, 3)]
    results: dict[int, GenerationResult] = {}
    with torch.inference_mode():
        updates = steps.step([Start(i, r) for i, r in enumerate(requests)], [])
        first = {u.ticket: u.generated for u in updates}
        given_up = steps.step([], [], stop=lambda: True)
        assert all(u.generated == 0 for u in given_up) == slot_forward
        for _ in range(20):
            for u in updates + given_up:
                if isinstance(u.result, GenerationResult):
                    results[u.ticket] = u.result
            if len(results) == len(requests):
                break
            updates, given_up = steps.step([], [], stop=lambda: False), []
    assert first == {0: 2, 1: 2}, "each request's prefill token and one decode token"
    for i, r in enumerate(requests):
        alone = await engine.generate(r)
        assert [s.token_ids for s in results[i].sequences] == [s.token_ids for s in alone.sequences]


async def test_an_interactive_scoring_pass_gives_up_a_batch_step(
    engine: LocalEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt-logprobs scoring pass at interactive priority asks the step loop to give up a batch-only step in
    flight; one at batch priority does not. A one-token scoring request needs no such pass: it is a sequence of the
    step loop, admitted there, with its interactive arrival seen by the step in flight."""
    calls: list[int] = []
    monkeypatch.setattr(engine.scheduler, "interrupt", lambda: calls.append(1))
    echo = req(engine, PROMPTS[0], max_tokens=0, temperature=0)
    await engine.score(ScoreRequest(dataclasses.replace(echo, priority=Priority.BATCH), prompt_logprobs=0))
    assert calls == []
    await engine.score(ScoreRequest(dataclasses.replace(echo, priority=Priority.INTERACTIVE), prompt_logprobs=0))
    assert calls == [1]
    steps = engine.scheduler.steps
    one = dataclasses.replace(
        echo, params=dataclasses.replace(echo.params, max_tokens=1), priority=Priority.INTERACTIVE
    )
    await engine.score(ScoreRequest(one))
    assert calls == [1] and engine.scheduler.steps == steps + 1, "one step of the step loop, no scoring pass"
