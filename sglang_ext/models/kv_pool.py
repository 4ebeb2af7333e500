"""Slot-based KV cache owned by the engine (or by a drafter, for its own cache).

Every token's K/V lives in one slot of a per-layer pool; a request holds the list of its slots.
Tree verification writes draft nodes into fresh slots; accepting a path keeps those slots in
order (compaction by index, no copy) and frees the rest. Slot 0 is never handed out: padded
rows of a batch read it harmlessly.
"""

from __future__ import annotations

import torch


class OutOfSlots(RuntimeError):
    """The KV pool has fewer free slots than requested."""


class KVPool:
    def __init__(
        self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device="cpu"
    ):
        shape = (num_slots, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_slots = num_slots
        # free-slot stack: _free[:_top] are free
        self._free = torch.arange(num_slots - 1, 0, -1, dtype=torch.long)
        self._top = num_slots - 1

    @property
    def num_free(self) -> int:
        return self._top

    def alloc(self, n: int) -> torch.Tensor:
        if n > self._top:
            raise OutOfSlots(f"KV pool exhausted: need {n} slots, {self._top} free of {self.num_slots - 1}")
        self._top -= n
        return self._free[self._top : self._top + n].flip(0).clone()

    def free(self, slots: torch.Tensor) -> None:
        n = slots.numel()
        if n == 0:
            return
        if self._top + n > self.num_slots - 1:
            raise RuntimeError("KV pool double free")
        self._free[self._top : self._top + n] = slots.reshape(-1).flip(0)
        self._top += n

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer][slots] = k
        self.v[layer][slots] = v
