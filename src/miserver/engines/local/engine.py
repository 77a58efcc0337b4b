"""The local engine: one resident transformers model driven from one dedicated thread (DESIGN §8).

All torch work (loading, prefill, decode, scoring and pooling passes) runs on a single ``miserver-engine`` worker
thread, so requests are executed one at a time in submission order and the event loop never blocks on the model.
Streaming hands deltas from that thread to the event loop through an ``asyncio.Queue`` fed with
``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
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
    PoolRequest,
    ScoreRequest,
    ScoreResult,
    StreamDelta,
    Vector,
)
from miserver.engines.local.batched import BatchDecoder, batchable
from miserver.engines.local.embed import pool_pack
from miserver.engines.local.generate import collect_result, generate_request
from miserver.engines.local.loader import LoadedModel, load_model, resolve_model_source
from miserver.engines.local.score import score_pack

_DONE = object()
_T = TypeVar("_T")


def _new_executor() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="miserver-engine")


class LocalEngine:
    """An :class:`~miserver.engines.base.Engine` over a model in this process.

    ``executions`` counts requests run (``generate``/``generate_stream`` calls, and each request of ``score``,
    ``score_many``, ``embed``, ``embed_many``); ``on_execute``, when set, is called with each request at that moment
    (tests use both to prove work is not run twice).
    """

    def __init__(self, loaded: LoadedModel, served_id: str, executor: ThreadPoolExecutor | None = None) -> None:
        self._loaded: LoadedModel | None = loaded
        self._executor = executor or _new_executor()
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
        self.eos_ids = _eos_ids(loaded)
        pad = loaded.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else next(iter(sorted(self.eos_ids)), 0))
        embedding = loaded.model.get_input_embeddings()
        rows = embedding.num_embeddings if isinstance(embedding, torch.nn.Embedding) else config.vocab_size
        self._vocab_size = int(rows)
        self.executions = 0
        self.on_execute: Callable[[GenerationRequest | PoolRequest], None] | None = None
        self._can_batch: bool | None = None  # see batched.batchable

    @classmethod
    async def start(
        cls,
        model: str,
        served_model_name: str | None = None,
        cache_dir: Path | str = Path("~/.cache/miserver"),
        device: str | None = None,
    ) -> LocalEngine:
        """Resolve and load ``model`` on the engine thread (the loop stays free) and return the running engine.

        Raises ``ValueError`` for an unknown model id or path (see ``resolve_model_source``).
        """
        source = resolve_model_source(model, served_model_name)
        executor = _new_executor()
        cache = Path(cache_dir).expanduser()
        try:
            loaded = await asyncio.get_running_loop().run_in_executor(executor, load_model, source, cache, device)
        except BaseException:
            executor.shutdown(wait=False, cancel_futures=True)
            raise
        return cls(loaded, source.served_id, executor)

    @classmethod
    def from_loaded(cls, loaded: LoadedModel, served_id: str) -> LocalEngine:
        """An engine over a model already in memory (tests)."""
        return cls(loaded, served_id)

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
        """Run ``request`` to completion on the engine thread; sequences come back in index order.

        Cancelling the awaiting task stops the work at the next token.
        """
        self._count(request)
        cancelled = threading.Event()
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._executor, self._run_to_end, request, cancelled.is_set)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    def generate_stream(self, request: GenerationRequest) -> AsyncIterator[StreamDelta]:
        """Deltas as tokens are produced. Closing the iterator early stops the work at the next token."""
        self._count(request)
        return self._stream(request)

    async def generate_many(
        self,
        requests: Sequence[GenerationRequest],
        *,
        slots: int,
        should_stop: Callable[[], bool] | None = None,
        should_drain: Callable[[], bool] | None = None,
    ) -> AsyncIterator[Generated]:
        """Continuous batching (``batched.BatchDecoder``): up to ``slots`` sequences per decode step, a finished
        sequence's slot refilled from the waiting requests; each request yielded when all its sequences are done.

        Each decode step is one job on the engine thread; between steps ``should_stop()`` is asked on the caller's
        thread, and once true the iterator ends, dropping the requests in flight; once ``should_drain()`` is true no
        waiting request starts any more and the iterator ends when the requests in flight are done. A request is counted
        (``executions``, ``on_execute``) when it starts. With ``slots`` 1, or a model whose cache cannot be batched
        (sliding-window layers), the requests run one at a time through :meth:`generate`. A request that
        :meth:`generate` refuses (``ValueError``) is yielded with that error as its result.
        """
        loaded = self.loaded
        if slots <= 1 or not self._batchable():
            for i, request in enumerate(requests):
                if (should_stop is not None and should_stop()) or (should_drain is not None and should_drain()):
                    return
                try:
                    yield Generated(i, await self.generate(request), False)
                except ValueError as exc:
                    yield Generated(i, exc, False)
            return
        decoder = BatchDecoder(
            loaded.model,
            loaded.tokenizer,
            requests,
            slots=slots,
            eos_ids=self.eos_ids,
            max_positions=self.context_length or None,
        )

        def step(admitted: list[int]) -> list[Generated]:
            with torch.inference_mode():
                return decoder.step(admitted)

        loop = asyncio.get_running_loop()
        while not decoder.done:
            if should_stop is not None and should_stop():
                return
            if should_drain is not None and should_drain():
                decoder.drain()
                if not decoder.in_flight:
                    return
            admitted = decoder.admit()
            for r in admitted:
                self._count(requests[r])
            for finished in await loop.run_in_executor(self._executor, step, admitted):
                yield finished

    async def score(self, request: ScoreRequest) -> ScoreResult:
        """One scoring request alone (a pack of one row, no padding). Raises ``ValueError`` as :meth:`score_many`."""
        return (await self.score_many([request]))[0]

    async def score_many(self, requests: Sequence[ScoreRequest]) -> list[ScoreResult]:
        """The requests as one right-padded pack on the engine thread (see ``score.score_pack``); results in order.

        Raises ``ValueError`` for ``max_tokens`` above 1 or an empty prompt that needs a forward pass.
        """
        for r in requests:
            self._count(r.generation)
        loaded = self.loaded

        def run() -> list[ScoreResult]:
            with torch.inference_mode():
                return score_pack(
                    loaded.model,
                    loaded.tokenizer,
                    requests,
                    pad_id=self.pad_id,
                    eos_ids=self.eos_ids,
                    max_positions=self.context_length or None,
                )

        return await asyncio.get_running_loop().run_in_executor(self._executor, run)

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

        def run() -> list[Vector]:
            with torch.inference_mode():
                return pool_pack(loaded.model, requests, pad_id=self.pad_id, num_layers=self.num_layers)

        return await asyncio.get_running_loop().run_in_executor(self._executor, run)

    async def call(self, fn: Callable[[LoadedModel], _T]) -> _T:
        """Run ``fn(loaded model)`` on the engine thread, after the work queued before it (weight edits, saves:
        never beside a forward pass); re-raises what ``fn`` raises."""
        loaded = self.loaded

        def run() -> _T:
            with torch.no_grad():
                return fn(loaded)

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

    def _batchable(self) -> bool:
        if self._can_batch is None:
            self._can_batch = batchable(self.loaded.model)
        return self._can_batch

    def _count(self, request: GenerationRequest | PoolRequest) -> None:
        if self._loaded is None:
            raise RuntimeError("the engine is closed")
        self.executions += 1
        if self.on_execute is not None:
            self.on_execute(request)

    def _deltas(self, request: GenerationRequest, should_stop: Callable[[], bool] | None = None) -> Any:
        loaded = self.loaded
        return generate_request(
            loaded.model,
            loaded.tokenizer,
            request,
            eos_ids=self.eos_ids,
            max_positions=self.context_length or None,
            should_stop=should_stop,
        )

    def _run_to_end(self, request: GenerationRequest, should_stop: Callable[[], bool]) -> GenerationResult:
        with torch.inference_mode():
            return collect_result(self._deltas(request, should_stop), request)

    async def _stream(self, request: GenerationRequest) -> AsyncIterator[StreamDelta]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        cancelled = threading.Event()

        def put(item: object) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                cancelled.set()

        def produce() -> None:
            try:
                with torch.inference_mode():
                    for delta in self._deltas(request, cancelled.is_set):
                        put(delta)
            except BaseException as exc:  # handed to the consumer, re-raised there
                put(exc)
            finally:
                put(_DONE)

        loop.run_in_executor(self._executor, produce)
        try:
            while (item := await queue.get()) is not _DONE:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            cancelled.set()


def _eos_ids(loaded: LoadedModel) -> frozenset[int]:
    """The tokenizer's EOS id plus the generation config's (an int or a list)."""
    ids: set[int] = set()
    if loaded.tokenizer.eos_token_id is not None:
        ids.add(int(loaded.tokenizer.eos_token_id))
    gen = getattr(loaded.model, "generation_config", None)
    extra = getattr(gen, "eos_token_id", None) if gen is not None else None
    if isinstance(extra, int):
        ids.add(extra)
    elif extra is not None:
        ids.update(int(i) for i in extra)
    return frozenset(ids)
