"""The decoder-layer glue ops (sglang_ext/kernels/cpu_layer_ops.cpp) against the torch code they
replace, their batch invariance, their errors, and a whole target forward with and without them."""

import pytest
import torch
import torch.nn.functional as F

from sglang_ext import kernels
from sglang_ext.models.llama import apply_rope, rms_norm

pytestmark = pytest.mark.skipif(
    kernels.rope_store is None, reason=f"layer ops unavailable: {kernels.UNAVAILABLE or 'MOA_SERVE_LAYER_OPS=0'}"
)

ops = torch.ops.moa_cpu


def _rope(t: int, d: int, start: int = 0):
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    f = (torch.arange(t, dtype=torch.float64)[:, None] + start) * inv
    emb = torch.cat([f, f], -1).float()
    return emb.cos(), emb.sin()


@pytest.mark.parametrize("t", [1, 3, 17, 70])
def test_norms_match_torch(t):
    g = torch.Generator().manual_seed(t)
    x, r, w = torch.randn(t, 576, generator=g) * 3, torch.randn(t, 576, generator=g), torch.randn(576, generator=g)
    assert torch.allclose(ops.rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5), rtol=1e-5, atol=1e-5)
    s, y = ops.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(s, x + r)
    assert torch.allclose(y, rms_norm(x + r, w, 1e-5), rtol=1e-5, atol=1e-5)
    # the residual stream may be a strided view (a row slice of a bigger buffer)
    big = torch.randn(t, 1152, generator=g)
    assert torch.allclose(ops.rms_norm(big[:, :576], w, 1e-5), rms_norm(big[:, :576], w, 1e-5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("t", [1, 5, 40])
def test_silu_mul_matches_torch_over_the_whole_range(t):
    g = torch.Generator().manual_seed(t)
    gu = torch.randn(t, 2 * 1536, generator=g) * 8
    gu[0, :8] = torch.tensor([0.0, -0.0, 90.0, -90.0, 1e-30, -1e-30, 200.0, -200.0])
    ref = F.silu(gu[:, :1536]) * gu[:, 1536:]
    got = ops.silu_mul(gu)
    assert got.shape == (t, 1536)
    assert torch.allclose(got, ref, rtol=2e-6, atol=1e-30)


@pytest.mark.parametrize("t,hq,hkv,d", [(1, 9, 3, 64), (6, 9, 3, 64), (33, 4, 4, 128)])
def test_rope_store_matches_torch_and_writes_the_pool(t, hq, hkv, d):
    g = torch.Generator().manual_seed(t + d)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g)
    cos, sin = _rope(t, d, start=200)
    k_pool, v_pool = torch.zeros(64, hkv, d), torch.zeros(64, hkv, d)
    slots = torch.randperm(63, generator=g)[:t] + 1
    q = ops.rope_store(qkv, cos, sin, k_pool, v_pool, slots, hq, hkv)
    q_ref = apply_rope(qkv[:, : hq * d].view(t, hq, d), cos[:, None], sin[:, None])
    k_ref = apply_rope(qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d), cos[:, None], sin[:, None])
    assert torch.allclose(q, q_ref, rtol=1e-6, atol=1e-6)
    assert torch.allclose(k_pool[slots], k_ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(v_pool[slots], qkv[:, (hq + hkv) * d :].view(t, hkv, d))
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[slots] = False
    assert not k_pool[untouched].any() and not v_pool[untouched].any()


def test_rows_are_bit_identical_whatever_the_batch():
    """A decode row and the same row inside a verify block or a batch give the same bits."""
    g = torch.Generator().manual_seed(7)
    x, r, w = torch.randn(40, 576, generator=g), torch.randn(40, 576, generator=g), torch.randn(576, generator=g)
    gu = torch.randn(40, 3072, generator=g)
    qkv = torch.randn(40, 15 * 64, generator=g)
    cos, sin = _rope(40, 64)
    pools = torch.zeros(41, 3, 64), torch.zeros(41, 3, 64)
    q_all = ops.rope_store(qkv, cos, sin, *pools, torch.arange(1, 41), 9, 3)
    full = ops.rms_norm(x, w, 1e-5), ops.add_rms_norm(x, r, w, 1e-5), ops.silu_mul(gu)
    for i in [0, 13, 39]:
        s = slice(i, i + 1)
        assert torch.equal(ops.rms_norm(x[s], w, 1e-5), full[0][s])
        assert all(torch.equal(a, b[s]) for a, b in zip(ops.add_rms_norm(x[s], r[s], w, 1e-5), full[1]))
        assert torch.equal(ops.silu_mul(gu[s]), full[2][s])
        one = torch.zeros(41, 3, 64), torch.zeros(41, 3, 64)
        assert torch.equal(ops.rope_store(qkv[s], cos[s], sin[s], *one, torch.tensor([i + 1]), 9, 3), q_all[s])
        assert torch.equal(one[0][i + 1], pools[0][i + 1])


def test_bad_input_is_a_clear_error():
    pools = torch.zeros(8, 3, 64), torch.zeros(8, 3, 64)
    cos, sin = _rope(2, 64)
    qkv = torch.randn(2, 15 * 64)
    with pytest.raises(RuntimeError, match="outside the pool"):
        ops.rope_store(qkv, cos, sin, *pools, torch.tensor([1, 8]), 9, 3)
    with pytest.raises(RuntimeError, match="qkv width"):
        ops.rope_store(qkv, cos, sin, *pools, torch.tensor([1, 2]), 9, 2)
    with pytest.raises(RuntimeError, match="fp32"):
        ops.rms_norm(torch.randn(2, 16).double(), torch.randn(16), 1e-5)
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.rms_norm(torch.randn(2, 16), torch.randn(8), 1e-5)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        ops.silu_mul(torch.randn(2, 12))


def test_target_forward_with_and_without_the_ops(smollm2_fp32):
    """The whole SmolLM2 forward (prefill, then a 4-row verify block on its cache) on the ops agrees
    with the torch ops to fp32 rounding and gives the same greedy tokens."""
    from sglang_ext.attention import causal_mask, plan_attention

    model = smollm2_fp32.model
    ids = torch.tensor(smollm2_fp32.encode_chat([{"role": "user", "content": "Name three prime numbers."}]))
    results = []
    for use_ops in (True, False):
        saved = kernels.rope_store
        kernels.rope_store = saved if use_ops else None
        try:
            kv = model.new_kv_pool(len(ids) + 8)
            slots = torch.arange(1, len(ids) + 1)
            out = model.forward(
                ids, torch.arange(len(ids)), slots, plan_attention([slots], [causal_mask(len(ids), 0)]), kv
            )
            block = torch.arange(len(ids) + 1, len(ids) + 5)
            nxt = torch.tensor([28, 29, 30, 31])
            all_slots = torch.cat([slots, block])
            out2 = model.forward(
                nxt,
                torch.arange(len(ids), len(ids) + 4),
                block,
                plan_attention([all_slots], [causal_mask(4, len(ids))]),
                kv,
            )
            results.append((model.logits(out.hidden[-1:]), model.logits(out2.hidden)))
        finally:
            kernels.rope_store = saved
    (a1, a2), (b1, b2) = results
    assert torch.allclose(a1, b1, rtol=1e-4, atol=1e-4) and torch.allclose(a2, b2, rtol=1e-4, atol=1e-4)
    assert torch.equal(a1.argmax(-1), b1.argmax(-1)) and torch.equal(a2.argmax(-1), b2.argmax(-1))


def test_unchecked_rows_kernel_is_the_same_computation(smollm2_fp32):
    """_layer_forward_ops calls the small-rows kernel without linear()'s per-call checks: same bits."""
    from sglang_ext.attention import causal_mask, plan_attention

    model = smollm2_fp32.model
    assert model._rows_kernel
    ids = torch.tensor(smollm2_fp32.encode_chat([{"role": "user", "content": "Hello"}]))
    outs = []
    for unchecked in (True, False):
        model._rows_kernel = unchecked
        try:
            kv = model.new_kv_pool(len(ids) + 1)
            slots = torch.arange(1, len(ids) + 1)
            # a short prompt is a few-row forward: the path a decode or verify step takes
            outs.append(
                model.forward(
                    ids, torch.arange(len(ids)), slots, plan_attention([slots], [causal_mask(len(ids), 0)]), kv
                ).hidden
            )
        finally:
            model._rows_kernel = True
    assert torch.equal(*outs)


def test_softmax_topk_is_softmax_then_topk():
    """softmax_topk (a one-level search's one call): per row the k largest softmax probabilities, descending, the
    ids of the k largest logits (ties: the lower index), whether every logit was finite; a NaN / +inf row gets NaN
    probabilities (no child passes min_prob), a row with -inf logits its finite probabilities; bad k refused."""
    from sglang_ext import kernels

    if kernels.softmax_topk is None:
        pytest.skip("the CPU layer ops are not built here")
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(5, 1003, generator=g) * torch.tensor([0.01, 1, 4, 20, 80])[:, None]
    for k in (1, 2, 4, 1003):
        p, ids, finite = kernels.softmax_topk(logits, k)
        ref_ids = logits.topk(k, -1).indices  # (by logit: probabilities far below the top underflow to equal zeros)
        assert torch.equal(ids, ref_ids) and bool(finite.all()) and p.dtype == torch.float32
        assert torch.allclose(p, torch.softmax(logits, -1).gather(1, ref_ids), rtol=1e-5, atol=1e-30)
    p, ids, _ = kernels.softmax_topk(torch.zeros(1, 10), 3)
    assert ids.tolist() == [[0, 1, 2]] and torch.allclose(p, torch.full((1, 3), 0.1))
    bad = logits.clone()
    bad[1, 7], bad[2, 0], bad[3, 500] = float("nan"), float("inf"), float("-inf")
    p, ids, finite = kernels.softmax_topk(bad, 2)
    assert finite.tolist() == [True, False, False, False, True]
    assert bool(p[1:3].isnan().all()) and torch.allclose(p[3], torch.softmax(bad[3], -1).topk(2).values)
    with pytest.raises(RuntimeError, match="k must be"):
        kernels.softmax_topk(logits, 0)
    with pytest.raises(RuntimeError, match="k must be"):
        kernels.softmax_topk(logits, 1004)
