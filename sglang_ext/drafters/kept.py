"""A drafter's own per-token state kept beside the engine's prefix cache, under the target's slot of each token.

A drafter that computes K/V of its own over a request's verified tokens (EAGLE-3's draft layer, MoA's memory and
self-attention, the self-draft's layers) can keep it when the engine's prefix cache takes the request's tokens, and
hand it to a later request that hits those tokens instead of recomputing it:

    request ends; the cache holds its tokens   release_request(rid, taken)         ->  keep(keys, own slots)
    a hit on the first m tokens of a prompt    add_request(capture, cached=m)      ->  adopt(keys): the longest
                                                                                       kept run; the rest rebuilt
    the cache lets target slots go             drop_prefix(slots)                  ->  drop(keys): freed

Keys are target slots: the cache never holds one slot for two token histories, and it tells the drafter (drop)
before a slot it let go can be reused, so a key's state always belongs to the tokens the cache holds there. A
drafter keys each piece of state by the slot of the last token it depends on (EAGLE-3's pair (token s+1, feature
of token s) by token s+1's slot), so what a hit adopts depends only on tokens the hit matched.

A token may have no piece in some pool (MoA's memory exists for a request's latest tokens only): its slot there
is -1, kept, adopted and freed as "none".

Kept state holds at most `limit` tokens (half the drafter's pools by default): running requests always find room;
past it, the state of newly cached tokens is freed, and a hit on them rebuilds it.
"""

from __future__ import annotations

import torch

from ..models.kv_pool import KVPool

_EMPTY = torch.empty(0, dtype=torch.long)


class KeptState:
    """Per target slot, the drafter's own slot in each of `pools` (freed into them when dropped)."""

    def __init__(self, pools: tuple[KVPool, ...], limit: int | None = None):
        self.pools = pools
        self.limit = min(p.num_slots for p in pools) // 2 if limit is None else limit
        self._own: dict[int, tuple[int, ...]] = {}

    def __len__(self) -> int:
        return len(self._own)

    def keep(self, keys: torch.Tensor, own: list[torch.Tensor]) -> None:
        """keys [k]: target slots; own: per pool, the drafter slots [k] of the same tokens (-1: none), now kept
        (owned here). Past the limit (or for a key kept already) they are freed instead."""
        room = max(0, self.limit - len(self._own))
        rows = list(zip(keys.tolist(), *(o.tolist() for o in own)))
        drop = rows[room:]
        for key, *slots in rows[:room]:
            if key in self._own:
                drop.append((key, *slots))
            else:
                self._own[key] = tuple(slots)
        self._free([r[1:] for r in drop])

    def adopt(self, keys: torch.Tensor) -> list[torch.Tensor]:
        """Per pool, the kept slots (-1: none) of the longest leading run of keys that are all kept (still owned
        here: a request that adopts them reads them and never frees them)."""
        run = []
        for key in keys.tolist():
            slots = self._own.get(key)
            if slots is None:
                break
            run.append(slots)
        return [torch.tensor([r[i] for r in run], dtype=torch.long) for i in range(len(self.pools))]

    def drop(self, keys: torch.Tensor) -> None:
        """The target let these slots go: free what is kept under them."""
        self._free([self._own.pop(k) for k in keys.tolist() if k in self._own])

    def held(self, i: int) -> int:
        """Slots of pool i kept here."""
        return sum(slots[i] >= 0 for slots in self._own.values())

    def _free(self, rows: list[tuple[int, ...]]) -> None:
        for i, pool in enumerate(self.pools):
            free = [r[i] for r in rows if r[i] >= 0]
            if free:
                pool.free(torch.tensor(free, dtype=torch.long))


def keep_or_free(kept: KeptState, own: list[torch.Tensor], borrowed: int, keys: torch.Tensor) -> None:
    """A request's per-token drafter slots at its end (own: per pool of `kept`, in token order, -1: none; the first
    `borrowed` adopted, never its own): a token's pieces whose key (keys[i], i < len(keys)) is a target slot the
    cache holds (>= 0) are kept under it unless state is kept there already; the rest of its own are freed."""
    n = own[0].numel()
    keep = torch.zeros(n, dtype=torch.bool)
    m = min(n, keys.numel())
    keep[:m] = keys[:m] >= 0
    keep[:borrowed] = False
    idx = keep.nonzero().flatten()
    kept.keep(keys[idx], [o[idx] for o in own])
    free = torch.ones(n, dtype=torch.bool)
    free[:borrowed] = False
    free[idx] = False
    for o, pool in zip(own, kept.pools):
        o = o[free]
        pool.free(o[o >= 0])
