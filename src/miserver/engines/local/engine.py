"""The local engine: one resident transformers model driven from one dedicated thread (DESIGN §8).

All torch work (loading, prefill, decode steps, scoring and pooling passes) runs on a single ``miserver-engine``
worker thread, so the event loop never blocks on the model. Generation goes through the step scheduler
(``scheduler.StepScheduler``): every request in flight, synchronous or batch row, streamed or not, shares one
continuous batch, admitted and retired at each decode step (``steps.StepBatch``); scoring and pooling packs and
weight edits run on the same thread between two steps.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import torch

from miserver.engines.base import (
    EngineInfo,
    Generated,
    GenerationRequest,
    GenerationResult,
    Grammar,
    PoolRequest,
    ScoreRequest,
    ScoreResult,
    StreamDelta,
    Vector,
)
from miserver.engines.local.decoding import DEFAULT_DECODE, DecodeOptions, make_slots
from miserver.engines.local.embed import pool_pack
from miserver.engines.local.loader import LoadedModel, eos_ids_of, load_model, resolve_model_source
from miserver.engines.local.processors import BACKEND as GRAMMAR_BACKEND
from miserver.engines.local.processors import CacheStats, Grammars
from miserver.engines.local.scheduler import Group, StepScheduler, Ticket
from miserver.engines.local.score import score_pack
from miserver.engines.local.steps import Start, StepBatch, Update
from miserver.engines.local.thread import engine_threads, new_executor, one_openmp_team
from miserver.scheduling.admission import Priority

_T = TypeVar("_T")

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


class LocalEngine:
    """An :class:`~miserver.engines.base.Engine` over a model in this process.

    ``executions`` counts requests run (each generation request as the step scheduler admits it, and each request of
    ``score``, ``score_many``, ``embed``, ``embed_many``); ``on_execute``, when set, is called with each request at
    that moment (tests use both to prove work is not run twice). ``max_sequences`` caps the sequences in flight,
    ``batch_slots`` those of batch requests (interactive ones join above them, up to ``max_sequences``);
    ``prefill_tokens`` bounds the batch prompt tokens prefilled in one step, ``batch_hold_steps`` the steps of
    interactive work a waiting batch row is held back for, ``batch_rows_beside_interactive`` the batch sequences in
    flight that keep decoding while interactive requests run (see ``scheduler.StepScheduler``).
    ``decode`` picks the decode step (``slots.make_slots``): the static-cache Llama forward where the model allows
    it (the default), or transformers' own forward and cache.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        served_id: str,
        executor: ThreadPoolExecutor | None = None,
        *,
        max_sequences: int = DEFAULT_MAX_SEQUENCES,
        batch_slots: int = DEFAULT_BATCH_SLOTS,
        prefill_tokens: int = DEFAULT_PREFILL_TOKENS,
        batch_hold_steps: int = DEFAULT_BATCH_HOLD_STEPS,
        batch_rows_beside_interactive: int = DEFAULT_BATCH_ROWS_BESIDE_INTERACTIVE,
        decode: DecodeOptions = DEFAULT_DECODE,
    ) -> None:
        self._loaded: LoadedModel | None = loaded
        self._executor = executor or new_executor()
        config = loaded.model.config
        self.context_length = int(getattr(config, "max_position_embeddings", 0) or 0)
        self.num_layers = int(getattr(config, "num_hidden_layers", 0) or 0)
        self.info = EngineInfo(
            model_id=served_id,
            backend="serial",
            dtype=str(loaded.dtype).removeprefix("torch."),
            weights_revision=loaded.weights_revision,
            context_length=self.context_length,
            hidden_size=int(getattr(config, "hidden_size", 0) or 0),
            num_layers=self.num_layers,
        )
        self.eos_ids = eos_ids_of(loaded)
        pad = loaded.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else next(iter(sorted(self.eos_ids)), 0))
        embedding = loaded.model.get_input_embeddings()
        rows = embedding.num_embeddings if isinstance(embedding, torch.nn.Embedding) else config.vocab_size
        self._vocab_size = int(rows)
        self.executions = 0
        #: tokens generated by this engine since it started, over every sequence (``/metrics``)
        self.generated_tokens = 0
        self.on_execute: Callable[[GenerationRequest | PoolRequest], None] | None = None
        self._steps = StepBatch(
            make_slots(loaded.model, self.context_length or None, decode),
            loaded.tokenizer,
            loaded.model.device,
            eos_ids=self.eos_ids,
            max_positions=self.context_length or None,
            grammars=Grammars(loaded.tokenizer, self._vocab_size, self.eos_ids),
        )
        self.scheduler = StepScheduler(
            self._run_step,
            max_sequences=max_sequences,
            batch_slots=batch_slots,
            prefill_tokens=prefill_tokens,
            batch_hold_steps=batch_hold_steps,
            interactive_batch_rows=batch_rows_beside_interactive,
            on_start=self._count,
            on_generated=self._generated,
        )

    @classmethod
    async def start(
        cls,
        model: str,
        served_model_name: str | None = None,
        cache_dir: Path | str = Path("~/.cache/miserver"),
        device: str | None = None,
        *,
        max_sequences: int = DEFAULT_MAX_SEQUENCES,
        batch_slots: int = DEFAULT_BATCH_SLOTS,
        prefill_tokens: int = DEFAULT_PREFILL_TOKENS,
        batch_hold_steps: int = DEFAULT_BATCH_HOLD_STEPS,
        batch_rows_beside_interactive: int = DEFAULT_BATCH_ROWS_BESIDE_INTERACTIVE,
        decode: DecodeOptions = DEFAULT_DECODE,
        threads: int | None = None,
    ) -> LocalEngine:
        """Resolve and load ``model`` on the engine thread (the loop stays free) and return the running engine, its
        decode step's weight copies made (one step of a one-token prompt, so the first request does not wait). The
        engine thread's forward passes run on ``threads`` OpenMP threads (None: as many as torch used before the
        first engine of the process started); torch work on any other thread runs on one from then on (see
        :func:`thread.one_openmp_team`).

        Raises ``ValueError`` for an unknown model id or path (see ``resolve_model_source``).
        """
        source = resolve_model_source(model, served_model_name)
        executor = new_executor(engine_threads(threads))
        cache = Path(cache_dir).expanduser()
        try:
            loaded = await asyncio.get_running_loop().run_in_executor(executor, load_model, source, cache, device)
        except BaseException:
            executor.shutdown(wait=False, cancel_futures=True)
            raise
        one_openmp_team(executor)
        engine = cls(
            loaded,
            source.served_id,
            executor,
            max_sequences=max_sequences,
            batch_slots=batch_slots,
            prefill_tokens=prefill_tokens,
            batch_hold_steps=batch_hold_steps,
            batch_rows_beside_interactive=batch_rows_beside_interactive,
            decode=decode,
        )
        await engine._warm()
        return engine

    @classmethod
    def from_loaded(
        cls,
        loaded: LoadedModel,
        served_id: str,
        *,
        max_sequences: int = DEFAULT_MAX_SEQUENCES,
        batch_slots: int = DEFAULT_BATCH_SLOTS,
        decode: DecodeOptions = DEFAULT_DECODE,
    ) -> LocalEngine:
        """An engine over a model already in memory (tests)."""
        return cls(loaded, served_id, max_sequences=max_sequences, batch_slots=batch_slots, decode=decode)

    @property
    def prompt_tokens(self) -> dict[str, int]:
        """Prompt tokens the step loop prefilled since the start: ``computed``, and ``reused`` (copied from a prompt a
        slot held, see ``prefixes.PromptPrefixes``); empty where its cache reuses none."""
        prefixes = getattr(self._steps.cache, "prefixes", None)
        return {} if prefixes is None else {"computed": prefixes.computed, "reused": prefixes.reused}

    @property
    def eos_ids(self) -> frozenset[int]:
        """The token ids that end a sequence (``"stop"``, not returned)."""
        return self._eos_ids

    @eos_ids.setter
    def eos_ids(self, ids: frozenset[int]) -> None:
        self._eos_ids = frozenset(ids)
        if hasattr(self, "_steps"):
            self._steps.eos_ids = self._eos_ids
            # a grammar ends at the end-of-sequence tokens: recompile with the new ones
            self._steps.grammars = Grammars(self.loaded.tokenizer, self._vocab_size, self._eos_ids)

    #: the constrained-decoding library (``X-miLLM-Grammar``)
    grammar_backend = GRAMMAR_BACKEND

    def check_grammar(self, grammar: Grammar) -> None:
        """Compile ``grammar`` now (cached for the rows and requests that use it); raises ``ValueError`` with the
        reason when it cannot be compiled."""
        grammars = self._steps.grammars
        assert grammars is not None, "the local engine always has its grammars"
        grammars.compile(grammar)

    @property
    def grammar_stats(self) -> CacheStats:
        """Grammar compilations asked for since the model loaded: cache hits and misses."""
        grammars = self._steps.grammars
        assert grammars is not None, "the local engine always has its grammars"
        return grammars.stats

    @property
    def loaded(self) -> LoadedModel:
        """The resident model; raises ``RuntimeError`` once closed."""
        if self._loaded is None:
            raise RuntimeError("the engine is closed")
        return self._loaded

    @property
    def source_revision(self) -> str:
        """The weights revision of the files the model was loaded from (``info.weights_revision`` differs once a
        weight write was committed)."""
        return self.loaded.weights_revision

    @property
    def vocab_size(self) -> int:
        """Number of token ids the model accepts (rows of its input embedding; ids are ``0 .. vocab_size - 1``)."""
        return self._vocab_size

    def tokenize_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Token ids of ``messages`` through the model's chat template, ending with the assistant prompt."""
        ids: Any = self.loaded.tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=True, return_dict=False
        )
        if not isinstance(ids, list):  # a BatchEncoding / dict, depending on the transformers version
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def tokenize(self, text: str) -> list[int]:
        """Token ids of plain ``text`` (with BOS when the tokenizer adds one)."""
        return [int(i) for i in self.loaded.tokenizer(text, add_special_tokens=True)["input_ids"]]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens dropped."""
        return str(self.loaded.tokenizer.decode(list(ids), skip_special_tokens=True))

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """Run ``request`` to completion in the step loop; sequences come back in index order.

        Cancelling the awaiting task makes the request leave at the next step. Raises ``ValueError`` for a request
        the engine refuses (an empty prompt, a prompt longer than the context)."""
        ticket = self.scheduler.submit(request)
        try:
            result = await ticket.outcome()
        except asyncio.CancelledError:
            ticket.cancel()
            raise
        if isinstance(result, ValueError):
            raise result
        return result

    def generate_stream(self, request: GenerationRequest) -> AsyncIterator[StreamDelta]:
        """Deltas as each step produces them. Closing the iterator early makes the request leave at the next step.
        Raises ``ValueError`` as :meth:`generate`."""
        if self._loaded is None:
            raise RuntimeError("the engine is closed")
        return self._stream(self.scheduler.submit(request))

    async def generate_many(
        self,
        requests: Sequence[GenerationRequest],
        *,
        slots: int,
        should_stop: Callable[[], bool] | None = None,
        should_drain: Callable[[], bool] | None = None,
    ) -> AsyncIterator[Generated]:
        """The requests as one group in the step loop, at most ``slots`` of its sequences in flight; each request is
        yielded when all its sequences are done, in finishing order.

        Before every step ``should_stop()`` is asked; once true the iterator ends and the group's requests in flight
        leave (never yielded). Once ``should_drain()`` is true no waiting request of the group starts any more and
        the iterator ends when those in flight are done. A request is counted (``executions``, ``on_execute``) when
        it starts. A request the engine refuses (``ValueError``) is yielded with that error as its result."""
        if self._loaded is None:
            raise RuntimeError("the engine is closed")
        group = Group(should_stop=should_stop, should_drain=should_drain, slots=max(1, slots))
        tickets = [self.scheduler.submit(r, group) for r in requests]
        index = {t.number: i for i, t in enumerate(tickets)}
        pending = {asyncio.ensure_future(t.done.wait()): t for t in tickets}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for fut in done:
                    t = pending.pop(fut)
                    if t.error is not None:
                        raise t.error
                    if t.result is None:  # withdrawn: the group stopped or drained
                        continue
                    yield Generated(index[t.number], t.result, t.packed)
                if group.stopped():
                    return
        finally:
            for fut in pending:
                fut.cancel()
            for t in tickets:
                t.cancel()

    async def score(self, request: ScoreRequest) -> ScoreResult:
        """One scoring request alone (a pack of one row, no padding). Raises ``ValueError`` as :meth:`score_many`."""
        return (await self.score_many([request]))[0]

    async def score_many(self, requests: Sequence[ScoreRequest]) -> list[ScoreResult]:
        """The requests as one right-padded pack on the engine thread (see ``score.score_pack``); results in order.

        Raises ``ValueError`` for ``max_tokens`` above 1 or an empty prompt that needs a forward pass.
        """
        for r in requests:
            self._count(r.generation)
        if any(r.generation.priority == Priority.INTERACTIVE for r in requests):
            self.scheduler.interrupt()  # not behind the batch's step in flight
        loaded = self.loaded
        return await self._inference(
            lambda: score_pack(
                loaded.model,
                loaded.tokenizer,
                requests,
                pad_id=self.pad_id,
                eos_ids=self.eos_ids,
                max_positions=self.context_length or None,
                grammars=self._steps.grammars,
            )
        )

    async def embed(self, request: PoolRequest) -> Vector:
        """One pooled vector, its input alone (no padding). Raises ``ValueError`` as :meth:`embed_many`."""
        return (await self.embed_many([request]))[0]

    async def embed_many(self, requests: Sequence[PoolRequest]) -> list[Vector]:
        """The inputs as one right-padded pack, each pooled over its own tokens; float32 ``[hidden]`` vectors.

        Raises ``ValueError`` for an empty input, a layer out of range, or requests naming different layers.
        """
        for r in requests:
            self._count(r)
        loaded = self.loaded
        return await self._inference(
            lambda: pool_pack(loaded.model, requests, pad_id=self.pad_id, num_layers=self.num_layers)
        )

    async def call(self, fn: Callable[[LoadedModel], _T]) -> _T:
        """Run ``fn(loaded model)`` on the engine thread, after the work queued before it (weight edits, saves:
        never beside a forward pass); re-raises what ``fn`` raises. The prompts the step loop's cache holds are not
        reused after it."""
        loaded, cache = self.loaded, self._steps.cache

        def run() -> _T:
            try:
                with torch.no_grad():
                    return fn(loaded)
            finally:
                cache.forget_prompts()  # ``fn`` may have written weights: the keys and values held are stale

        return await asyncio.get_running_loop().run_in_executor(self._executor, run)

    def rename(self, *, model_id: str | None = None, weights_revision: str | None = None) -> None:
        """Change the provenance of the resident weights: the id they are served under (a checkpoint save) or their
        revision (a weight commit). Responses built from now on carry the new values."""
        changes: dict[str, str] = {}
        if model_id is not None:
            changes["model_id"] = model_id
        if weights_revision is not None:
            changes["weights_revision"] = weights_revision
        self.info = dataclasses.replace(self.info, **changes)  # type: ignore[arg-type]

    async def close(self) -> None:
        """Finish the running request, stop the thread and drop the model."""
        if self._loaded is None:
            return
        executor = self._executor
        await asyncio.get_running_loop().run_in_executor(None, lambda: executor.shutdown(True, cancel_futures=True))
        self._loaded = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # --- engine thread -------------------------------------------------------------------------------------------

    def _count(self, request: GenerationRequest | PoolRequest) -> None:
        if self._loaded is None:
            raise RuntimeError("the engine is closed")
        self.executions += 1
        if self.on_execute is not None:
            self.on_execute(request)

    def _generated(self, tokens: int) -> None:
        self.generated_tokens += tokens

    async def _inference(self, fn: Callable[[], _T]) -> _T:
        """``fn()`` under ``torch.inference_mode`` on the engine thread, after the work queued before it."""

        def run() -> _T:
            with torch.inference_mode():
                return fn()

        return await asyncio.get_running_loop().run_in_executor(self._executor, run)

    async def _warm(self) -> None:
        """One step of a one-token prompt on the engine thread before the first request (``StepBatch.warm``)."""
        steps, token = self._steps, self.pad_id
        await self._inference(lambda: steps.warm(token))

    async def _run_step(
        self, starts: list[Start], drops: list[int], paused: list[int], stop: Callable[[], bool] | None
    ) -> list[Update]:
        """One step of the step loop on the engine thread (a failed step drops everything in flight)."""
        batch = self._steps

        def run() -> list[Update]:
            try:
                return batch.step(starts, drops, paused, stop)
            except BaseException:
                batch.reset()
                raise

        return await self._inference(run)

    async def _stream(self, ticket: Ticket) -> AsyncIterator[StreamDelta]:
        try:
            while (delta := await ticket.deltas.get()) is not None:
                yield delta
            if ticket.error is not None:
                raise ticket.error
            if isinstance(ticket.result, ValueError):
                raise ticket.result
        finally:
            ticket.cancel()
