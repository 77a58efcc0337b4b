"""The engine protocol: typed requests in, typed results out. Engines know nothing of batches or HTTP.

A request carries token ids (the service applies the chat template and tokenises), sampling parameters already
validated, and a seed. Results carry token ids, decoded text and per-token logprobs.

Besides generation an engine answers prompt-only forward passes (DESIGN §3.4): scoring (:class:`ScoreRequest`: the
next token of a ``max_tokens`` 0/1 request and the prompt's own token logprobs) and pooled hidden states
(:class:`PoolRequest`: embeddings and probe features). Each comes alone (``score``, ``embed``: the synchronous
result) or as one right-padded pack of many (``score_many``, ``embed_many``: the packing capability).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import numpy as np

from miserver.scheduling.admission import Priority

FinishReason = Literal["stop", "length"]
Pooling = Literal["mean", "last"]


@dataclass(frozen=True)
class Grammar:
    """A constraint on a sequence's text, applied as a token mask at every step: ``json_schema`` (the text is one
    JSON value valid under ``schema``, a JSON Schema as compact JSON text) or ``json_object`` (any JSON object;
    ``schema`` empty). A constrained sequence ends ``"stop"`` only once its text is complete under the grammar;
    hitting ``max_tokens`` first ends it ``"length"`` (its text is then unfinished JSON)."""

    kind: Literal["json_schema", "json_object"]
    schema: str = ""


@dataclass(frozen=True)
class SamplingParams:
    """Sampling for one sequence.

    ``temperature`` 0 means greedy (argmax). ``top_p`` in (0, 1]. ``stop`` are strings: generation ends before the
    first occurrence and the string itself is not returned. ``logprobs`` is None (none wanted) or the number of top
    alternatives per position (0-20); the chosen token's logprob is always included when not None.
    ``seed`` seeds a private ``torch.Generator``: the same seed and prompt give the same output.
    ``top_k``, when set and positive, keeps only the ``top_k`` most likely tokens before ``top_p`` applies.

    Logits processors, applied in this order before sampling (the reported logprobs are those of the raw logits):
    ``logit_bias`` pairs (token id, bias) add the bias to that token's logit (OpenAI: -100 bans a token, 100 all but
    forces it); ``frequency_penalty`` and ``presence_penalty`` (OpenAI's formula) subtract ``count * frequency +
    (count > 0) * presence`` from each token's logit, ``count`` being how often the sequence has already sampled it;
    ``grammar`` masks every token that would leave the grammar (see :class:`Grammar`).
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int = 0
    logprobs: int | None = None
    top_k: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    grammar: Grammar | None = None

    @property
    def processed(self) -> bool:
        """True when a logits processor changes the logits before sampling (a bias, a penalty or a grammar)."""
        return (
            bool(self.logit_bias)
            or bool(self.frequency_penalty)
            or bool(self.presence_penalty)
            or (self.grammar is not None)
        )


@dataclass(frozen=True)
class GenerationRequest:
    """``n`` independent samples of a continuation of ``prompt_ids`` (shape ``[prompt_len]``).

    How an engine that schedules its own steps admits it: ``priority`` (interactive before batch, at every step);
    ``fairness_key`` (batch sequences take turns by key); ``invariant`` true runs each sequence alone at every step,
    so that its result never depends on what else runs (a batch row with ``pack: false``, a request sent with
    ``X-miLLM-Batch-Invariant: true``); false lets it share forward passes with other sequences. Engines that do not
    schedule steps (upstreams) ignore the three.
    """

    prompt_ids: tuple[int, ...]
    params: SamplingParams
    n: int = 1
    priority: Priority = Priority.INTERACTIVE
    fairness_key: str = ""
    invariant: bool = False


@dataclass(frozen=True)
class TokenLogprob:
    """One position: the chosen token, its natural-log probability, and the top alternatives (id, token, logprob).

    ``token`` (and each alternative's) is the token's own text: its vocabulary bytes decoded as UTF-8 where they are
    valid, else OpenAI's ``bytes:\\xNN...`` form (every byte escaped), so distinct tokens never share a ``token``.
    ``token_bytes`` is the token's share of the returned text's UTF-8 bytes: its own vocabulary bytes, empty for a
    special token (the text skips it), cut where a stop string begins inside the token (``token`` then renders the
    cut bytes). Joined over a sequence they rebuild the text exactly (unless generation ended inside a character).
    ``top_bytes`` are the alternatives' own vocabulary bytes, in ``top``'s order. ``text`` is the piece of decoded
    text this token completes: a token that holds only part of a character gets ``""`` and the token completing it
    the whole character, so the pieces of a sequence join to its text; None where not computed.
    """

    token_id: int
    token: str
    logprob: float
    top: tuple[tuple[int, str, float], ...] = ()
    token_bytes: bytes = b""
    top_bytes: tuple[bytes, ...] = ()
    text: str | None = None


@dataclass
class GeneratedSequence:
    """One generated sequence: text after stop-string trimming, with its finish reason.

    ``token_ids`` (and ``logprobs``, one per id) are the tokens the returned text comes from, including a token
    that a stop string cuts (its text begins before the stop string). ``generated_tokens`` counts every token the
    model generated for the sequence (usage ``completion_tokens``): those, plus the tokens that completed a stop
    string and an end-of-sequence token; None means ``len(token_ids)``.
    """

    index: int
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    logprobs: list[TokenLogprob] | None = None
    generated_tokens: int | None = None
    #: the stop string that ended the sequence (``finish_reason`` ``"stop"``); None for an end-of-sequence token
    stop_sequence: str | None = None

    @property
    def completion_tokens(self) -> int:
        """Tokens generated for this sequence (see ``generated_tokens``)."""
        return len(self.token_ids) if self.generated_tokens is None else self.generated_tokens


@dataclass
class GenerationResult:
    """All ``n`` sequences of a request; ``prompt_tokens`` counts the prompt once (OpenAI usage semantics)."""

    sequences: list[GeneratedSequence]
    prompt_tokens: int

    @property
    def completion_tokens(self) -> int:
        """Every token generated, over all sequences (usage ``completion_tokens``)."""
        return sum(s.completion_tokens for s in self.sequences)


@dataclass(frozen=True)
class StreamDelta:
    """A streamed piece of one sequence. ``finish_reason`` is set on the sequence's last delta.

    ``token_ids``/``logprobs`` are the tokens whose text this delta completes (as in :class:`GeneratedSequence`);
    ``generated_tokens`` the tokens generated since the sequence's previous delta (their sum over a sequence is its
    usage ``completion_tokens``; it also counts tokens that return no text: a stop string's, an end-of-sequence).
    """

    index: int
    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    generated_tokens: int = 0
    #: on the last delta: the stop string that ended the sequence, if one did
    stop_sequence: str | None = None


@dataclass(frozen=True)
class Generated:
    """One request of a :meth:`GeneratesMany.generate_many` call, finished: ``index`` is its position among the
    requests given, ``result`` what :meth:`Engine.generate` returns for it (or the ``ValueError`` it raises), and
    ``packed`` whether any of its sequences shared a forward pass with another sequence."""

    index: int
    result: GenerationResult | ValueError
    packed: bool


@dataclass(frozen=True)
class ScoreRequest:
    """A request answered by one forward pass over its prompt (DESIGN §3.4, scoring mode).

    ``generation.params.max_tokens`` must be 0 or 1. With 1, each of the ``n`` next tokens is chosen exactly as
    :meth:`Engine.generate` chooses it (sampling, seed ``seed + i``, EOS and stop strings, logprobs) from the logits of
    the prompt's last position. ``prompt_logprobs`` is None, or the number of top alternatives (0-20) to report at
    each prompt position; the first position has none (nothing precedes it).
    """

    generation: GenerationRequest
    prompt_logprobs: int | None = None

    @property
    def prompt_ids(self) -> tuple[int, ...]:
        return self.generation.prompt_ids


@dataclass
class ScoreResult:
    """``generation`` is what :meth:`Engine.generate` would return. When prompt logprobs were asked for,
    ``prompt_logprobs`` has one entry per prompt token (``None`` for the first) and ``prompt_tokens`` the piece of
    text each prompt token completes (:attr:`TokenLogprob.text`: they join to the prompt's text, special tokens
    skipped); otherwise both are None."""

    generation: GenerationResult
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_tokens: list[str] | None = None


@dataclass(frozen=True)
class PoolRequest:
    """Hidden states of ``prompt_ids`` (``[prompt_len]``, at least one id) pooled into one vector.

    ``layer`` indexes the hidden states as transformers lists them: 0 is the token embeddings, ``num_layers`` (or -1)
    the model's final, normed output. ``pooling`` ``mean`` averages over the input's own tokens, ``last`` takes its
    last token. ``normalize`` scales the vector to unit L2 norm (embeddings).
    """

    prompt_ids: tuple[int, ...]
    pooling: Pooling = "mean"
    layer: int = -1
    normalize: bool = False


#: A pooled vector: float32, shape ``[hidden_size]``.
Vector = np.ndarray


@dataclass(frozen=True)
class EngineInfo:
    """Provenance of the resident weights, copied into the ``X-miLLM-*`` headers, and the model's shape
    (``hidden_size`` and ``num_layers``, 0 when unknown)."""

    model_id: str
    backend: str
    dtype: str
    weights_revision: str
    context_length: int
    hidden_size: int = 0
    num_layers: int = 0


@runtime_checkable
class GeneratesMany(Protocol):
    """The batched-generation capability (continuous batching): many generation requests decode together."""

    def generate_many(
        self,
        requests: Sequence[GenerationRequest],
        *,
        slots: int,
        should_stop: Callable[[], bool] | None = None,
        should_drain: Callable[[], bool] | None = None,
    ) -> AsyncIterator[Generated]:
        """Run ``requests`` with up to ``slots`` sequences per forward pass, a finished sequence's slot going to the
        next waiting request; yield each request as soon as all its sequences are done (in no particular order).
        ``should_stop()`` is asked (on the caller's thread) before every decode step: once true the iterator ends
        and the requests in flight are not yielded (their work is dropped). Once ``should_drain()`` is true no
        waiting request starts; the iterator ends when those in flight are done (the rest are never yielded)."""
        ...


@runtime_checkable
class Constrains(Protocol):
    """The constrained-decoding capability: the engine honours :attr:`SamplingParams.grammar`."""

    #: the library that applies the grammar (provenance: ``X-miLLM-Grammar``)
    grammar_backend: str

    def check_grammar(self, grammar: Grammar) -> None:
        """Compile ``grammar`` (cached: the same grammar compiles once); raises ``ValueError`` with the reason when
        it cannot be compiled, ``NotImplementedError`` when the engine's grammar library is missing."""
        ...


@runtime_checkable
class Engine(Protocol):
    """What the services need from an engine."""

    info: EngineInfo

    @property
    def vocab_size(self) -> int:
        """Number of token ids the model accepts (ids are ``0 .. vocab_size - 1``)."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids (special tokens skipped)."""
        ...

    def tokenize_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Apply the model's chat template (with the generation prompt) and return token ids."""
        ...

    def tokenize(self, text: str) -> list[int]:
        """Token ids of plain text, with the tokenizer's BOS when the model uses one."""
        ...

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """Run the request to completion on the engine's thread."""
        ...

    def generate_stream(self, request: GenerationRequest) -> AsyncIterator[StreamDelta]:
        """Yield deltas as tokens are produced; the last delta of each sequence has its finish reason."""
        ...

    async def score(self, request: ScoreRequest) -> ScoreResult:
        """One scoring request, alone (no padding): the synchronous result."""
        ...

    async def score_many(self, requests: Sequence[ScoreRequest]) -> list[ScoreResult]:
        """The requests as one right-padded pack, each read at its own last real token; results in request order."""
        ...

    async def embed(self, request: PoolRequest) -> Vector:
        """One pooled vector, its input alone (no padding): the synchronous result."""
        ...

    async def embed_many(self, requests: Sequence[PoolRequest]) -> list[Vector]:
        """The inputs as one right-padded pack (one ``layer`` for all), each pooled over its own tokens."""
        ...

    async def close(self) -> None:
        """Release the engine's thread and memory."""
        ...
