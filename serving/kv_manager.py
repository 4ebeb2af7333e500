"""The KV manager: the target's KV pool and the prefix cache over it (nano-vllm's block manager, SGLang's
memory pool + radix cache). Every slot of the pool is free, the cache's, or one request's own.

Per request, the target KV holds every token except the last one (the root of the next tree):

    tokens:  p0 p1 p2 p3 | g0 g1 g2       (prompt | generated)
    slots:   s  s  s  s  | s  s  -        g2 is the root: the next verify forward computes its K/V

Prefix cache (serving/prefix_cache.py): a request's prompt is matched against the tokens earlier requests of its
tenant left in the cache (`match_prefix`); a hit of m tokens starts the request with the cache's slots for them
(locked while it runs) and prefills only prompt[m:]. While it runs, its prefilled chunks go into the cache
(`cache_unfinished_req`), so requests arriving meanwhile hit them; when it ends, its tokens whose K/V was computed
(the prompt and the accepted outputs: never a rejected draft's slots, which were freed at their verify) go in too
(`cache_finished_req`), and the drafter keeps or drops its own state of them (drafters/base.py). The pool's free
slots run out only after the cache's unlocked tokens are evicted, least recently used first (`evict`): the slots
the cache lets go pass the drafter's `drop_prefix` (`on_evict`) on their way back to the pool. Slot accounts:
free + cached + the requests' own == the pool (`accounts`).

Beside the cache, for drafters that read the target's captured layers, a hidden store: per captured layer, a row
for every slot of the pool, written with the slot's K/V at every forward (`store_hidden`), so that a hit's cached
tokens come with their captured rows (`cached_hidden`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from sglang_ext.device import to_device
from sglang_ext.models.kv_pool import zeroed_buffers
from sglang_ext.sampling import SamplingParams

from .prefix_cache import PrefixCache
from .request import CacheFlush, Request, SlotAccounts

log = logging.getLogger(__name__)


class KVManager:
    """The target's KV pool (`pool`) and, when on, the prefix cache over it (`cache`); on_evict(slots): what the
    drafter kept under slots the cache lets go is dropped (its drop_prefix; None: no drafter)."""

    def __init__(
        self,
        model,
        num_slots: int,
        prefix_cache: bool = False,
        cache_tokens: int | None = None,
        capture_layers: tuple[int, ...] = (),
        keep_hidden: bool = False,
        on_evict: Callable[[torch.Tensor], None] | None = None,
    ):
        self.model = model
        self.pool = model.new_kv_pool(num_slots)
        self.cache_tokens = cache_tokens
        self.cache = PrefixCache(cache_tokens) if prefix_cache else None
        self.on_evict = on_evict
        self.hidden = self._hidden_store(capture_layers) if keep_hidden and self.cache is not None else None

    def _hidden_store(self, layers: tuple[int, ...]) -> dict[int, torch.Tensor] | None:
        """Per captured layer, a row for every slot of the pool (drafters/base.py: cached_hidden)."""
        if not layers:
            return None
        m = self.model
        shape = (self.pool.num_slots, m.cfg.hidden_size)
        return dict(zip(layers, zeroed_buffers(len(layers), shape, m.dtype, m.device)))

    # --- slots ----------------------------------------------------------------------------------
    def alloc(self, n: int) -> torch.Tensor:
        """n slots of the pool, the prefix cache's least recently used unlocked tokens evicted when too few are free."""
        self.evict(n)
        return self.pool.alloc(n)

    def alloc_split(self, sizes: list[int]) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Slots for every tree of a step in one alloc (as alloc): (all [sum(sizes)] int64, one view per tree)."""
        self.evict(sum(sizes))
        return self.pool.alloc_split(sizes)

    def free(self, slots: torch.Tensor) -> None:
        self.pool.free(slots)

    def evict(self, n: int) -> None:
        """Evict the prefix cache's least recently used unlocked tokens until n slots are free (or none is left)."""
        short = n - self.pool.num_free
        if short > 0 and self.cache is not None:
            self._free_from_cache(self.cache.evict(short))

    def _free_from_cache(self, slots: torch.Tensor) -> None:
        """Slots the prefix cache let go (evicted, trimmed, flushed): the drafter drops what it kept under them, and
        they are free."""
        if not slots.numel():
            return
        if self.on_evict is not None:
            try:
                self.on_evict(slots)
            except Exception:  # noqa: BLE001 - kept drafter state only drafts: never worth failing a step
                log.exception("the drafter failed to drop its state of %d evicted prefix tokens", slots.numel())
        self.pool.free(slots)

    # --- the prefix cache -------------------------------------------------------------------------
    def cacheable(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """How much of a prompt may come from the prefix cache: all but its last token (whose logits give the first
        output token), none when the request asks for prompt logprobs (the cached tokens' logits are not kept)."""
        if self.cache is None or params.prompt_logprobs is not None:
            return 0
        return len(prompt_ids) - 1

    def peek(self, prompt_ids: list[int], params: SamplingParams, tenant: str = "") -> tuple[int, int]:
        """(prompt tokens a request would take from the prefix cache now, how many of those no running request
        uses): the KV room admitting it takes is its prompt + outputs less the first, plus the second."""
        n = self.cacheable(prompt_ids, params)
        return self.cache.peek(tenant, prompt_ids[:n]) if n else (0, 0)

    def match_prefix(self, r: Request) -> None:
        """Start the request on the longest cached prefix of its prompt (locked until it ends); again when its
        prefill starts (a request queued behind another with the same prompt then finds it cached)."""
        n = self.cacheable(r.prompt_ids, r.params)
        hit = self.cache.match(r.tenant, r.prompt_ids[:n]) if n else None
        if hit is None or hit.length <= r.shared:
            return
        self.cache.lock(hit.node)
        if r.cache_node is not None:
            self._free_from_cache(self.cache.unlock(r.cache_node))  # (a shorter hit: its slots are the cache's)
        r.slots, r.prefilled, r.cache_node = hit.slots.clone(), hit.length, hit.node
        r.cached_tokens = r.shared = hit.length

    def cache_unfinished_req(self, r: Request, end: int) -> None:
        """Put the request's tokens [0, end) (their K/V in its slots) into the prefix cache while it runs, so that
        requests arriving meanwhile hit them (after each prefilled chunk, and at its end): the cache takes the
        tokens it did not hold; tokens another request cached meanwhile switch to the cache's slots (the request's
        own copies freed: same tokens, same K/V). Its lock moves to the end of the path. A request whose path was
        flushed keeps its slots to itself."""
        cache = self.cache
        if cache is None or end <= r.shared or (r.cache_node is not None and r.cache_node.detached):
            return
        key = r.token_ids[:end]
        first = cache.insert(r.tenant, key, r.slots[:end])  # (>= shared: the path so far is the cache's, locked)
        path = cache.match(r.tenant, key)
        cache.lock(path.node)
        if r.cache_node is not None:
            cache.unlock(r.cache_node)  # (not detached: nothing freed)
        self.pool.free(r.slots[r.shared : first])
        r.slots = torch.cat([path.slots, r.slots[end:]])
        r.shared, r.cache_node = end, path.node

    def cache_finished_req(self, r: Request) -> torch.Tensor | None:
        """At the request's end, its computed tokens go into the prefix cache (slot i holds the K/V of
        token_ids[i]; slots past the tokens, drafts accepted after a stop, are not cached), unless it failed, and
        its lock goes. Returns, per token, its slot when the cache holds it, else -1: the drafter keeps its state
        of those under them (also where the cache took them from another request: that fills the state a request
        without any left, e.g. one drafted from its predicted output); None when its path was flushed (the cache
        holds none of them for good). What it still owns: slots[shared:] (free_req)."""
        cache = self.cache
        if cache is None:
            return None
        n = min(len(r.slots), len(r.token_ids))
        flushed = r.cache_node is not None and r.cache_node.detached
        if r.finish_reason != "error":
            self.cache_unfinished_req(r, n)
        taken = torch.full((n,), -1, dtype=torch.long)
        taken[: r.shared] = r.slots[: r.shared]
        node, r.cache_node = r.cache_node, None
        if node is not None:
            self._free_from_cache(cache.unlock(node))  # (a flushed path's slots, once its last user ends)
        return None if flushed else taken

    def free_req(self, r: Request) -> None:
        """The request's own slots (those the cache did not take) go back to the pool; the cache is trimmed to its
        cap."""
        self.pool.free(r.slots[r.shared :])
        r.slots = torch.empty(0, dtype=torch.long)
        if self.cache is not None:
            self._free_from_cache(self.cache.trim())

    def flush(self, requests: Sequence[Request]) -> CacheFlush:
        """Empty the prefix cache: tokens no request uses are freed now; those in use leave the cache (no request
        hits them again) and are freed when their last request ends."""
        if self.cache is None:
            return CacheFlush(0, 0, 0)
        flushed = self.cache.flush()
        self._free_from_cache(flushed.slots)
        users = sum(r.cache_node is not None for r in requests)
        return CacheFlush(flushed.slots.numel(), flushed.kept, users)

    def accounts(self, requests: Sequence[Request]) -> SlotAccounts:
        """Where every slot of the pool is (between steps)."""
        c = self.cache
        held = sum(len(r.slots) - r.shared for r in requests)
        cached, detached = (c.tokens, c.detached) if c is not None else (0, 0)
        return SlotAccounts(self.pool.num_slots - 1, self.pool.num_free, cached, detached, held)

    def rebuild_if_leaked(self) -> None:
        """With no request left and the cache flushed, every slot must be free; slots still held are a bug: the pool
        (and the cache, whose entries were the old pool's, and the drafter's state kept beside them) start anew."""
        leaked = self.pool.num_slots - 1 - self.pool.num_free
        if not leaked:
            return
        log.error("%d KV slots still held with no request left; the KV pool is rebuilt", leaked)
        self.pool = self.model.new_kv_pool(self.pool.num_slots)
        if self.cache is not None:
            self.cache = PrefixCache(self.cache_tokens)
            if self.on_evict is not None:
                self.on_evict(torch.arange(1, self.pool.num_slots))

    # --- the hidden store beside the cache --------------------------------------------------------
    def store_hidden(self, slots: list[torch.Tensor], captured: dict) -> None:
        """A forward's captured layers at their rows' slots (device ops)."""
        if self.hidden is None:
            return
        at = to_device(torch.cat(slots), self.model.device)
        for l, h in captured.items():
            self.hidden[l][at] = h

    def cached_hidden(self, r: Request):
        """cached_hidden(start) for a hit's drafter capture: the captured layers' rows of its cached tokens [start,
        m) from the hidden store, gathered on the device when the drafter asks (a drafter that kept its own state of
        them asks for few or none: gathering 1,500 rows of three layers costs ~10 ms on a CPU)."""
        store, slots = self.hidden, r.slots[: r.cached_tokens]
        if store is None or not r.cached_tokens:
            return None
        dev = self.model.device
        return lambda start: {l: rows[to_device(slots[start:], dev)] for l, rows in store.items()}
