"""The engine's prefix cache: a radix tree over token ids -> the target KV pool's slots (RadixAttention), one tree
per tenant, so a request prefills only what no earlier request of its tenant has computed.

    tenant "":   root ── [system prompt: 1,500 tokens] ─┬─ [turn 1 of conversation A, its answer, turn 2 ...]
                                                        └─ [conversation B ...]
    tenant "k3": root ── [...]                            (another API key / cache_salt: never matched from "")

Each edge holds a run of tokens and the slots of their K/V (a node "owns" those slots: the engine frees what the
cache hands back). A token's K/V depends only on the tokens before it, so any request whose prompt starts with a
path of the tree can attend to that path's slots instead of recomputing them.

Locks: a running request that matched a prefix locks its path (a reference count on each node up to the root; a
locked node's ancestors are locked too). Unlocked tokens are `evictable`: when the pool needs room, unlocked leaves
go first, least recently used first (a node whose children all went becomes a leaf in turn). A flush frees every
unlocked node at once and detaches the locked ones from the tree (never matched again), to be freed by their last
user's unlock.

Host bookkeeping only: token ids, slot ids and counts; nothing here reads or writes the device.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

import torch

_EMPTY = torch.empty(0, dtype=torch.long)


class Node:
    """A run of tokens with their slots, under a parent node (None: a tenant's root, holding no tokens)."""

    __slots__ = ("parent", "children", "tokens", "slots", "lock", "last_use", "detached")

    def __init__(self, parent: Node | None, tokens: list[int], slots: torch.Tensor, last_use: int = 0):
        self.parent = parent
        self.children: dict[int, Node] = {}  # first token of the child's run -> child
        self.tokens = tokens
        self.slots = slots  # [len(tokens)] int64, host
        self.lock = 0  # running requests whose matched path runs through this node
        self.last_use = last_use
        self.detached = False  # flushed while locked: out of the tree, freed by the last unlock


@dataclass(frozen=True)
class Match:
    """The longest cached prefix of a key: its length, its slots (the cache's), and the node it ends at (to lock)."""

    length: int
    slots: torch.Tensor  # [length] int64
    node: Node | None  # None when nothing matched


@dataclass(frozen=True)
class Flushed:
    """What a flush did: the slots it freed now (the caller returns them to the pool), and the tokens running
    requests still use (freed when the last of them ends)."""

    slots: torch.Tensor
    kept: int


def _common(a: list[int], b: list[int], start: int) -> int:
    """Length of the common prefix of a and b[start:]."""
    n = min(len(a), len(b) - start)
    i = 0
    while i < n and a[i] == b[start + i]:
        i += 1
    return i


class PrefixCache:
    """max_tokens: the most tokens kept (None: as many as the pool has room for); over it, `trim` evicts."""

    def __init__(self, max_tokens: int | None = None):
        if max_tokens is not None and max_tokens < 0:
            raise ValueError(f"the prefix cache size must be >= 0 tokens, got {max_tokens}")
        self.max_tokens = max_tokens
        self._roots: dict[str, Node] = {}
        self._tenant_of: dict[int, str] = {}  # id(root) -> its tenant
        self._clock = itertools.count(1)
        self.tokens = 0  # tokens in the trees
        self.evictable = 0  # of those, tokens no running request uses
        self.detached = 0  # tokens flushed while in use, freed by their last user

    @property
    def locked(self) -> int:
        """Slots the cache holds that eviction cannot free now (in the trees, or detached)."""
        return self.tokens - self.evictable + self.detached

    # --- lookups ------------------------------------------------------------------------------
    def peek(self, tenant: str, key: list[int]) -> tuple[int, int]:
        """(length of the longest cached prefix of key, how many of those tokens no running request has locked):
        what locking that prefix would take from the evictable room. Changes nothing."""
        node, i, unlocked = self._roots.get(tenant), 0, 0
        while node is not None and i < len(key):
            child = node.children.get(key[i])
            if child is None:
                break
            k = _common(child.tokens, key, i)
            unlocked += k if child.lock == 0 else 0
            i += k
            node = child if k == len(child.tokens) else None
        return i, unlocked

    def match(self, tenant: str, key: list[int]) -> Match:
        """The longest cached prefix of key (a node split where the prefix ends inside one, so that it ends at a
        node), its path marked as just used."""
        node = self._roots.get(tenant)
        if node is None:
            return Match(0, _EMPTY, None)
        parts, i, now = [], 0, next(self._clock)
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                break
            k = _common(child.tokens, key, i)
            if k < len(child.tokens):
                child = self._split(child, k)
            child.last_use = now
            parts.append(child.slots)
            node, i = child, i + k
        if i == 0:
            return Match(0, _EMPTY, None)
        return Match(i, torch.cat(parts), node)

    def _split(self, node: Node, k: int) -> Node:
        """Split node after its k-th token: a new parent holds the first k tokens; returns it."""
        top = Node(node.parent, node.tokens[:k], node.slots[:k], node.last_use)
        top.lock, top.detached = node.lock, node.detached
        top.children[node.tokens[k]] = node
        node.parent.children[node.tokens[0]] = top
        node.parent, node.tokens, node.slots = top, node.tokens[k:], node.slots[k:]
        return top

    # --- locks --------------------------------------------------------------------------------
    def lock(self, node: Node) -> None:
        """A running request uses the path from the root to node."""
        while node is not None:
            if node.lock == 0 and not node.detached and node.parent is not None:
                self.evictable -= len(node.tokens)
            node.lock += 1
            node = node.parent

    def unlock(self, node: Node) -> torch.Tensor:
        """The request that locked node's path ended; returns the slots of detached nodes it was the last user of
        (the caller frees them)."""
        freed = []
        while node is not None:
            node.lock -= 1
            if node.lock == 0 and node.parent is not None:
                if node.detached:
                    freed.append(node.slots)
                    self.detached -= len(node.tokens)
                else:
                    self.evictable += len(node.tokens)
            node = node.parent
        return torch.cat(freed) if freed else _EMPTY

    # --- insert -------------------------------------------------------------------------------
    def insert(self, tenant: str, key: list[int], slots: torch.Tensor) -> int:
        """Cache key's tokens at `slots` ([len(key)]): the tree takes the slots of the tokens past what it already
        holds; returns how many leading tokens it already held (their `slots` stay the caller's to free, unless
        they are the cache's own, matched earlier)."""
        if not key:
            return 0
        node = self._roots.get(tenant)
        if node is None:
            node = self._roots[tenant] = Node(None, [], _EMPTY)
            self._tenant_of[id(node)] = tenant
        i, now = 0, next(self._clock)
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                leaf = Node(node, list(key[i:]), slots[i:].clone(), now)
                node.children[key[i]] = leaf
                self.tokens += len(leaf.tokens)
                self.evictable += len(leaf.tokens)
                return i
            k = _common(child.tokens, key, i)
            child.last_use = now
            if k < len(child.tokens):
                if i + k == len(key):  # key ends inside the node: nothing to add
                    return i + k
                child = self._split(child, k)
            node, i = child, i + k
        return i

    # --- eviction -----------------------------------------------------------------------------
    def evict(self, n: int) -> torch.Tensor:
        """Free at least n tokens if that many are evictable (unlocked leaves, least recently used first; whole
        nodes); returns their slots."""
        if n <= 0 or not self.evictable:
            return _EMPTY
        heap = [(leaf.last_use, id(leaf), leaf) for leaf in self._leaves() if leaf.lock == 0]
        heapq.heapify(heap)
        freed, count = [], 0
        while heap and count < n:
            _, _, leaf = heapq.heappop(heap)
            freed.append(leaf.slots)
            count += len(leaf.tokens)
            parent = self._remove(leaf)
            if parent.parent is not None and not parent.children and parent.lock == 0:
                heapq.heappush(heap, (parent.last_use, id(parent), parent))
        return torch.cat(freed) if freed else _EMPTY

    def trim(self) -> torch.Tensor:
        """Evict down to max_tokens (what locks allow); the freed slots."""
        if self.max_tokens is None or self.tokens <= self.max_tokens:
            return _EMPTY
        return self.evict(self.tokens - self.max_tokens)

    def _leaves(self):
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node.parent is not None:
                yield node

    def _remove(self, leaf: Node) -> Node:
        """Take an unlocked leaf out of its tree (a tenant's root left empty goes too); returns its parent."""
        parent = leaf.parent
        del parent.children[leaf.tokens[0]]
        self.tokens -= len(leaf.tokens)
        self.evictable -= len(leaf.tokens)
        if parent.parent is None and not parent.children:  # (a tenant with nothing cached keeps no root)
            del self._roots[self._tenant_of.pop(id(parent))]
        return parent

    def flush(self) -> Flushed:
        """Empty the cache: unlocked nodes are freed now; locked ones leave the tree (no request matches them
        again) and are freed when their last user ends."""
        freed, kept = [], 0
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            if node.lock == 0:
                freed.append(node.slots)
            else:
                node.detached = True
                kept += len(node.tokens)
            stack.extend(node.children.values())
        self._roots, self._tenant_of = {}, {}
        self.tokens = self.evictable = 0
        self.detached += kept
        return Flushed(torch.cat(freed) if freed else _EMPTY, kept)
