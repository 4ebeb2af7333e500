"""The AVX2 tree-attention kernel (sglang_ext/kernels/cpu_attention.cpp) behind the "cpu" backend:
against the torch reference, row-by-row bit invariance, its fallbacks and its input checks."""

import pytest
import torch
from test_attention import random_pools, random_tree_batch

from sglang_ext import kernels
from sglang_ext.attention import (
    causal_mask,
    plan_attention,
    prefix_and_tree_mask,
    select_backend,
    tree_attention_cpu,
    tree_attention_torch,
)
from sglang_ext.attention.cpu import MAX_Q, uses_attention_kernel

needs_kernel = pytest.mark.skipif(not kernels.AVAILABLE, reason=f"kernel unavailable: {kernels.UNAVAILABLE}")
HQ, HKV = 9, 3


def _batch(prefixes, sizes, head_dim, seed):
    gen = torch.Generator().manual_seed(seed)
    num_slots = sum(prefixes) + sum(sizes) + 11
    requests = random_tree_batch(prefixes, sizes, num_slots, gen)
    plan = plan_attention([r[0] for r in requests], [r[1] for r in requests])
    k_pool, v_pool = random_pools(num_slots, HKV, head_dim, gen)
    q = torch.randn(plan.num_queries, HQ, head_dim, generator=gen)
    return requests, plan, q, k_pool, v_pool


def test_cpu_is_the_default_backend_on_cpu():
    assert select_backend("cpu") is tree_attention_cpu
    assert select_backend("cpu", "torch") is tree_attention_torch
    with pytest.raises(ValueError, match="choose auto, cpu, torch or triton"):
        select_backend("cpu", "nope")


@needs_kernel
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(
    "prefixes,sizes",
    [
        ([0], [1]),
        ([399], [1]),
        ([400], [6]),
        ([5, 37, 70, 0], [7, 16, 1, 33]),
        ([3, 250], [64, 9]),
        ([1, 2, 3, 4, 5, 6, 7, 8, 9], [1] * 9),
    ],
)
def test_kernel_matches_torch_reference(prefixes, sizes, head_dim):
    _, plan, q, k_pool, v_pool = _batch(prefixes, sizes, head_dim, seed=sum(prefixes) + head_dim)
    assert uses_attention_kernel(q, k_pool, v_pool, plan)
    got = tree_attention_cpu(q, k_pool, v_pool, plan, head_dim**-0.5)
    ref = tree_attention_torch(q.double(), k_pool.double(), v_pool.double(), plan, head_dim**-0.5)
    assert got.shape == q.shape and got.dtype == torch.float32
    assert (got.double() - ref).abs().max() < 2e-6


@needs_kernel
def test_a_tree_row_is_bit_identical_to_the_same_row_decoded_alone():
    """Node j of a verify tree, in a batch with other requests, equals a one-query decode over
    prefix + j's path: the engine's greedy identity (spec == vanilla) relies on this."""
    requests, plan, q, k_pool, v_pool = _batch([37, 5, 120], [9, 3, 17], 64, seed=3)
    out = tree_attention_cpu(q, k_pool, v_pool, plan, 0.125)
    row = 0
    for slots, mask, _ in requests:
        for j in range(mask.shape[0]):
            seen = slots[mask[j]]  # prefix then the node's ancestors, in kv order
            alone = plan_attention([seen], [torch.ones(1, seen.numel(), dtype=torch.bool)])
            assert torch.equal(tree_attention_cpu(q[row : row + 1], k_pool, v_pool, alone, 0.125)[0], out[row]), (
                row,
                j,
            )
            row += 1
    # and the whole request alone equals its rows in the batch
    slots, mask, _ = requests[2]
    alone = tree_attention_cpu(q[-17:], k_pool, v_pool, plan_attention([slots], [mask]), 0.125)
    assert torch.equal(alone, out[-17:])


@needs_kernel
def test_a_prompt_block_next_to_trees_is_split_between_kernel_and_torch():
    """A prompt prefilled in the same forward as other requests' trees: the trees' rows go through
    the kernel exactly as without the prompt (bit-identical), the prompt's through torch."""
    requests, plan, q, k_pool, v_pool = _batch([37, 0, 120, 0], [9, MAX_Q + 30, 4, MAX_Q + 1], 64, seed=11)
    split = plan.split_by_queries(MAX_Q)
    assert split is not None and split.long_rows.numel() == 2 * MAX_Q + 31
    assert plan.split_by_queries(MAX_Q) is split  # planned once per forward, not once per layer
    out = tree_attention_cpu(q, k_pool, v_pool, plan, 0.125)
    ref = tree_attention_torch(q.double(), k_pool.double(), v_pool.double(), plan, 0.125)
    assert (out.double() - ref).abs().max() < 2e-6
    trees = [requests[0], requests[2]]
    rows = torch.cat([torch.arange(int(plan.qo_indptr[b]), int(plan.qo_indptr[b + 1])) for b in (0, 2)])
    without_prompt = plan_attention([r[0] for r in trees], [r[1] for r in trees])
    assert torch.equal(out[rows], tree_attention_cpu(q[rows], k_pool, v_pool, without_prompt, 0.125))
    assert (
        plan_attention([r[0] for r in trees], [r[1] for r in trees]).split_by_queries(MAX_Q) is None
    )  # nothing to split


@needs_kernel
def test_a_row_that_sees_nothing_gives_zeros_not_nan():
    gen = torch.Generator().manual_seed(0)
    k_pool, v_pool = random_pools(20, HKV, 64, gen)
    mask = torch.tensor([[True, True, False], [False, False, False]])
    plan = plan_attention([torch.tensor([3, 4, 5])], [mask])
    out = tree_attention_cpu(torch.randn(2, HQ, 64, generator=gen), k_pool, v_pool, plan, 0.125)
    assert torch.isfinite(out).all() and torch.equal(out[1], torch.zeros(HQ, 64))


def test_outside_the_kernel_the_torch_reference_answers():
    gen = torch.Generator().manual_seed(1)
    k_pool, v_pool = random_pools(600, HKV, 64, gen)
    long_plan = plan_attention([torch.arange(1, MAX_Q + 11)], [causal_mask(MAX_Q + 10, 0)])  # prefill
    q = torch.randn(MAX_Q + 10, HQ, 64, generator=gen)
    assert not uses_attention_kernel(q, k_pool, v_pool, long_plan)
    assert torch.equal(
        tree_attention_cpu(q, k_pool, v_pool, long_plan, 0.125),
        tree_attention_torch(q, k_pool, v_pool, long_plan, 0.125),
    )
    plan = plan_attention([torch.arange(1, 30)], [prefix_and_tree_mask(torch.ones(1, 1, dtype=torch.bool), 28)])
    q1 = torch.randn(1, HQ, 64, generator=gen)
    assert not uses_attention_kernel(q1.bfloat16(), k_pool.bfloat16(), v_pool.bfloat16(), plan)
    k80, v80 = random_pools(600, HKV, 80, gen)
    assert not uses_attention_kernel(torch.randn(1, HQ, 80), k80, v80, plan)
    qg = q1.clone().requires_grad_()
    assert not uses_attention_kernel(qg, k_pool, v_pool, plan)
    tree_attention_cpu(qg, k_pool, v_pool, plan, 0.125).sum().backward()  # autograd goes through torch
    assert qg.grad is not None and torch.isfinite(qg.grad).all()


@needs_kernel
def test_kernel_rejects_bad_input():
    op = torch.ops.moa_cpu.tree_attention
    k_pool, v_pool = torch.randn(10, HKV, 64), torch.randn(10, HKV, 64)
    q = torch.randn(2, HQ, 64)
    qo, kvp, idx, mask = (
        torch.tensor([0, 2]),
        torch.tensor([0, 3]),
        torch.tensor([1, 2, 3]),
        torch.ones(6, dtype=torch.bool),
    )
    op(q, k_pool, v_pool, qo, kvp, idx, mask, 0.125)
    with pytest.raises(RuntimeError, match="kv index out of the pool"):
        op(q, k_pool, v_pool, qo, kvp, torch.tensor([1, 2, 10]), mask, 0.125)
    with pytest.raises(RuntimeError, match="custom_mask must hold"):
        op(q, k_pool, v_pool, qo, kvp, idx, mask[:5], 0.125)
    with pytest.raises(RuntimeError, match="qo_indptr"):
        op(q, k_pool, v_pool, torch.tensor([0, 1]), kvp, idx, mask, 0.125)
    with pytest.raises(RuntimeError, match="fp32 only"):
        op(q.double(), k_pool.double(), v_pool.double(), qo, kvp, idx, mask, 0.125)
    with pytest.raises(RuntimeError, match="head dims 64 or 128"):
        op(torch.randn(2, HQ, 32), torch.randn(10, HKV, 32), torch.randn(10, HKV, 32), qo, kvp, idx, mask, 0.125)
    with pytest.raises(RuntimeError, match="multiple of kv heads"):
        op(torch.randn(2, 8, 64), k_pool, v_pool, qo, kvp, idx, mask, 0.125)
