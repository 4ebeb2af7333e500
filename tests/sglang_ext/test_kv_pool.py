"""The KV pool's free-slot stack: a step's slots for every tree in one alloc, its rejected slots back in one
free, the same slots as one alloc / free per request."""

import pytest
import torch

from sglang_ext.models.kv_pool import KVPool, OutOfSlots


def _pool(slots: int = 64) -> KVPool:
    return KVPool(1, slots, 1, 2, torch.float32)


def test_one_alloc_split_gives_the_slots_of_one_alloc_per_request():
    sizes = [3, 1, 0, 5, 2]
    one, each = _pool(), _pool()
    each.alloc(4)
    one.alloc(4)
    each.free(torch.tensor([3, 1]))  # a used stack: freed slots come back first
    one.free(torch.tensor([3, 1]))
    flat, parts = one.alloc_split(sizes)
    want = [each.alloc(n) for n in sizes]
    assert [p.tolist() for p in parts] == [w.tolist() for w in want]
    assert torch.equal(flat, torch.cat(want)) and one.num_free == each.num_free


def test_freed_slots_come_back_as_they_were_freed_and_one_free_equals_many():
    pool, many = _pool(), _pool()
    a = pool.alloc(6)
    many.alloc(6)
    assert a.tolist() == [1, 2, 3, 4, 5, 6]
    pool.free(a[[4, 1, 2]])
    for s in ([5], [2], [3]):  # the same slots, one free each
        many.free(torch.tensor(s))
    assert pool.alloc(3).tolist() == [5, 2, 3]  # (freed in this order, handed out in it)
    assert sorted(many.alloc(3).tolist()) == [2, 3, 5] and pool.num_free == many.num_free == 63 - 6
    held = pool.alloc(4)
    pool.free(held.view(2, 2))  # any shape
    assert pool.alloc(4).tolist() == held.tolist()
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(torch.arange(1, 61))
    with pytest.raises(OutOfSlots):
        pool.alloc(pool.num_free + 1)


def test_every_layers_rows_of_a_host_pool_in_one_index_op_are_the_layers_stacked():
    """stack_layer_kv (MoA's LSA input) reads a host pool's layers, which lie one after another in one storage, as
    one tensor: the same values as stacking them layer by layer, for slots of any shape; pools that are not laid
    out so (separate tensors) take the layer-by-layer path."""
    from sglang_ext.models.moa import _one_tensor, stack_layer_kv

    pool = KVPool(5, 40, 3, 8, torch.float32)
    g = torch.Generator().manual_seed(2)
    for t in pool.k + pool.v:
        t.copy_(torch.randn(t.shape, generator=g))
    assert _one_tensor([*pool.k, *pool.v]) is not None
    apart = ([t.clone() for t in pool.k], [t.clone() for t in pool.v])
    assert _one_tensor([*apart[0], *apart[1]]) is None
    for slots in (torch.tensor([5, 9, 2]), torch.tensor([[1, 2], [3, 4]]), torch.tensor(7)):
        k = torch.stack([t[slots] for t in pool.k], dim=-3)
        v = torch.stack([t[slots] for t in pool.v], dim=-3)
        want = torch.cat([k, v], dim=-1).flatten(-2)  # [*S, L, K|V per kv head]
        assert torch.equal(stack_layer_kv(pool.k, pool.v, slots), want)
        assert torch.equal(stack_layer_kv(*apart, slots), want)
