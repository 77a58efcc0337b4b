"""Prompt prefixes kept in the slot cache: which slot's first columns hold the keys and values of which prompt, so
that a new prompt starting with the same tokens (a chat template's system prompt, a batch file's shared instructions
and examples) copies those columns instead of computing them again. vLLM calls this automatic prefix caching;
llama.cpp's server reuses a slot's previous prompt the same way (``cache_prompt``).

A record is made by a prefill and covers the prompt's positions only (a decode step writes its columns with other
products, and the tokens generated after a prompt are not reused). It stays after the slot is released, until the
slot is prefilled again, and every record is dropped when the weights the prefill read change (:meth:`check_weights`)
or the owner says so (:meth:`forget`). The reuse is exact only where a prompt position's keys and values depend on
nothing but the tokens before it, computed row by row (``slots.SlotModel`` keeps records under its attention kernel
only).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

#: A prompt of a prefill waits for a second pass when a prompt of the first shares at least this many more leading
#: tokens with it than any slot holds (a second pass reads the weights again: about one decode step here).
SECOND_PASS_TOKENS = 16


def shared_length(held: torch.Tensor, ids: torch.Tensor, cap: int) -> int:
    """How many leading tokens ``held`` and ``ids`` (``[n]``, long) share, at most ``cap``."""
    m = min(cap, int(held.numel()), int(ids.numel()))
    if m <= 0:
        return 0
    same = held[:m] == ids[:m].to(held.device)
    return m if bool(same.all()) else int(torch.argmin(same.to(torch.int8)))


class PromptPrefixes:
    """The prompts whose keys and values the slots hold (see the module). ``reused`` counts the prompt tokens whose
    columns were copied rather than computed, ``computed`` those computed by a prefill."""

    def __init__(self) -> None:
        self._prompts: dict[int, torch.Tensor] = {}  # slot -> prompt ids [n] (long, CPU)
        self._weights: tuple[object, int, int] | None = None
        self.reused = 0
        self.computed = 0

    def check_weights(self, layers: object, table: torch.Tensor) -> None:
        """Drop every record unless the prefill reads the same ``layers`` object (``slot_weights.WeightCopies``
        makes a new one when a layer tensor changes) and the same embedding ``table`` at the same version."""
        stamp = (layers, table.data_ptr(), 0 if table.is_inference() else table._version)
        kept = self._weights
        if kept is None or kept[0] is not layers or kept[1:] != stamp[1:]:
            self._prompts.clear()
        self._weights = stamp

    def longest(self, ids: torch.Tensor, exclude: Collection[int]) -> tuple[int, int]:
        """``(slot, length)``: the slot (not in ``exclude``) whose record shares the longest prefix with the prompt
        ``ids`` (``[n]``, long), at most ``n - 1`` tokens (the last position is always computed, for its logits);
        ``(-1, 0)`` when none shares a token."""
        best = (-1, 0)
        cap = int(ids.numel()) - 1
        for slot, held in self._prompts.items():
            if slot in exclude or min(cap, int(held.numel())) <= best[1]:
                continue
            length = shared_length(held, ids, cap)
            if length > best[1]:
                best = (slot, length)
        return best

    def passes(self, slots: Sequence[int], prompts: Sequence[torch.Tensor]) -> list[list[int]]:
        """The prompts of one prefill (``prompts[i]`` into ``slots[i]``) as one or two passes of indices, in order.
        A prompt waits for the second pass when a prompt of the first shares :data:`SECOND_PASS_TOKENS` or more
        leading tokens with it beyond what any slot holds now: it then copies them from that prompt's slot instead
        of computing them again (eight chats with one system prompt, a batch's shared instructions). Which pass a
        prompt runs in never changes its bits: a copied prefix has the bits of a computed one."""
        first: list[int] = []
        second: list[int] = []
        for i, (slot, ids) in enumerate(zip(slots, prompts, strict=True)):
            held = self.longest(ids, exclude=set(slots) - {slot})[1]
            cap = int(ids.numel()) - 1
            inner = max((shared_length(prompts[j], ids, cap) for j in first), default=0)
            (second if inner - held >= SECOND_PASS_TOKENS else first).append(i)
        return [indices for indices in (first, second) if indices]

    def record(self, slot: int, ids: torch.Tensor, reused: int) -> None:
        """``slot`` now holds the prompt ``ids``, its first ``reused`` positions copied."""
        self._prompts[slot] = ids.detach().to("cpu", copy=True)
        self.reused += reused
        self.computed += int(ids.numel()) - reused

    def copy(self, src: int, dst: int, columns: int) -> None:
        """``dst`` got ``src``'s first ``columns`` columns (a fork): it holds ``src``'s prompt where that fits."""
        held = self._prompts.get(src)
        if held is not None and held.numel() <= columns:
            self._prompts[dst] = held
        else:
            self._prompts.pop(dst, None)

    def forget(self, slot: int | None = None) -> None:
        """Drop ``slot``'s record (its columns are about to be written), or every record (None)."""
        if slot is None:
            self._prompts.clear()
        else:
            self._prompts.pop(slot, None)
