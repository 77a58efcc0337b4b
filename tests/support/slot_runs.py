"""Greedy runs through a step-loop cache (``slots.SlotModel`` or ``hf_cache.HFSlots``), for the slot-forward tests."""

from __future__ import annotations

import torch

from miserver.engines.local.hf_cache import HFSlots
from miserver.engines.local.loader import LoadedModel
from miserver.engines.local.slots import SlotModel


def ids_of(loaded: LoadedModel, text: str) -> torch.Tensor:
    """``text``'s token ids (``[n]``, long) under ``loaded``'s tokenizer."""
    return torch.tensor(loaded.tokenizer(text)["input_ids"], dtype=torch.long)


def greedy(cache: SlotModel | HFSlots, slot: int, ids: torch.Tensor, steps: int) -> tuple[list[int], torch.Tensor]:
    """``steps`` greedy tokens from ``ids`` in ``slot``; the tokens and the stacked logits ``[steps, vocab]``."""
    logits = cache.prefill(slot, ids)
    tokens, seen = [], []
    for _ in range(steps):
        seen.append(logits)
        tokens.append(int(torch.argmax(logits)))
        logits = cache.decode([slot], [tokens[-1]])[0]
    return tokens, torch.stack(seen)


def copy_cache(dst: SlotModel, src: SlotModel) -> None:
    """``dst``'s KV cache and lengths made ``src``'s (both built alike and filled alike), to compare one decode step
    of the two from the same cache."""
    for mine, theirs in ((dst._kv.keys, src._kv.keys), (dst._kv.values, src._kv.values)):
        for a, b in zip(mine, theirs, strict=True):
            a.copy_(b)
    dst._lengths = dict(src._lengths)
