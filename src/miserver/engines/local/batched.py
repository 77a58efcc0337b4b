"""Continuous batching of generation requests on the resident model: a padded batch KV cache, refilled as
sequences finish.

Everything here is synchronous and runs under ``torch.inference_mode`` on the engine's thread, one
:meth:`BatchDecoder.step` at a time; the caller decides between steps whether to go on (interactive first) and which
waiting requests start (:meth:`BatchDecoder.admit`, pure bookkeeping). Per step:

1. :func:`start` each admitted request: its prompt is prefilled *alone* (exactly the synchronous route's prefill, no
   padding) and the first token of each of its ``n`` sequences is sampled from those logits;
2. the survivors :func:`join` the batch: the batch cache is left-padded to a common length ``T`` (``[B, heads, T,
   head_dim]`` per layer), each row knowing its own number of real tokens;
3. :func:`decode_batch`: one forward pass for the whole batch (``[B, 1]`` tokens, a ``[B, T + 1]`` attention mask that
   hides each row's padding, each row's own position id), then every row samples its next token with its own
   parameters and generator (:func:`advance`, the same rules as ``generate.generate_sequence``);
4. finished rows :func:`leave` (their slots are free for the next step's admissions) and columns that are padding in
   every remaining row are cut, so ``T`` follows the longest row in flight, not the whole history.

A batch of one row with no padding runs exactly the single decode step (no mask, no position ids), so a sequence
that never shared a forward pass computes what the synchronous route computes, bit for bit.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import Cache, DynamicLayer

from miserver.engines.base import Generated, GenerationRequest, SamplingParams, StreamDelta
from miserver.engines.local.detokenize import _Output
from miserver.engines.local.generate import (
    cache_kwarg,
    collect_result,
    decode_step,
    logprobs_of,
    prefill,
    sample,
)


@dataclass
class Seq:
    """One sequence in flight: its request (index among the decoder's requests), its sampling state and output.

    ``token`` is the last sampled token, fed at the next decode step; ``sampled`` counts tokens sampled; ``shared``
    turns true once a forward pass ran it beside another sequence.
    """

    request: int
    index: int
    params: SamplingParams
    generator: torch.Generator
    out: _Output
    limit: int
    token: int = -1
    sampled: int = 0
    shared: bool = False
    deltas: list[StreamDelta] = field(default_factory=list)


def batchable(model: PreTrainedModel) -> bool:
    """Whether ``model``'s KV cache is plain per-layer key/value tensors (``DynamicLayer``), which the batch cache
    can pad, concatenate and cut; sliding-window or hybrid caches are not (their requests run one at a time)."""
    layers = getattr(DynamicCache(config=model.config), "layers", [])
    return all(type(layer) is DynamicLayer for layer in layers)


def advance(seq: Seq, logits: torch.Tensor, eos_ids: Collection[int]) -> bool:
    """Sample ``seq``'s next token from ``logits`` (float32 ``[vocab]``) and record it; True while the sequence goes
    on (its token must be fed), False once it finished: an end-of-sequence token or a stop string (``"stop"``), or
    its ``limit`` of tokens (``"length"``). The rules of ``generate.generate_sequence``, step for step."""
    out = seq.out
    token = sample(logits, seq.params, seq.generator)
    if token in eos_ids:
        out.end_token()
        seq.deltas.append(out.finish("stop"))
        return False
    logprob = None if seq.params.logprobs is None else logprobs_of(logits, token, seq.params.logprobs, out.texts)
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


class BatchDecoder:
    """Continuous batching over ``requests`` with at most ``slots`` sequences in flight (see the module).

    A request takes one slot per sequence (``n``); one wider than ``slots`` starts only when the batch is empty.
    ``max_positions`` is the context length (``limit = min(max_tokens, max_positions - prompt_len)``, as alone).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        requests: Sequence[GenerationRequest],
        *,
        slots: int,
        eos_ids: Collection[int] = (),
        max_positions: int | None = None,
    ) -> None:
        if slots < 1:
            raise ValueError("a batch decoder needs at least one slot")
        self.model = model
        self.tokenizer = tokenizer
        self.requests = list(requests)
        self.slots = slots
        self.eos_ids = frozenset(eos_ids)
        self.max_positions = max_positions
        self.waiting: deque[int] = deque(range(len(self.requests)))
        self.rows: list[Seq] = []  # the batch, in cache row order
        self.lengths: list[int] = []  # real tokens in the cache, per row
        self.cache: Cache | None = None
        self._left: dict[int, int] = {}  # request -> sequences not finished
        self._seqs: dict[int, list[Seq]] = {}

    @property
    def done(self) -> bool:
        """Nothing waits and nothing is in flight."""
        return not self.waiting and not self.rows

    @property
    def in_flight(self) -> list[int]:
        """Requests started and not finished (what an early stop leaves unrecorded)."""
        return sorted(self._left)

    def drain(self) -> list[int]:
        """Start no more requests: the waiting ones are given up (returned, never run); those in flight go on."""
        given_up = list(self.waiting)
        self.waiting.clear()
        return given_up

    def admit(self) -> list[int]:
        """The waiting requests that start at the next :meth:`step`, in order, while their sequences fit the free
        slots (pure bookkeeping: call it between steps, from any thread)."""
        free = self.slots - len(self.rows)
        started: list[int] = []
        while self.waiting:
            n = self.requests[self.waiting[0]].n
            if n > free and (self.rows or started):
                break
            started.append(self.waiting.popleft())
            free -= n
        return started

    def step(self, admitted: Sequence[int]) -> list[Generated]:
        """Start ``admitted`` (from :meth:`admit`), run one decode step for the batch; the requests now finished."""
        finished: list[Generated] = []
        for r in admitted:
            self._start(r, finished)
        if self.rows:
            self._decode(finished)
        return finished

    # --- pieces ----------------------------------------------------------------------------------------------------

    def _start(self, r: int, finished: list[Generated]) -> None:
        request = self.requests[r]
        params = request.params
        if params.max_tokens <= 0:
            deltas = [StreamDelta(i, "", finish_reason="length") for i in range(request.n)]
            finished.append(Generated(r, collect_result(deltas, request), False))
            return
        if not request.prompt_ids:
            finished.append(Generated(r, ValueError("the prompt has no tokens"), False))
            return
        device = self.model.device
        limit = params.max_tokens
        if self.max_positions is not None:
            limit = max(0, min(limit, self.max_positions - len(request.prompt_ids)))
        logits, cache = prefill(self.model, torch.tensor(list(request.prompt_ids), dtype=torch.long, device=device))
        seqs = []
        for i in range(request.n):
            generator = torch.Generator(device=device).manual_seed(params.seed + i)
            seqs.append(Seq(r, i, params, generator, _Output(self.tokenizer, params.stop, i), limit))
        self._seqs[r] = seqs
        self._left[r] = len(seqs)
        going = []
        for seq in seqs:
            if limit == 0:
                seq.deltas.append(seq.out.finish("length"))
            elif advance(seq, logits, self.eos_ids):
                going.append(seq)
                continue
            self._seq_done(seq, finished)
        if going:
            self._join(going, cache, len(request.prompt_ids))

    def _join(self, seqs: list[Seq], cache: Cache, length: int) -> None:
        """Add ``seqs`` (sequences of one prompt of ``length`` tokens, prefilled into ``cache``) to the batch."""
        if not self.rows and len(seqs) == 1:
            self.cache, self.rows, self.lengths = cache, list(seqs), [length]  # alone: the prefill's own cache
            return
        count = len(seqs)
        new = [(k.expand(count, -1, -1, -1), v.expand(count, -1, -1, -1)) for k, v in map(_kv, _layers(cache))]
        if self.cache is None or not self.rows:
            merged = [(k.contiguous(), v.contiguous()) for k, v in new]
        else:
            width = max(self.lengths_width(), length)
            old = [_kv(layer) for layer in _layers(self.cache)]
            merged = [
                (_stack(k0, k1, width), _stack(v0, v1, width)) for (k0, v0), (k1, v1) in zip(old, new, strict=True)
            ]
        self.rows += seqs
        self.lengths += [length] * len(seqs)
        self.cache = DynamicCache(merged)

    def lengths_width(self) -> int:
        """``T``: the batch cache's number of columns (0 when empty)."""
        return 0 if self.cache is None or not self.rows else int(_kv(_layers(self.cache)[0])[0].shape[-2])

    def _decode(self, finished: list[Generated]) -> None:
        """One forward pass for every row, then each row samples its next token; finished rows leave."""
        assert self.cache is not None
        batch = len(self.rows)
        width = self.lengths_width()
        if batch == 1 and self.lengths[0] == width:
            logits, self.cache = decode_step(self.model, self.rows[0].token, self.cache)
            rows_logits = logits.unsqueeze(0)
        else:
            rows_logits = decode_batch(self.model, [s.token for s in self.rows], self.lengths, width, self.cache)
            for seq in self.rows:
                seq.shared = True
        self.lengths = [n + 1 for n in self.lengths]
        keep = [b for b, seq in enumerate(self.rows) if advance(seq, rows_logits[b], self.eos_ids)]
        if len(keep) == batch:
            return
        for b, seq in enumerate(self.rows):
            if b not in keep:
                self._seq_done(seq, finished)
        self._leave(keep)

    def _leave(self, keep: list[int]) -> None:
        """Keep only the rows ``keep`` (indices into the batch) and cut the columns that are padding in all of them."""
        self.rows = [self.rows[b] for b in keep]
        self.lengths = [self.lengths[b] for b in keep]
        if not keep or self.cache is None:
            self.cache = None
            return
        width = self.lengths_width()
        cut = width - max(self.lengths)
        index = torch.tensor(keep, dtype=torch.long, device=self.model.device)
        kept = [
            (k.index_select(0, index)[:, :, cut:].contiguous(), v.index_select(0, index)[:, :, cut:].contiguous())
            for k, v in (_kv(layer) for layer in _layers(self.cache))
        ]
        self.cache = DynamicCache(kept)

    def _seq_done(self, seq: Seq, finished: list[Generated]) -> None:
        self._left[seq.request] -= 1
        if self._left[seq.request] > 0:
            return
        del self._left[seq.request]
        seqs = self._seqs.pop(seq.request)
        request = self.requests[seq.request]
        result = collect_result([d for s in seqs for d in s.deltas], request)
        finished.append(Generated(seq.request, result, any(s.shared for s in seqs)))


def decode_batch(
    model: PreTrainedModel, tokens: Sequence[int], lengths: Sequence[int], width: int, cache: Cache
) -> torch.Tensor:
    """Feed one token per row after a left-padded ``cache`` of ``width`` columns, row ``b`` holding ``lengths[b]``
    real tokens at its right end. Returns float32 logits ``[rows, vocab]``; the cache grows by one column."""
    device = model.device
    ids = torch.tensor([[t] for t in tokens], dtype=torch.long, device=device)
    real = torch.tensor(list(lengths), dtype=torch.long, device=device)
    columns = torch.arange(width + 1, device=device)
    mask = (columns.unsqueeze(0) >= (width - real).unsqueeze(1)).long()  # [rows, width + 1]: padding hidden
    positions = real.unsqueeze(1)  # each row's next position: its own count of real tokens
    out = model(
        input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **{cache_kwarg(type(model)): cache}
    )
    logits: torch.Tensor = out.logits[:, -1].float()
    return logits


def _layers(cache: Cache) -> list[DynamicLayer]:
    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer) is not DynamicLayer for layer in layers):
        raise ValueError("the batch cache needs plain per-layer key/value tensors (see batchable)")
    return list(layers)


def _kv(layer: DynamicLayer) -> tuple[torch.Tensor, torch.Tensor]:
    keys, values = layer.keys, layer.values
    assert keys is not None and values is not None
    return keys, values


def _stack(old: torch.Tensor, new: torch.Tensor, width: int) -> torch.Tensor:
    """The batch rows ``old`` above the rows ``new``, both left-padded to ``width`` columns."""
    return torch.cat([_pad_left(old, width), _pad_left(new, width)])


def _pad_left(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` (``[rows, heads, length, head_dim]``) with zero columns in front up to ``width``."""
    missing = width - t.shape[-2]
    if missing <= 0:
        return t
    return torch.cat([t.new_zeros((*t.shape[:2], missing, t.shape[-1])), t], dim=-2)
