"""One step of the resident engine's step loop, on the engine thread: prefill the admitted, decode, sample, retire.

:class:`StepBatch` holds every sequence in flight, each in a slot of a KV cache (:class:`Slots`: transformers' own
cache in ``hf_cache.HFSlots``, or the static slot cache of the fast forward in ``slots.SlotModel``). The scheduler
(``scheduler.StepScheduler``, on the event loop) decides between steps which requests start and which leave; one
:meth:`StepBatch.step` then

1. releases the slots of the requests that leave (their client went away, their batch was cancelled);
2. starts each admitted request: its prompt is prefilled into one slot, exactly the one-request prefill (no padding;
   the prompts of the requests that may share go through one ``prefill_many`` of the cache, which gives each slot
   the bits of its prefill alone and reads the weights once; a batch-invariant request's prompt runs alone), is
   copied into one more slot per further sample (``n``), and each sequence samples its first token;
3. runs one decode step: every sequence of a request that may share (the default) in one forward pass, and each
   sequence of a batch-invariant request alone in its own (the single decode step: its result never depends on what
   else runs), or beside the others in that one pass where the cache gives each row the bits of its step alone
   (``Slots.independent_rows``: the slot forward under its attention kernel, checked per row count);
4. samples each sequence's next token with its own parameters and generator (:func:`advance`, the rules of
   ``generate.generate_sequence``) and retires the finished ones, freeing their slots.

It returns, per request touched, the deltas produced in the step and, once all its sequences are done, its result.
Everything here is synchronous and must run under ``torch.inference_mode`` on the engine's thread.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers import PreTrainedTokenizerBase

from miserver.engines.base import GenerationRequest, GenerationResult, SamplingParams, StreamDelta
from miserver.engines.local.detokenize import _Output
from miserver.engines.local.generate import collect_result, logprobs_of, sample
from miserver.engines.local.processors import Grammars, Processors, process, processors_for


class StepInterrupted(Exception):
    """A decode step given up part way because its ``stop()`` turned true (an interactive request arrived): no
    sequence of it advanced, and feeding the same tokens again gives the same result."""


class Slots(Protocol):
    """A KV cache of sequences addressed by slot number (see ``hf_cache.HFSlots``, ``slots.SlotModel``). ``decode``
    may raise :class:`StepInterrupted` once ``stop()`` is true (a cache that cannot stop part way ignores it);
    ``forget_prompts`` stops a cache from reusing the prompts its slots hold (after a weight write)."""

    def prefill(self, slot: int, ids: torch.Tensor) -> torch.Tensor: ...
    def prefill_many(self, slots: Sequence[int], prompts: Sequence[torch.Tensor]) -> list[torch.Tensor]: ...
    def decode(
        self, slots: Sequence[int], tokens: Sequence[int], stop: Callable[[], bool] | None = None
    ) -> torch.Tensor: ...
    def independent_rows(self, rows: int) -> bool: ...
    def fork(self, src: int, dst: int) -> None: ...
    def release(self, slot: int) -> None: ...
    def forget_prompts(self) -> None: ...


@dataclass
class Seq:
    """One sequence in flight: its request's ticket, its sample index, its slot, its sampling state and output.

    ``token`` is the last sampled token, fed at the next decode step; ``sampled`` counts tokens sampled; ``shared``
    turns true once a forward pass ran it beside another sequence; ``deltas`` are those of the current step, ``history``
    those before; ``proc`` its logits processors (bias, penalties, grammar), None when it has none.
    """

    ticket: int
    index: int
    slot: int
    params: SamplingParams
    generator: torch.Generator
    out: _Output
    limit: int
    alone: bool
    proc: Processors | None = None
    token: int = -1
    sampled: int = 0
    shared: bool = False
    done: bool = False
    deltas: list[StreamDelta] = field(default_factory=list)
    #: every delta of the sequence so far (its result is built from them)
    history: list[StreamDelta] = field(default_factory=list)


@dataclass(frozen=True)
class Start:
    """A request admitted at this step: its ticket number, the request, and whether it runs batch-invariant."""

    ticket: int
    request: GenerationRequest
    invariant: bool = False


@dataclass
class Update:
    """What a step did for one request: ``deltas`` produced in it (in order); ``result`` once the request is done
    (its :class:`GenerationResult`, or the ``ValueError`` refusing it); ``packed`` whether any of its sequences shared
    a forward pass; ``generated`` tokens generated in the step."""

    ticket: int
    deltas: list[StreamDelta] = field(default_factory=list)
    result: GenerationResult | ValueError | None = None
    packed: bool = False
    generated: int = 0


@dataclass(frozen=True)
class _Admitted:
    """A request given its slots at this step, before its prefill: its start, token ``limit``, each sequence's
    processors, its ``slots`` (one per sequence) and its prompt ``ids`` (``[prompt_len]``)."""

    start: Start
    limit: int
    procs: list[Processors | None]
    slots: list[int]
    ids: torch.Tensor


def advance(seq: Seq, logits: torch.Tensor, eos_ids: Collection[int], picked: int | None = None) -> bool:
    """Sample ``seq``'s next token from ``logits`` (float32 ``[vocab]``) and record it; True while the sequence goes
    on (its token must be fed), False once it finished: an end-of-sequence token or a stop string (``"stop"``), or
    its ``limit`` of tokens (``"length"``). The rules of ``generate.generate_sequence``, step for step. ``picked`` is
    the token already chosen for a greedy sequence without processors (the argmax of ``logits``, taken for a whole
    decode group at once: :func:`greedy_picks`)."""
    out = seq.out
    token = picked if picked is not None else sample(process(logits, seq.proc), seq.params, seq.generator)
    if token in eos_ids:
        out.end_token()
        seq.deltas.append(out.finish("stop"))
        return False
    logprob = None if seq.params.logprobs is None else logprobs_of(logits, token, seq.params.logprobs, out.texts)
    if seq.proc is not None:
        seq.proc.accept(token)
    out.add(token, logprob)
    if out.stop_at is not None:
        seq.deltas.append(out.finish("stop"))
        return False
    delta = out.pending()
    if delta is not None:
        seq.deltas.append(delta)
    seq.sampled += 1
    if seq.sampled >= seq.limit:
        seq.deltas.append(out.finish("length"))
        return False
    seq.token = token
    return True


def greedy_picks(group: Sequence[Seq], logits: torch.Tensor) -> list[int | None]:
    """Per row of ``logits`` (``[rows, vocab]``, one per sequence of ``group``) its argmax where the sequence samples
    greedily without processors (one tensor operation for the group), else None (sampled on its own)."""
    plain = [s.proc is None and s.params.temperature <= 0.0 for s in group]
    if not any(plain):
        return [None] * len(group)
    best = torch.argmax(logits, dim=-1).tolist()
    return [int(b) if p else None for b, p in zip(best, plain, strict=True)]


class StepBatch:
    """The sequences in flight over ``cache`` (see the module), in at most ``capacity`` slots (None: as many as the
    scheduler admits). ``max_positions`` is the context length (``limit = min(max_tokens, max_positions -
    prompt_len)``, as alone). ``grammars`` compiles the grammars of constrained requests (None: a request with a
    grammar is refused with ``ValueError``)."""

    def __init__(
        self,
        cache: Slots,
        tokenizer: PreTrainedTokenizerBase,
        device: torch.device,
        *,
        capacity: int | None = None,
        eos_ids: Collection[int] = (),
        max_positions: int | None = None,
        grammars: Grammars | None = None,
    ) -> None:
        self.cache = cache
        self.grammars = grammars
        self.tokenizer = tokenizer
        self.device = device
        self.capacity = capacity
        self.eos_ids = frozenset(eos_ids)
        self.max_positions = max_positions
        self.seqs: list[Seq] = []  # in flight, in start order
        self._free: list[int] = []
        self._next_slot = 0
        self._requests: dict[int, GenerationRequest] = {}
        self._all: dict[int, list[Seq]] = {}  # ticket -> its sequences, done or not

    def tickets(self) -> list[int]:
        """The requests in flight (started, not finished)."""
        return list(self._all)

    def step(
        self,
        starts: Sequence[Start],
        drops: Sequence[int],
        paused: Collection[int] = (),
        stop: Callable[[], bool] | None = None,
    ) -> list[Update]:
        """Drop the requests ``drops``, start ``starts``, run one decode step of every sequence in flight but those of
        the requests ``paused`` (they keep their slots and caches); an :class:`Update` per request touched. Once
        ``stop()`` is true the decode step is given up between two layers where the cache can (the scheduler's
        batch-only steps, when an interactive request arrives): its sequences decode nothing in this step, as if
        paused.

        Raises ``ValueError`` when the starts need more slots than ``capacity`` (the scheduler's contract)."""
        for ticket in drops:
            self._drop(ticket)
        in_use = sum(1 for s in self.seqs if not s.done)
        if self.capacity is not None and in_use + sum(s.request.n for s in starts) > self.capacity:
            raise ValueError("the admitted requests need more slots than the cache has")
        updates: dict[int, Update] = {}
        admitted = [a for a in (self._admit(start, updates) for start in starts) if a is not None]
        for a, logits in zip(admitted, self._prefill(admitted, updates), strict=True):
            if logits is not None:
                self._begin(a, logits)
        going = [s for s in self.seqs if not s.done and s.ticket not in paused]
        if going:
            self._decode(going, stop)
        for seq in self.seqs:
            if seq.deltas:
                u = updates.setdefault(seq.ticket, Update(seq.ticket))
                u.deltas += seq.deltas
                u.generated += sum(d.generated_tokens for d in seq.deltas)
                seq.history += seq.deltas
                seq.deltas = []
        self.seqs = [s for s in self.seqs if not s.done]
        for ticket in [t for t in self._all if all(s.done for s in self._all[t])]:
            seqs = self._all.pop(ticket)
            request = self._requests.pop(ticket)
            u = updates.setdefault(ticket, Update(ticket))
            u.result = collect_result([d for s in seqs for d in s.history], request)
            u.packed = any(s.shared for s in seqs)
        return list(updates.values())

    def warm(self, token: int) -> None:
        """Run one prefill and one decode step of the prompt ``[token]`` in a free slot, then forget it: the cache
        makes its weight copies now rather than at the first request (for the embedded model's quantized tiles, about
        1.3 s on a 2-core CPU). Raises ``ValueError`` while sequences are in flight (their slots are taken)."""
        if self._all:
            raise ValueError("warm the steps before any request starts")
        slot = self._take_slot()
        try:
            logits = self.cache.prefill(slot, torch.tensor([token], dtype=torch.long, device=self.device))
            self.cache.decode([slot], [int(torch.argmax(logits))])
        finally:
            self.cache.release(slot)
            self._free.append(slot)

    def reset(self) -> list[int]:
        """Drop everything in flight (after a failed step); the tickets dropped."""
        dropped = list(self._all)
        for ticket in dropped:
            self._drop(ticket)
        return dropped

    # --- pieces ----------------------------------------------------------------------------------------------------

    def _admit(self, start: Start, updates: dict[int, Update]) -> _Admitted | None:
        """Check ``start`` and give it its slots; None once ``updates`` holds its answer (nothing to run, refused)."""
        request = start.request
        params = request.params
        if params.max_tokens <= 0:
            deltas = [StreamDelta(i, "", finish_reason="length") for i in range(request.n)]
            updates[start.ticket] = Update(start.ticket, deltas, collect_result(deltas, request))
            return None
        if not request.prompt_ids:
            updates[start.ticket] = Update(start.ticket, result=ValueError("the prompt has no tokens"))
            return None
        limit = params.max_tokens
        if self.max_positions is not None:
            limit = max(0, min(limit, self.max_positions - len(request.prompt_ids)))
        try:
            procs = [processors_for(params, self.grammars, self.device) for _ in range(request.n)]
        except ValueError as exc:
            updates[start.ticket] = Update(start.ticket, result=exc)
            return None
        slots = [self._take_slot() for _ in range(request.n)]
        ids = torch.tensor(list(request.prompt_ids), dtype=torch.long, device=self.device)
        return _Admitted(start, limit, procs, slots, ids)

    def _prefill(self, admitted: list[_Admitted], updates: dict[int, Update]) -> list[torch.Tensor | None]:
        """Each admitted request's prompt prefilled into its first slot: the logits of its last position, or None
        once ``updates`` holds its refusal (its slots freed). The requests that may share go through one prefill of
        the cache (each slot's result is its prefill alone); a batch-invariant one runs alone; when a shared prefill
        refuses a prompt, each of its prompts runs alone, so the refusal is that prompt's only."""
        out: list[torch.Tensor | None] = [None] * len(admitted)
        shared = [i for i, a in enumerate(admitted) if not a.start.invariant]
        groups = [[i] for i, a in enumerate(admitted) if a.start.invariant]
        if len(shared) > 1:
            try:
                logits = self.cache.prefill_many(
                    [admitted[i].slots[0] for i in shared], [admitted[i].ids for i in shared]
                )
            except ValueError:
                groups += [[i] for i in shared]
            else:
                for i, row in zip(shared, logits, strict=True):
                    out[i] = row
        else:
            groups += [[i] for i in shared]
        for (i,) in groups:
            a = admitted[i]
            try:
                out[i] = self.cache.prefill(a.slots[0], a.ids)
            except ValueError as exc:
                self._free += a.slots
                updates[a.start.ticket] = Update(a.start.ticket, result=exc)
        return out

    def _begin(self, a: _Admitted, logits: torch.Tensor) -> None:
        """Start ``a``'s sequences from its prompt's ``logits``: the other samples' slots copy the first's cache, and
        each sequence samples its first token."""
        request, params = a.start.request, a.start.request.params
        for slot in a.slots[1:]:
            self.cache.fork(a.slots[0], slot)
        seqs = []
        for i, slot in enumerate(a.slots):
            generator = torch.Generator(device=self.device).manual_seed(params.seed + i)
            out = _Output(self.tokenizer, params.stop, i)
            seqs.append(Seq(a.start.ticket, i, slot, params, generator, out, a.limit, a.start.invariant, a.procs[i]))
        self._requests[a.start.ticket] = request
        self._all[a.start.ticket] = seqs
        for seq in seqs:
            self.seqs.append(seq)
            if a.limit == 0:
                seq.deltas.append(seq.out.finish("length"))
                self._retire(seq)
            elif not advance(seq, logits, self.eos_ids):
                self._retire(seq)

    def _decode(self, going: list[Seq], stop: Callable[[], bool] | None = None) -> None:
        """One decode step: the sequences that may share in one forward pass, and each invariant one alone (its bits
        are those of its step alone). ``Slots.independent_rows`` is not trusted here: on the AMD EPYC development
        machine SmolLM2's rows decoded together differed from their steps alone where that check passed."""
        shared = [s for s in going if not s.alone]
        groups = [[s] for s in going if s.alone]
        if shared:
            groups.insert(0, shared)
        for group in groups:
            try:
                logits = self.cache.decode([s.slot for s in group], [s.token for s in group], stop)
            except StepInterrupted:
                return  # this group and the rest decode at a later step
            if len(group) > 1:
                for seq in group:
                    seq.shared = seq.shared or not seq.alone
            for b, (seq, picked) in enumerate(zip(group, greedy_picks(group, logits), strict=True)):
                if not advance(seq, logits[b], self.eos_ids, picked):
                    self._retire(seq)

    def _take_slot(self) -> int:
        if self._free:
            return self._free.pop()
        self._next_slot += 1
        return self._next_slot - 1

    def _retire(self, seq: Seq) -> None:
        seq.done = True
        self.cache.release(seq.slot)
        self._free.append(seq.slot)

    def _drop(self, ticket: int) -> None:
        for seq in self._all.pop(ticket, []):
            if not seq.done:
                self._retire(seq)
        self._requests.pop(ticket, None)
        self.seqs = [s for s in self.seqs if not s.done]
