"""The local engine on a tiny random Llama (fast), plus one slow test on the real SmolLM2."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers.utils import logging as transformers_logging

from miserver.engines.base import (
    Engine,
    GenerationRequest,
    GenerationResult,
    PoolRequest,
    SamplingParams,
    StreamDelta,
)
from miserver.engines.local import loader
from miserver.engines.local import thread as thread_module
from miserver.engines.local.detokenize import _Output
from miserver.engines.local.engine import LocalEngine
from miserver.engines.local.loader import LoadedModel, load_model, resolve_model_source
from miserver.settings import EMBEDDED_MODEL_ID
from tests.support.tiny_model import default_cache_dir
from tests.support.waiting import until


@contextmanager
def forward_passes(engine: LocalEngine) -> Iterator[list[str]]:
    """Each forward pass of the step loop's cache while the block runs (``"prefill"`` or ``"decode"``), whichever
    forward the cache runs (its own or transformers')."""
    calls: list[str] = []
    cache = engine._steps.cache
    names = {"prefill": "prefill", "prefill_many": "prefill", "decode": "decode"}  # one pass of many prompts: one
    for name, counted_as in names.items():
        real = getattr(cache, name)

        def counted(*args: Any, _real: Any = real, _name: str = counted_as) -> Any:
            calls.append(_name)
            return _real(*args)

        setattr(cache, name, counted)  # an instance attribute over the class's method
    try:
        yield calls
    finally:
        for name in names:
            delattr(cache, name)


CHAT = [{"role": "user", "content": "Tell me a story about a cat."}]


@pytest.fixture(scope="module")
def loaded(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    source = resolve_model_source(str(tiny_model_dir), None)
    return load_model(source, tmp_path_factory.mktemp("cache"), "cpu")


@pytest.fixture(scope="module")
def engine(loaded: LoadedModel) -> Iterator[LocalEngine]:
    eng = LocalEngine.from_loaded(loaded, "tiny")
    yield eng
    asyncio.run(eng.close())


def request(engine: LocalEngine, n: int = 1, prompt: str | None = None, **params: object) -> GenerationRequest:
    ids = engine.tokenize(prompt) if prompt is not None else engine.tokenize_chat(CHAT)
    return GenerationRequest(tuple(ids), SamplingParams(**params), n)  # type: ignore[arg-type]


async def collect(engine: LocalEngine, req: GenerationRequest) -> list[StreamDelta]:
    return [d async for d in engine.generate_stream(req)]


def joined(deltas: list[StreamDelta], index: int = 0) -> tuple[str, list[int]]:
    mine = [d for d in deltas if d.index == index]
    return "".join(d.text for d in mine), [t for d in mine for t in d.token_ids]


def test_engine_protocol_and_info(engine: LocalEngine) -> None:
    assert isinstance(engine, Engine)
    assert engine.vocab_size == len(engine.loaded.tokenizer) == 49152
    assert engine.info.backend == "serial"
    assert engine.info.dtype == "float32"
    assert engine.info.context_length == 512
    assert engine.info.weights_revision.startswith("sha256:") and len(engine.info.weights_revision) == 19


def test_tokenize_chat_returns_plain_ids(engine: LocalEngine) -> None:
    ids = engine.tokenize_chat(CHAT)
    assert isinstance(ids, list) and all(type(i) is int for i in ids)
    text = engine.decode(ids)
    assert "Tell me a story" in text
    assert str(engine.loaded.tokenizer.decode(ids)).rstrip().endswith("<|im_start|>assistant")
    assert engine.tokenize("hello world") == engine.loaded.tokenizer("hello world")["input_ids"]


async def test_greedy_is_deterministic(engine: LocalEngine) -> None:
    req = request(engine, max_tokens=24, temperature=0.0)
    a, b = await engine.generate(req), await engine.generate(req)
    assert a.sequences[0].token_ids == b.sequences[0].token_ids
    assert a.sequences[0].text == b.sequences[0].text == engine.decode(a.sequences[0].token_ids)


async def test_same_seed_same_output_different_seeds_differ(engine: LocalEngine) -> None:
    one = await engine.generate(request(engine, max_tokens=30, temperature=1.0, seed=1))
    again = await engine.generate(request(engine, max_tokens=30, temperature=1.0, seed=1))
    other = await engine.generate(request(engine, max_tokens=30, temperature=1.0, seed=2))
    assert one.sequences[0].token_ids == again.sequences[0].token_ids
    assert one.sequences[0].token_ids != other.sequences[0].token_ids


@pytest.mark.parametrize("top_p", [1e-6, 0.0])
async def test_tiny_top_p_is_greedy(engine: LocalEngine, top_p: float) -> None:
    # top_p 0 keeps only the most likely token (OpenAI accepts it), it never empties the distribution
    greedy = await engine.generate(request(engine, max_tokens=20, temperature=0.0))
    nucleus = await engine.generate(request(engine, max_tokens=20, temperature=1.0, top_p=top_p, seed=5))
    assert nucleus.sequences[0].token_ids == greedy.sequences[0].token_ids


async def test_max_tokens_gives_length(engine: LocalEngine) -> None:
    req = request(engine, max_tokens=7, temperature=1.0, seed=3)
    result = await engine.generate(req)
    seq = result.sequences[0]
    assert len(seq.token_ids) == 7 and seq.finish_reason == "length"
    assert result.prompt_tokens == len(req.prompt_ids) and result.completion_tokens == 7


async def test_max_tokens_zero_runs_no_model(engine: LocalEngine) -> None:
    with forward_passes(engine) as calls:
        result = await engine.generate(request(engine, n=2, max_tokens=0))
        deltas = await collect(engine, request(engine, max_tokens=0))
        assert calls == [], "the model must not run"
        await engine.generate(request(engine, max_tokens=1))
        assert calls, "the counter sees the model run (else the first check proves nothing)"
    assert [(s.token_ids, s.text, s.finish_reason) for s in result.sequences] == [([], "", "length")] * 2
    assert deltas == [StreamDelta(0, "", finish_reason="length")]


async def test_context_length_caps_generation(engine: LocalEngine) -> None:
    prompt = tuple(engine.tokenize(" cat" * 510))[:510]
    result = await engine.generate(GenerationRequest(prompt, SamplingParams(max_tokens=50, temperature=0.0)))
    assert len(result.sequences[0].token_ids) == 2 and result.sequences[0].finish_reason == "length"


async def test_eos_stops_and_is_not_returned(engine: LocalEngine, loaded: LoadedModel) -> None:
    greedy = await engine.generate(request(engine, prompt="Once upon a time", max_tokens=10, temperature=0.0))
    ids = greedy.sequences[0].token_ids
    eng = LocalEngine.from_loaded(loaded, "tiny-eos")
    eng.eos_ids = frozenset({ids[3]})
    result = await eng.generate(request(eng, prompt="Once upon a time", max_tokens=10, temperature=0.0))
    await eng.close()
    first = ids.index(ids[3])
    assert result.sequences[0].token_ids == ids[:first] and result.sequences[0].finish_reason == "stop"


async def test_stop_string_trims_text_and_tokens(engine: LocalEngine) -> None:
    base = request(engine, prompt="The weather today", max_tokens=40, temperature=1.0, seed=11)
    full = (await engine.generate(base)).sequences[0]
    # a stop string spanning a token boundary, somewhere in the middle of the output
    cut = len(engine.decode(full.token_ids[:12]))
    stop = full.text[cut - 2 : cut + 3]
    expected = full.text[: full.text.index(stop)]
    req = GenerationRequest(base.prompt_ids, SamplingParams(max_tokens=40, temperature=1.0, seed=11, stop=(stop,)))
    seq = (await engine.generate(req)).sequences[0]
    assert seq.finish_reason == "stop" and seq.text == expected
    assert stop not in seq.text
    # the token ids are those the text comes from: the last one begins before the stop string (it is cut there)
    assert seq.token_ids == full.token_ids[: len(seq.token_ids)] and len(seq.token_ids) < len(full.token_ids)
    assert engine.decode(seq.token_ids).startswith(expected) and len(engine.decode(seq.token_ids[:-1])) < len(expected)
    # every generated token counts, up to the one that completed the stop string
    completed = next(k for k in range(1, len(full.token_ids) + 1) if stop in engine.decode(full.token_ids[:k]))
    assert seq.completion_tokens == completed > len(seq.token_ids)
    deltas = await collect(engine, req)
    assert joined(deltas) == (seq.text, seq.token_ids)
    assert deltas[-1].finish_reason == "stop"


async def test_logprobs_shape(engine: LocalEngine) -> None:
    seq = (await engine.generate(request(engine, max_tokens=12, temperature=1.0, seed=4, logprobs=5))).sequences[0]
    assert seq.logprobs is not None and len(seq.logprobs) == len(seq.token_ids) == 12
    for token_id, lp in zip(seq.token_ids, seq.logprobs):
        assert lp.token_id == token_id and lp.logprob <= 0.0
        assert len(lp.top) == 5
        values = [v for _, _, v in lp.top]
        assert values == sorted(values, reverse=True)
        for tid, text, value in lp.top:
            assert isinstance(text, str)
            if tid == token_id:
                assert value == lp.logprob
    greedy = (await engine.generate(request(engine, max_tokens=5, temperature=0.0, logprobs=0))).sequences[0]
    assert greedy.logprobs is not None
    assert all(lp.top == () for lp in greedy.logprobs)
    without = (await engine.generate(request(engine, max_tokens=3))).sequences[0]
    assert without.logprobs is None


async def test_logprobs_ignore_temperature(engine: LocalEngine) -> None:
    """Logprobs are of the raw logits: the first position's top list does not depend on the temperature."""
    cold = (await engine.generate(request(engine, max_tokens=1, temperature=0.0, logprobs=3))).sequences[0]
    hot = (await engine.generate(request(engine, max_tokens=1, temperature=2.0, logprobs=3))).sequences[0]
    assert cold.logprobs and hot.logprobs and cold.logprobs[0].top == hot.logprobs[0].top
    assert cold.logprobs[0].top[0][0] == cold.token_ids[0]


async def test_stream_matches_non_stream(engine: LocalEngine) -> None:
    req = request(engine, max_tokens=40, temperature=1.0, seed=7, logprobs=2)
    result: GenerationResult = await engine.generate(req)
    deltas = await collect(engine, req)
    seq = result.sequences[0]
    assert joined(deltas) == (seq.text, seq.token_ids)
    assert [lp for d in deltas for lp in d.logprobs] == seq.logprobs
    assert [d.finish_reason for d in deltas].count("length") == 1 and deltas[-1].finish_reason == "length"
    assert len(deltas) > 5  # really incremental


async def test_n_sequences_use_consecutive_seeds(engine: LocalEngine) -> None:
    both = await engine.generate(request(engine, n=2, max_tokens=15, temperature=1.0, seed=20))
    assert [s.index for s in both.sequences] == [0, 1]
    for i, seq in enumerate(both.sequences):
        alone = (await engine.generate(request(engine, max_tokens=15, temperature=1.0, seed=20 + i))).sequences[0]
        assert seq.token_ids == alone.token_ids
    assert both.completion_tokens == 30
    deltas = await collect(engine, request(engine, n=2, max_tokens=15, temperature=1.0, seed=20))
    assert [joined(deltas, i)[1] for i in range(2)] == [s.token_ids for s in both.sequences]


async def test_concurrent_requests_are_serialised_and_unchanged(engine: LocalEngine) -> None:
    reqs = [request(engine, max_tokens=10, temperature=1.0, seed=s) for s in (30, 31, 32)]
    alone = [await engine.generate(r) for r in reqs]
    together = await asyncio.gather(*(engine.generate(r) for r in reqs))
    assert [r.sequences[0].token_ids for r in together] == [r.sequences[0].token_ids for r in alone]


async def test_executions_counter_and_hook(engine: LocalEngine) -> None:
    seen: list[GenerationRequest | PoolRequest] = []
    engine.on_execute = seen.append
    before = engine.executions
    req = request(engine, max_tokens=2)
    await engine.generate(req)
    await collect(engine, req)
    engine.on_execute = None
    assert engine.executions == before + 2 and seen == [req, req]


async def test_closing_a_stream_stops_the_work(engine: LocalEngine) -> None:
    """A stream closed after its first delta leaves at the next step: at most the step running when it closed
    completes, and at most that step's one forward pass runs after the close."""
    with forward_passes(engine) as calls:
        stream = engine.generate_stream(request(engine, max_tokens=400, temperature=1.0))
        async for _ in stream:
            break
        steps, forwards = engine.scheduler.steps, len(calls)
        await stream.aclose()  # type: ignore[attr-defined]
        await engine.scheduler.idle()
    assert forwards >= 1, "the work had started: a delta came out of a forward pass"
    assert engine.scheduler.steps - steps <= 1, "no step ran after the one in progress at the close"
    assert len(calls) - forwards <= 1
    assert engine.scheduler.in_flight == 0


async def test_cancelling_generate_stops_the_work(engine: LocalEngine) -> None:
    """A generation cancelled once it has really run (its prefill and two decode steps) leaves at the next step: at
    most one more step (the one running, or already queued, when the cancel reached the request) and its one token
    follow. Counted by the engine's own steps and generated tokens, whichever decode forward runs them."""
    first, generated = engine.scheduler.steps, engine.generated_tokens
    task = asyncio.create_task(engine.generate(request(engine, max_tokens=400, temperature=1.0)))
    await until(lambda: engine.scheduler.steps - first, lambda n: n >= 3, what="three steps of the generation")
    steps, tokens = engine.scheduler.steps, engine.generated_tokens
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await engine.scheduler.idle()
    assert tokens - generated >= 3, "the work had started before the cancel"
    assert engine.scheduler.steps - steps <= 1, "at most one step ran after the cancel"
    assert engine.generated_tokens - tokens <= 1, "at most one token was generated after the cancel"
    assert engine.scheduler.in_flight == 0


def test_incremental_text_holds_back_split_characters_and_stop_prefixes(loaded: LoadedModel) -> None:
    text = "héllo 日本語 😀 and the end word, done"
    ids = loaded.tokenizer(text, add_special_tokens=False)["input_ids"]
    out = _Output(loaded.tokenizer, ("end word,",), 0)
    emitted: list[str] = []
    for token in ids:
        out.add(token, None)
        if out.stop_at is not None:
            break
        delta = out.pending()
        if delta is not None:
            assert "\ufffd" not in delta.text
            emitted.append(delta.text)
    assert "end" not in "".join(emitted)  # "end word," could have started there: held back
    emitted.append(out.finish("stop").text)
    assert "".join(emitted) == "héllo 日本語 😀 and the "


def test_resolve_model_source(tiny_model_dir: Path, tmp_path: Path) -> None:
    embedded = resolve_model_source(EMBEDDED_MODEL_ID, None)
    assert embedded.kind == "gguf" and embedded.served_id == EMBEDDED_MODEL_ID and embedded.path.is_file()
    assert resolve_model_source(EMBEDDED_MODEL_ID, "smol").served_id == "smol"
    folder = resolve_model_source(str(tiny_model_dir), None)
    assert folder.kind == "directory" and folder.served_id == str(tiny_model_dir)
    with pytest.raises(ValueError, match="nope"):
        resolve_model_source(str(tmp_path / "nope"), None)
    with pytest.raises(ValueError, match="config.json"):
        resolve_model_source(str(tmp_path), None)


async def test_only_the_engine_thread_runs_torch_on_several_threads(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One OpenMP team in the process: the engine thread runs its forward passes on the engine's threads, the event
    loop's thread and threads started later on one (a second team made libgomp stop spinning between parallel
    regions: a decode step cost twice as much); a model loaded later gets the count torch had before the first
    engine started, not the loop thread's one."""
    monkeypatch.setattr(thread_module, "_threads_at_first_start", 2)
    before = torch.get_num_threads()
    loop = asyncio.get_running_loop()
    try:
        engine = await LocalEngine.start(model=str(tiny_model_dir), served_model_name="tiny", device="cpu", threads=2)
        try:
            on_engine = await loop.run_in_executor(engine._executor, torch.get_num_threads)
            later: list[int] = []
            thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
            thread.start()
            thread.join()
            assert (on_engine, torch.get_num_threads(), later) == (2, 1, [1])
        finally:
            await engine.close()
        reloaded = await LocalEngine.start(model=str(tiny_model_dir), served_model_name="tiny", device="cpu")
        try:
            assert await loop.run_in_executor(reloaded._executor, torch.get_num_threads) == 2
        finally:
            await reloaded.close()
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
async def test_real_model_answers_and_loads_from_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    cache_dir = default_cache_dir()
    engine = await LocalEngine.start(EMBEDDED_MODEL_ID, cache_dir=cache_dir)
    try:
        assert engine.info.model_id == EMBEDDED_MODEL_ID
        ids = engine.tokenize_chat([{"role": "user", "content": "What is the capital of France? Answer in one word."}])
        result = await engine.generate(GenerationRequest(tuple(ids), SamplingParams(max_tokens=20, temperature=0.0)))
        assert "Paris" in result.sequences[0].text
        assert result.sequences[0].finish_reason == "stop"
    finally:
        await engine.close()
    converted = loader.converted_path(resolve_model_source(EMBEDDED_MODEL_ID), cache_dir)
    assert converted is not None and (converted / "config.json").is_file()

    def no_conversion(*args: object) -> None:
        raise AssertionError("the second load must come from the cache")

    monkeypatch.setattr(loader, "_convert_gguf", no_conversion)
    again = await LocalEngine.start(EMBEDDED_MODEL_ID, cache_dir=cache_dir)
    assert again.info.weights_revision == engine.info.weights_revision
    await again.close()


def test_loading_writes_no_progress_bars_into_a_log(
    tiny_model_dir: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Standard error here is a file, as a server's log is: transformers' progress bars stay out of it."""
    was_enabled = transformers_logging.is_progress_bar_enabled()
    transformers_logging.enable_progress_bar()  # as a fresh process has it
    try:
        load_model(resolve_model_source(str(tiny_model_dir), None), tmp_path, "cpu")
        err = capfd.readouterr().err
    finally:
        (transformers_logging.enable_progress_bar if was_enabled else transformers_logging.disable_progress_bar)()
    assert "Loading weights" not in err and "\r" not in err, err
