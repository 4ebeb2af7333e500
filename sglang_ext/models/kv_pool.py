"""Slot-based KV cache owned by the engine (or by a drafter, for its own cache).

Every token's K/V lives in one slot of a per-layer pool; a request holds the list of its slots.
Tree verification writes draft nodes into fresh slots; accepting a path keeps those slots in
order (compaction by index, no copy) and frees the rest. Slot 0 is never handed out: padded
rows of a batch read it harmlessly.

Where: the pools live on the model's device; the free-slot stack is host bookkeeping (slot ids
are handed out and returned by the host, which knows every request's length). Moving K/V between
slots (`compact`) is a device op with its index tensors on the device.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..device import to_device


def zeroed_buffers(n: int, shape: tuple[int, ...], dtype: torch.dtype, device="cpu") -> list[torch.Tensor]:
    """n zero tensors of `shape` on `device`.
    NOTE: on the host the n share one allocation made by calloc (through numpy), whose pages the OS maps in,
    zeroed, on first touch: a pool costs memory and time for the slots it uses, not for all of them
    (torch.zeros writes every byte, ~0.3-0.5 s for SmolLM2's 16,384-slot pool on one core)."""
    device = torch.device(device)
    if device.type != "cpu" or n == 0:
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n)]
    size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    raw = np.zeros(n * size + 64, dtype=np.uint8)
    at = -raw.ctypes.data % 64  # cache-line aligned, as torch's own host allocations
    # one tensor per buffer over its own slice, detached: not a view to autograd, as torch.zeros' tensors are not
    # (a pool made under no_grad may be written in grad mode, e.g. a drafter's own pool in training)
    # (views of one tensor, so that a reader of every layer's rows gathers them in one index op: models/moa.py)
    whole = torch.from_numpy(raw[at : at + n * size]).view(dtype).view(n, *shape)
    return [whole[i].detach() for i in range(n)]


class OutOfSlots(RuntimeError):
    """The KV pool has fewer free slots than requested."""


class KVPool:
    def __init__(
        self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device="cpu"
    ):
        shape = (num_slots, num_kv_heads, head_dim)
        kv = zeroed_buffers(2 * num_layers, shape, dtype, device)
        self.k, self.v = kv[:num_layers], kv[num_layers:]
        self.num_slots = num_slots
        # free-slot stack, top first: _free[_head:] are free, _free[_head] is handed out next. Freed slots go
        # back on top in their order, so the next alloc of their count returns them as they were freed.
        self._free = torch.arange(1, num_slots, dtype=torch.long)
        self._head = 0

    @property
    def num_free(self) -> int:
        return self._free.numel() - self._head

    def alloc(self, n: int) -> torch.Tensor:
        """n free slots [n] int64 (host ids; two host ops whatever n)."""
        if n > self.num_free:
            raise OutOfSlots(f"KV pool exhausted: need {n} slots, {self.num_free} free of {self.num_slots - 1}")
        self._head += n
        return self._free[self._head - n : self._head].clone()

    def alloc_split(self, sizes: list[int]) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Slots for several owners at once: (all of them [sum(sizes)] int64, one view of it per size, in
        order). The same slots as one alloc per size in that order, in a fixed number of host ops."""
        flat = self.alloc(sum(sizes))
        return flat, flat.split(list(sizes))

    def free(self, slots: torch.Tensor) -> None:
        """Slots (any shape, int64 host ids) back on top of the stack."""
        n = slots.numel()
        if n == 0:
            return
        if n > self._head:
            raise RuntimeError("KV pool double free")
        self._head -= n
        self._free[self._head : self._head + n] = slots if slots.dim() == 1 else slots.reshape(-1)

    @property
    def device(self) -> torch.device:
        return self.k[0].device if self.k else torch.device("cpu")

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # NOTE: host slot ids index a device pool through a queued upload (indexing with them as they are
        # would copy them synchronously); callers that pass device slots skip even that
        slots = to_device(slots, self.k[layer].device)
        self.k[layer][slots] = k
        self.v[layer][slots] = v

    def compact(self, slots: torch.Tensor, nodes: torch.Tensor) -> None:
        """After a verify, on the device, every layer: the accepted path's K/V moves to the front of its
        tree's slots. slots [N]: the tree's slots in node order; nodes [N]: the path's node indices, root
        first, -1 after it (verify.AcceptedPath.nodes). Slot i then holds path node i's K/V (its position
        is seq_len + i, as RoPE wrote it), so the request keeps slots[:len(path)] and frees the rest once
        the path's length is on the host. Fixed shapes: entries past the path copy a slot onto itself."""
        slots, nodes = to_device(slots, self.device), to_device(nodes, self.device)
        src = torch.where(nodes >= 0, slots[nodes.clamp(min=0)], slots)
        for pool in self.k + self.v:
            pool[slots] = pool[src]  # the gather copies first: a slot both read and written is safe
