"""Slots over transformers' own KV cache: the step loop's cache for any model the fast slot forward does not cover.

A slot holds one sequence's keys and values. A slot decoded alone keeps its own ``DynamicCache`` and runs exactly the
single decode step of ``generate.decode_step`` (no mask, no position ids), so a sequence that never shares a forward
pass computes what the one-request path computes, bit for bit. Slots decoded together are merged into one
left-padded batch cache (``[rows, heads, T, head_dim]`` per layer, each row knowing its own number of real tokens);
the merge is kept from step to step and redone only when the set of slots decoded together changes (a sequence joins
or leaves), and columns that are padding in every row are cut, so ``T`` follows the longest row in flight.

Models whose cache is not plain per-layer key/value tensors (sliding-window or hybrid layers, see :func:`batchable`)
never merge: each slot of a step is decoded alone, one after another.

Everything here is synchronous and runs under ``torch.inference_mode`` on the engine's thread.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer

from miserver.engines.local.generate import cache_kwarg, decode_step, prefill


def batchable(model: PreTrainedModel) -> bool:
    """Whether ``model``'s KV cache is plain per-layer key/value tensors (``DynamicLayer``), which the batch cache
    can pad, concatenate and cut."""
    layers = getattr(DynamicCache(config=model.config), "layers", [])
    return all(type(layer) is DynamicLayer for layer in layers)


class HFSlots:
    """Slots of sequences over transformers' ``DynamicCache`` (see the module). ``max_positions`` is the context
    length (None: unbounded); a prefill or decode past it raises ``ValueError``."""

    def __init__(self, model: PreTrainedModel, *, max_positions: int | None = None) -> None:
        self.model = model
        self.max_positions = max_positions
        self.merges = batchable(model)
        #: slot -> (its own cache, real tokens in it), for slots not in the merged batch
        self._alone: dict[int, tuple[Cache, int]] = {}
        #: the merged batch: its slots in cache row order, their real tokens, and the cache (None when empty)
        self._rows: list[int] = []
        self._lengths: list[int] = []
        self._cache: Cache | None = None

    def length(self, slot: int) -> int:
        """Real tokens in ``slot``'s cache. Raises ``KeyError`` for a slot that holds nothing."""
        if slot in self._alone:
            return self._alone[slot][1]
        return self._lengths[self._rows.index(slot)]

    def prefill(self, slot: int, ids: torch.Tensor) -> torch.Tensor:
        """Run the prompt ``ids`` (``[prompt_len]``, long, ``prompt_len >= 1``) into ``slot`` (its old content is
        dropped); returns the float32 logits ``[vocab]`` of the last position. Raises ``ValueError`` for an empty
        prompt or one longer than ``max_positions``."""
        if ids.numel() == 0:
            raise ValueError("the prompt has no tokens")
        if self.max_positions is not None and ids.numel() > self.max_positions:
            raise ValueError(f"the prompt has {ids.numel()} tokens; the context holds {self.max_positions}")
        self.release(slot)
        logits, cache = prefill(self.model, ids)
        self._alone[slot] = (cache, int(ids.numel()))
        return logits

    def prefill_many(self, slots: Sequence[int], prompts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """:meth:`prefill` of ``prompts[i]`` into ``slots[i]``, one after the other (transformers' prefill alone)."""
        return [self.prefill(slot, ids) for slot, ids in zip(slots, prompts, strict=True)]

    def forget_prompts(self) -> None:
        """Nothing: this cache reuses no prompt."""

    def independent_rows(self, rows: int) -> bool:
        """False: transformers' forward over a left-padded batch gives a row other bits than its step alone."""
        return False

    def fork(self, src: int, dst: int) -> None:
        """``dst`` gets a copy of ``src``'s cache (the other samples of one prompt)."""
        self.release(dst)
        self._split([src])
        cache, length = self._alone[src]
        self._alone[dst] = (copy.deepcopy(cache), length)

    def release(self, slot: int) -> None:
        """Forget ``slot``'s cache (nothing happens for an empty slot)."""
        if self._alone.pop(slot, None) is not None or slot not in self._rows:
            return
        self._keep([b for b, s in enumerate(self._rows) if s != slot])

    def decode(
        self, slots: Sequence[int], tokens: Sequence[int], stop: Callable[[], bool] | None = None
    ) -> torch.Tensor:
        """Feed ``tokens[i]`` after ``slots[i]``'s cache, every slot at its own next position; returns float32 logits
        ``[len(slots), vocab]`` and each slot grows by one token. One slot, or a model that cannot merge, decodes
        alone (the single decode step); several are merged into one forward pass. Raises ``ValueError`` past
        ``max_positions``. ``stop`` is ignored: transformers' forward is not given up part way."""
        if self.max_positions is not None:
            for slot in slots:
                if self.length(slot) >= self.max_positions:
                    raise ValueError(f"slot {slot} is full: the context holds {self.max_positions} tokens")
        if len(slots) == 1 or not self.merges:
            self._split(list(slots))
            return torch.stack([self._decode_alone(s, t) for s, t in zip(slots, tokens, strict=True)])
        self._merge(list(slots))
        width = self._width()
        order = {s: b for b, s in enumerate(self._rows)}
        fed = [0] * len(self._rows)
        for slot, token in zip(slots, tokens, strict=True):
            fed[order[slot]] = token
        assert self._cache is not None
        logits = decode_batch(self.model, fed, self._lengths, width, self._cache)
        self._lengths = [n + 1 for n in self._lengths]
        index = torch.tensor([order[s] for s in slots], dtype=torch.long, device=logits.device)
        return logits.index_select(0, index)

    # --- pieces ----------------------------------------------------------------------------------------------------

    def _decode_alone(self, slot: int, token: int) -> torch.Tensor:
        cache, length = self._alone[slot]
        logits, cache = decode_step(self.model, token, cache)
        self._alone[slot] = (cache, length + 1)
        return logits

    def _width(self) -> int:
        return 0 if self._cache is None or not self._rows else int(_kv(_layers(self._cache)[0])[0].shape[-2])

    def _split(self, slots: list[int]) -> None:
        """Take ``slots`` out of the merged batch into caches of their own (padding cut)."""
        for slot in slots:
            if slot not in self._rows:
                continue
            b = self._rows.index(slot)
            length = self._lengths[b]
            assert self._cache is not None
            own = [
                (k[b : b + 1, :, k.shape[-2] - length :].clone(), v[b : b + 1, :, v.shape[-2] - length :].clone())
                for k, v in map(_kv, _layers(self._cache))
            ]
            self._alone[slot] = (DynamicCache(own), length)
            self._keep([i for i in range(len(self._rows)) if i != b])

    def _merge(self, slots: list[int]) -> None:
        """Make the merged batch hold exactly ``slots``: split out the others, stack the newcomers below."""
        wanted = set(slots)
        self._split([s for s in self._rows if s not in wanted])
        joining = [s for s in slots if s in self._alone]
        if not joining:
            return
        width = max([self._width(), *(self._alone[s][1] for s in joining)])
        parts: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        if self._cache is not None and self._rows:
            parts.append([_kv(layer) for layer in _layers(self._cache)])
        for slot in joining:
            cache, length = self._alone.pop(slot)
            parts.append([_kv(layer) for layer in _layers(cache)])
            self._rows.append(slot)
            self._lengths.append(length)
        layers = len(parts[0])
        merged = [
            (
                torch.cat([_pad_left(p[i][0], width) for p in parts]),
                torch.cat([_pad_left(p[i][1], width) for p in parts]),
            )
            for i in range(layers)
        ]
        self._cache = DynamicCache(merged)

    def _keep(self, keep: list[int]) -> None:
        """Keep only the merged rows ``keep`` (indices) and cut the columns that are padding in all of them."""
        self._rows = [self._rows[b] for b in keep]
        self._lengths = [self._lengths[b] for b in keep]
        if not keep or self._cache is None:
            self._cache, self._rows, self._lengths = None, [], []
            return
        cut = self._width() - max(self._lengths)
        index = torch.tensor(keep, dtype=torch.long, device=self.model.device)
        kept = [
            (k.index_select(0, index)[:, :, cut:].contiguous(), v.index_select(0, index)[:, :, cut:].contiguous())
            for k, v in map(_kv, _layers(self._cache))
        ]
        self._cache = DynamicCache(kept)


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


def _pad_left(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` (``[rows, heads, length, head_dim]``) with zero columns in front up to ``width``."""
    missing = width - t.shape[-2]
    if missing <= 0:
        return t
    return torch.cat([t.new_zeros((*t.shape[:2], missing, t.shape[-1])), t], dim=-2)
