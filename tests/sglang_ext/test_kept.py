"""A drafter's state kept beside the prefix cache (drafters/kept.py): keyed by target slots, adopted as a leading
run, dropped with the target's slots, bounded; a request's pieces kept or freed at its end."""

import torch

from sglang_ext.drafters.kept import KeptState, keep_or_free
from sglang_ext.models.kv_pool import KVPool


def _pool(n=64):
    return KVPool(1, n, 1, 4, torch.float32)


def _t(*xs):
    return torch.tensor(xs, dtype=torch.long)


def test_keep_adopt_leading_run_and_drop():
    a, b = _pool(), _pool()
    kept = KeptState((a, b))
    own_a, own_b = a.alloc(3), b.alloc(3)
    kept.keep(_t(10, 11, 12), [own_a, own_b])
    assert len(kept) == 3 and a.num_free == 60
    got = kept.adopt(_t(10, 11, 99, 12))  # stops at the first key kept nowhere
    assert got[0].tolist() == own_a[:2].tolist() and got[1].tolist() == own_b[:2].tolist()
    assert kept.adopt(_t(99, 10))[0].numel() == 0
    kept.drop(_t(11, 12, 50))  # (50: nothing kept there)
    assert len(kept) == 1 and a.num_free == b.num_free == 62


def test_the_limit_and_a_key_kept_twice_free_instead():
    pool = _pool()
    kept = KeptState((pool,), limit=2)
    kept.keep(_t(1, 2, 3), [pool.alloc(3)])  # the third past the limit: freed
    assert len(kept) == 2 and pool.num_free == 61
    kept.drop(_t(2))
    kept.keep(_t(1), [pool.alloc(1)])  # already kept under 1: freed
    assert len(kept) == 1 and pool.num_free == 62
    assert KeptState((_pool(64), _pool(32))).limit == 16  # half the smallest pool by default


def test_a_request_keeps_what_the_cache_holds_and_frees_the_rest():
    pool = _pool()
    kept = KeptState((pool,))
    borrowed = pool.alloc(2)  # adopted earlier (the kept state's, not the request's)
    kept.keep(_t(7, 8), [borrowed])
    mine = pool.alloc(4)
    slots = torch.cat([borrowed, mine])
    # tokens 0-1 adopted; the cache holds tokens 0-3 at target slots 7, 8, 9, 5; tokens 4-5 are past what it holds
    keep_or_free(kept, [slots], 2, _t(7, 8, 9, 5))
    assert kept.adopt(_t(7, 8, 9, 5))[0].tolist() == slots[:4].tolist()
    assert len(kept) == 4 and pool.num_free == 63 - 4  # tokens 4-5's pieces were freed


def test_a_token_without_a_piece_in_a_pool_is_kept_adopted_and_freed_as_none():
    mem, sa = _pool(), _pool()
    kept = KeptState((mem, sa))
    own_sa, own_mem = sa.alloc(4), mem.alloc(2)
    per_token_mem = torch.cat([_t(-1, -1), own_mem])  # tokens 0-1 have no memory
    # the cache holds tokens 0-2 (target slots 7, 8, 9); token 3 is past it: its pieces freed
    keep_or_free(kept, [per_token_mem, own_sa], 0, _t(7, 8, 9))
    assert len(kept) == 3 and (kept.held(0), kept.held(1)) == (1, 3)
    assert (mem.num_free, sa.num_free) == (62, 60)
    got = kept.adopt(_t(7, 8, 9, 4))
    assert got[0].tolist() == [-1, -1, own_mem[0].item()] and got[1].tolist() == own_sa[:3].tolist()
    kept.drop(_t(7, 9))
    assert (mem.num_free, sa.num_free, len(kept)) == (63, 62, 1)
