"""The prefix cache's radix tree on its own (host bookkeeping: token ids -> slots): matches, splits, tenants, locks,
least-recently-used eviction, flushes under locks, and a random walk checked against a plain dict of every cached
prefix, with every slot accounted for after each operation."""

import random

import pytest
import torch

from serving.prefix_cache import PrefixCache


def _slots(*xs):
    return torch.tensor(xs, dtype=torch.long)


def test_longest_prefix_split_and_what_insert_takes():
    c = PrefixCache()
    assert c.insert("", [1, 2, 3, 4], _slots(10, 11, 12, 13)) == 0
    assert c.tokens == c.evictable == 4
    m = c.match("", [1, 2, 9])
    assert m.length == 2 and m.slots.tolist() == [10, 11]  # the node split after two tokens
    # a second sequence sharing two tokens: the tree keeps its own slots for them and takes the rest
    assert c.insert("", [1, 2, 7, 8], _slots(20, 21, 22, 23)) == 2
    assert c.tokens == 6 and c.match("", [1, 2, 7, 8, 5]).slots.tolist() == [10, 11, 22, 23]
    assert c.insert("", [1, 2], _slots(30, 31)) == 2 and c.tokens == 6  # all there already
    assert c.peek("", [1, 2, 3, 4, 5]) == (4, 4) and c.peek("", [5]) == (0, 0)


def test_tenants_never_share_a_prefix():
    c = PrefixCache()
    c.insert("", [1, 2, 3], _slots(1, 2, 3))
    c.insert("key-a", [1, 2, 3], _slots(4, 5, 6))
    assert c.match("key-b", [1, 2, 3]).length == 0 and c.peek("key-b", [1, 2, 3]) == (0, 0)
    assert c.match("key-a", [1, 2, 3]).slots.tolist() == [4, 5, 6]
    assert c.match("", [1, 2, 3]).slots.tolist() == [1, 2, 3]


def test_locked_paths_stay_and_unlocked_leaves_go_least_recently_used_first():
    c = PrefixCache()
    c.insert("", [1, 2, 3], _slots(1, 2, 3))  # oldest
    c.insert("", [4, 5], _slots(4, 5))
    c.insert("", [6], _slots(6))  # newest
    hit = c.match("", [1, 2, 3])  # now the most recent, and locked
    c.lock(hit.node)
    assert c.locked == 3 and c.evictable == 3 and c.peek("", [1, 2, 3, 9]) == (3, 0)
    assert c.evict(1).tolist() == [4, 5]  # whole nodes, least recently used first
    assert c.evict(100).tolist() == [6]  # never the locked path
    assert c.tokens == 3 and c.evictable == 0
    assert c.unlock(hit.node).numel() == 0 and c.evictable == 3
    assert c.evict(1).tolist() == [1, 2, 3] and c.tokens == 0


def test_a_parent_left_without_children_is_evicted_in_turn():
    c = PrefixCache()
    c.insert("", [1, 2, 3], _slots(1, 2, 3))
    c.insert("", [1, 2, 4], _slots(7, 8, 4))  # splits [1, 2] off: two leaves under it
    assert sorted(c.evict(3).tolist()) == [1, 2, 3, 4]
    assert c.tokens == 0 and c.match("", [1, 2]).length == 0


def test_flush_frees_what_no_request_uses_and_detaches_the_rest():
    c = PrefixCache()
    c.insert("", [1, 2, 3], _slots(1, 2, 3))
    c.insert("", [1, 2, 4, 5], _slots(9, 9, 4, 5))
    hit = c.match("", [1, 2, 4])
    c.lock(hit.node)
    flushed = c.flush()
    assert sorted(flushed.slots.tolist()) == [3, 5] and flushed.kept == 3  # [1, 2] and [4] are in use
    assert c.tokens == 0 and c.locked == 3 and c.match("", [1, 2, 4]).length == 0  # never matched again
    c.insert("", [1, 2], _slots(30, 31))  # the tree starts over beside the detached path
    assert sorted(c.unlock(hit.node).tolist()) == [1, 2, 4] and c.locked == 0
    assert c.match("", [1, 2]).slots.tolist() == [30, 31]


def test_size_cap_trims_least_recently_used():
    c = PrefixCache(max_tokens=4)
    c.insert("", [1, 2, 3], _slots(1, 2, 3))
    c.insert("", [5, 6, 7], _slots(5, 6, 7))
    assert c.trim().tolist() == [1, 2, 3] and c.tokens == 3
    with pytest.raises(ValueError, match="prefix cache size"):
        PrefixCache(max_tokens=-1)


@pytest.mark.parametrize("seed", range(6))
def test_random_walk_matches_a_plain_dict_of_cached_prefixes(seed):
    """Inserts of sequences sharing prefixes, matches with locks, unlocks, evictions, trims, flushes: after each
    operation every match is the longest prefix still cached with the slots it was cached at, and every slot ever
    handed to the cache is in the tree, detached, or was handed back, exactly once."""
    rng = random.Random(seed)
    c = PrefixCache(max_tokens=rng.choice([None, 40]))
    ref: dict[tuple, int] = {}  # (tenant, prefix) -> the slot of its last token, for every cached prefix
    slot_of: dict[int, tuple] = {}  # slot held by the tree -> its (tenant, prefix)
    given, returned, fresh = set(), [], iter(range(1, 10**6))
    locks = []  # (node, tenant, length) of the running "requests"

    def seq():
        return [rng.randrange(3) for _ in range(rng.randrange(1, 9))]

    def forget(slots):
        for s in slots.tolist():
            returned.append(s)
            if s in slot_of:
                del ref[slot_of.pop(s)]

    for _ in range(300):
        op = rng.random()
        tenant = rng.choice(["", "t"])
        if op < 0.4:
            key = seq()
            slots = torch.tensor([next(fresh) for _ in key])
            first = c.insert(tenant, key, slots)
            for i in range(len(key)):
                p = (tenant, tuple(key[: i + 1]))
                if i >= first:
                    assert p not in ref
                    ref[p] = int(slots[i])
                    slot_of[int(slots[i])] = p
                    given.add(int(slots[i]))
                else:
                    assert p in ref
            forget(c.trim())
        elif op < 0.65:
            key = seq()
            m = c.match(tenant, key)
            want = max((i for i in range(len(key) + 1) if i == 0 or (tenant, tuple(key[:i])) in ref), default=0)
            assert m.length == want == c.peek(tenant, key)[0]
            assert m.slots.tolist() == [ref[(tenant, tuple(key[: i + 1]))] for i in range(m.length)]
            if m.node is not None and rng.random() < 0.7:
                c.lock(m.node)
                locks.append(m.node)
        elif op < 0.85 and locks:
            forget(c.unlock(locks.pop(rng.randrange(len(locks)))))
        elif op < 0.97:
            forget(c.evict(rng.randrange(1, 10)))
        else:
            f = c.flush()
            forget(f.slots)
            for s in list(slot_of):  # detached: no longer matched, freed by their last unlock
                del ref[slot_of.pop(s)]
        assert len(returned) == len(set(returned)) and set(returned) <= given
        assert c.tokens == len(slot_of) and 0 <= c.evictable <= c.tokens
        assert c.tokens + c.detached + len(returned) == len(given)
    while locks:
        forget(c.unlock(locks.pop()))
    forget(c.flush().slots)
    assert sorted(returned) == sorted(given) and c.tokens == c.detached == c.locked == 0
