"""The slot forward's static KV cache: one preallocated keys tensor and one values tensor per layer, ``[slots,
kv_heads, capacity, head_dim]``, grown by doubling (copied once) when a slot number or a column goes past what it
holds, up to the context length. Slot ``s``'s sequence occupies columns ``0 .. length - 1`` of row ``s``; what a slot
holds is the caller's to track (``slots.SlotModel``)."""

from __future__ import annotations

import torch

#: Columns of a fresh cache (grown by doubling up to the context length).
INITIAL_CAPACITY = 256
#: Slots of a fresh cache (grown by doubling).
INITIAL_SLOTS = 4


class StaticKVCache:
    """``keys[i]`` and ``values[i]`` of layer ``i`` (see the module), ``dtype`` on ``device``, at most
    ``max_positions`` columns."""

    def __init__(
        self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device, max_positions: int
    ) -> None:
        self.kv_heads, self.head_dim, self.dtype, self.device = kv_heads, head_dim, dtype, device
        self.max_positions = max_positions
        self.slots, self.capacity = INITIAL_SLOTS, min(INITIAL_CAPACITY, max_positions)
        self.keys = [self._empty(self.slots, self.capacity) for _ in range(layers)]
        self.values = [self._empty(self.slots, self.capacity) for _ in range(layers)]

    def reserve(self, slot: int, columns: int) -> None:
        """Grow the cache (doubling) until it has row ``slot`` and ``columns`` columns (at most ``max_positions``)."""
        slots, capacity = self.slots, self.capacity
        while slot >= slots:
            slots *= 2
        while columns > capacity:
            capacity = min(capacity * 2, self.max_positions)
        if (slots, capacity) == (self.slots, self.capacity):
            return
        for cache in (self.keys, self.values):
            for i, old in enumerate(cache):
                new = self._empty(slots, capacity)
                new[: self.slots, :, : self.capacity].copy_(old)
                cache[i] = new
        self.slots, self.capacity = slots, capacity

    def copy(self, src: int, dst: int, columns: int) -> None:
        """Slot ``dst``'s first ``columns`` columns become ``src``'s, in every layer (``dst`` reserved already)."""
        for cache in (self.keys, self.values):
            for layer in cache:
                layer[dst, :, :columns].copy_(layer[src, :, :columns])

    def _empty(self, slots: int, capacity: int) -> torch.Tensor:
        return torch.zeros((slots, self.kv_heads, capacity, self.head_dim), dtype=self.dtype, device=self.device)
