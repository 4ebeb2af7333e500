"""The q8 dtype (kernels/cpu_q8.cpp): integer dot products of the GGUF blocks with 8-bit activations, the whole
decoder stack in one call. What it computes (against its definition in fp64), and that a row's bits depend on
nothing but its token, position and the K/V it sees: not the batch, the tile, the thread count, chunked prefill
or whether the stack ran in one call or layer by layer."""

import pytest
import torch
from helpers import gguf_dequant, random_blocks, tiny_config, tiny_state, tree_rows_against_decodes

from sglang_ext import kernels
from sglang_ext.attention import causal_mask, plan_attention, prefix_and_tree_mask
from sglang_ext.models import LlamaModel, q8_blocks_complete, wants_q8

pytestmark = pytest.mark.skipif(kernels.q8_unavailable() is not None, reason=f"q8: {kernels.q8_unavailable()}")

# weights of the tiny model: hidden 128, 2 query heads and 1 kv head of 64, MLP 64 wide, 40-token vocab
# (the head's last group of 16 rows is partial), Q4_1 layers and a Q8_0 head, as the shipped target
KINDS = {"lm_head.weight": "Q8_0", "model.embed_tokens.weight": "Q8_0"}


def tiny_q8(seed: int = 0, bias: bool = False, layers: int = 2) -> LlamaModel:
    cfg = tiny_config(vocab=40, hidden=128, layers=layers, heads=2, kv_heads=1, bias=bias)
    state = tiny_state(cfg, seed)
    packed = {}
    for i, (name, w) in enumerate(sorted(state.items())):
        if w.dim() == 2:
            kind = KINDS.get(name, "Q4_1")
            blocks = random_blocks(kind, w.shape[0], w.shape[1], seed=1000 * seed + i)
            state[name] = gguf_dequant(kind, blocks)
            packed[name] = (kind, blocks)
    return LlamaModel(cfg, state, packed=packed, q8=True)


def test_quantize_is_its_definition():
    """Per block of 32: d = max|x| / 127, q = round-half-even(x * (127 / max|x|)), s = sum(q); a zero block is
    all zeros; a block with a NaN or an infinity gets d = NaN (it poisons what it feeds, as in fp32)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 96, generator=g) * torch.tensor([0.01, 1.0, 300.0]).repeat_interleave(32)
    x[1, 32:64] = 0
    x[2, :32] = torch.arange(32) - 15.5  # exact halves after scaling: ties to even
    q, d, s = torch.ops.moa_cpu.q8_quantize(x)
    blocks = x.view(5, 3, 32)
    amax = blocks.abs().amax(-1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    want = torch.round(blocks * inv[..., None])
    assert torch.equal(q.view(5, 3, 32).float(), want)
    assert torch.equal(d, amax / 127.0)
    assert torch.equal(s, want.sum(-1).int())
    bad = x.clone()
    bad[0, 3], bad[1, 40] = float("nan"), float("inf")
    _, d_bad, _ = torch.ops.moa_cpu.q8_quantize(bad)
    assert d_bad[0, 0].isnan() and d_bad[1, 1].isnan() and d_bad[0, 1:].isfinite().all()


def _dequantized_input(x: torch.Tensor) -> torch.Tensor:
    q, d, _ = torch.ops.moa_cpu.q8_quantize(x)
    return (q.double().view(x.shape[0], -1, 32) * d.double()[..., None]).view(x.shape)


@pytest.mark.parametrize("bias", [False, True])
def test_matmuls_are_the_dequantized_product(bias):
    """Every layer weight and the head: x's 8-bit blocks times the GGUF blocks, as the fp64 product of the two
    dequantized (fp32 rounding only); 1-19 rows (tiles of 8 and their rests), bit-identical row by row."""
    model = tiny_q8(bias=bias)
    g = torch.Generator().manual_seed(1)
    lw = model.layers[1]
    for which, w in enumerate([lw.qkv, lw.o, lw.gate_up, lw.down, model.lm_head]):
        x = torch.randn(19, w.shape[1], generator=g)
        y = model.q8.logits(x) if which == 4 else model.q8.matmul(x, 1, which)
        ref = _dequantized_input(x) @ w.double().T
        assert y.shape == ref.shape
        assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item()), which
        for rows in (slice(0, 1), slice(3, 11), slice(5, 18)):
            part = model.q8.logits(x[rows]) if which == 4 else model.q8.matmul(x[rows], 1, which)
            assert torch.equal(part, y[rows]), (which, rows)


@pytest.mark.parametrize("bias", [False, True])
def test_tiny_tree_rows_equal_their_decodes(bias):
    """A verify tree's rows (a chain with siblings it must not see) give what decoding each token alone gives,
    bit for bit at every layer, and write the same K/V (with a qkv bias too, Qwen2-style)."""
    diffs = tree_rows_against_decodes(tiny_q8(bias=bias), "ragged-eager", n_prompt=70, chain=6)
    assert diffs == [], diffs


def test_target_tree_rows_equal_their_decodes(smollm2_q8):
    """The same on the shipped target (300-token prompt, 8-token chain with siblings)."""
    diffs = tree_rows_against_decodes(smollm2_q8.model, "ragged-eager")
    assert diffs == [], diffs


def _prefill(model, ids, kv, start, chunk, capture=()):
    """ids at positions start.. into slots start + 1.. in chunks of `chunk` rows; the last chunk's output."""
    for c in range(0, len(ids), chunk):
        n = min(chunk, len(ids) - c)
        slots = torch.arange(start + c + 1, start + c + 1 + n)
        cols = torch.arange(1, start + c + 1 + n)
        plan = plan_attention([cols], [causal_mask(n, start + c)])
        out = model.forward(ids[c : c + n], torch.arange(start + c, start + c + n), slots, plan, kv, capture)
    return out


def test_one_call_equals_the_layer_by_layer_path_and_chunks_equal_whole_prompts():
    """The stack in one call == layer by layer (layer_qkv, the attention kernel, layer_out: the path a drafter's
    TLI layers take), hidden states, captures and K/V; a prompt prefilled in chunks == prefilled whole."""
    model = tiny_q8(seed=2, layers=3)
    ids = torch.randint(0, 40, (50,), generator=torch.Generator().manual_seed(3))
    pools = [model.new_kv_pool(64) for _ in range(3)]
    whole = _prefill(model, ids, pools[0], 0, 50, capture=(0, 2))
    chunked = _prefill(model, ids, pools[1], 0, 7, capture=(0, 2))
    one_call = model._forward_q8
    model._forward_q8 = lambda *a, **k: None  # instance attribute: this model only
    try:
        per_layer = _prefill(model, ids, pools[2], 0, 50, capture=(0, 2))
    finally:
        model._forward_q8 = one_call
    for other in (chunked, per_layer):
        assert torch.equal(other.hidden[-1], whole.hidden[-1])
        assert torch.equal(other.captured[2][-1], whole.captured[2][-1])
    assert torch.equal(per_layer.hidden, whole.hidden) and torch.equal(per_layer.captured[0], whole.captured[0])
    for kv in pools[1:]:
        assert all(torch.equal(a[:51], b[:51]) for a, b in zip(kv.k + kv.v, pools[0].k + pools[0].v))


def test_thread_count_changes_no_bits(smollm2_q8):
    """Work is split over the threads by heads, groups of 16 weight rows and attention tasks; every output is
    computed whole by one thread, so 1 and 2 threads give the same bits."""
    model = smollm2_q8.model
    ids = torch.randint(3, 49152, (40,), generator=torch.Generator().manual_seed(4))
    before = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2):
            torch._C.set_num_threads(n)  # (conftest pins torch.set_num_threads for the harness)
            kv = model.new_kv_pool(64)
            h = _prefill(model, ids, kv, 0, 40).hidden
            outs.append((h, model.logits(h), kv.k[29][:41].clone()))
    finally:
        torch._C.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def test_q8_stays_close_to_fp32(smollm2_q8, smollm2_fp32, eval_prompts):
    """8-bit activations move the target's next-token logits by a little (llama.cpp's q8_1 x Q4_1 numbers):
    the greedy token agrees at >= 95 % of a prompt's positions, and |logit difference| averages ~0.2 (the
    logits span ~30)."""
    prompt = torch.tensor(eval_prompts[0][:120])
    got = []
    for t in (smollm2_q8, smollm2_fp32):
        kv = t.model.new_kv_pool(128)
        got.append(t.model.logits(_prefill(t.model, prompt, kv, 0, 120).hidden))
    agree = (got[0].argmax(-1) == got[1].argmax(-1)).float().mean().item()
    diff = (got[0] - got[1]).abs().mean().item()
    print(f"greedy agreement {agree:.3f}, mean |logit difference| {diff:.3f}")
    assert agree >= 0.95 and diff < 0.3, (agree, diff)


def test_dtype_q8_is_chosen_by_auto_here_and_refused_clearly_without_blocks(smollm2_q8, tmp_path):
    """auto picks q8 on this CPU for a target with every GGUF block; a model without them stays fp32 under auto
    and is refused, naming what is missing, under q8."""
    model = smollm2_q8.model
    assert model.dtype_name == "q8" and model.dtype == torch.float32
    packed = {n: ("Q4_1", None) for n in _layer_weight_names(model.cfg)} | {"model.embed_tokens.weight": ("Q8_0", None)}
    assert q8_blocks_complete(model.cfg, packed) and wants_q8("auto", "cpu", model.cfg, packed)
    assert not wants_q8("auto", "cuda", model.cfg, packed) and not wants_q8("float32", "cpu", model.cfg, packed)
    del packed["model.layers.3.mlp.up_proj.weight"]
    assert not q8_blocks_complete(model.cfg, packed)
    cfg = tiny_config(hidden=128, heads=2, kv_heads=1)
    assert LlamaModel(cfg, tiny_state(cfg)).q8 is None
    with pytest.raises(ValueError, match="GGUF blocks of every layer weight and of the head; layer 0 qkv has none"):
        LlamaModel(cfg, tiny_state(cfg), q8=True)


def _layer_weight_names(cfg) -> list[str]:
    names = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        names += [p + f"self_attn.{n}_proj.weight" for n in "qkvo"]
        names += [p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
    return names


def test_stack_rejects_bad_input_clearly():
    model = tiny_q8()
    with pytest.raises(RuntimeError, match=r"x must be fp32 \[T, 128\]"):
        model.q8.matmul(torch.randn(2, 64), 0, 0)
    with pytest.raises(RuntimeError, match="no such layer or weight"):
        model.q8.matmul(torch.randn(2, 128), 5, 0)
    kv = model.new_kv_pool(8)
    plan = plan_attention([torch.tensor([1])], [prefix_and_tree_mask(torch.ones(1, 1, dtype=torch.bool), 0)])
    with pytest.raises(RuntimeError, match="outside the pool"):
        model.forward(torch.tensor([1]), torch.tensor([0]), torch.tensor([9]), plan, kv)


def test_a_drafters_linears_on_the_q8_kernels():
    """attach_q8: a Linear's weight as Q8_0 blocks (per 32: d = max|w| / 127 in fp16, n = round(w / d)) times the
    8-bit input, any row count; an in-place update (training) makes `linear` read the weight itself again, and
    so does autograd. attach_q8_rows: rows of a target's head blocks, as the full head computes them."""
    g = torch.Generator().manual_seed(5)
    lin = torch.nn.Linear(96, 40, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(40, 96, generator=g) * 0.1)
    assert kernels.attach_q8(lin) == 1
    blocks = torch.ops.moa_cpu.q8_0_blocks(lin.weight.detach()).view(40, 3, 34)
    d = blocks[..., :2].contiguous().view(torch.float16).float()  # [40, 3, 1]
    w8 = (blocks[..., 2:].contiguous().view(torch.int8).double() * d.double()).view(40, 96)
    assert (w8 - lin.weight.detach().double()).abs().max() <= d.max() / 2 + 1e-7
    x = torch.randn(30, 96, generator=g)
    with torch.no_grad():
        y = kernels.linear(x, lin.weight, lin.bias)
        ref = _dequantized_input(x) @ w8.T + lin.bias.double()
        assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-5)
        assert torch.equal(kernels.linear(x[7:9], lin.weight, lin.bias), y[7:9])
        lin.weight.add_(1.0)
        assert torch.equal(kernels.linear(x, lin.weight, lin.bias), torch.nn.functional.linear(x, lin.weight, lin.bias))
    model = tiny_q8()
    rows = torch.tensor([3, 39, 0, 17])
    head = model.lm_head[rows].contiguous()
    assert kernels.attach_q8_rows(head, model.lm_head, rows)
    h = torch.randn(5, 128, generator=g)
    assert torch.equal(kernels.linear(h, head), model.q8.logits(h)[:, rows])


def test_eagle3_draft_layer_in_one_call_is_the_modules_layer(smollm2_q8):
    """Beside a q8 target, EAGLE-3's draft layer runs as one call (Q8Stack.draft_layer): the module's own layer
    on the same Q8_0 weights (q/k/v and gate/up fused) and 8-bit inputs, up to the attention's summation order."""
    from sglang_ext.attention import causal_masks, plan_flat
    from sglang_ext.drafters import make_drafter

    d = make_drafter("eagle3", smollm2_q8)
    assert d.q8_layer is not None
    g = torch.Generator().manual_seed(6)
    n = 40
    ids, feat = torch.randint(3, 49152, (n,), generator=g), torch.randn(n, 576, generator=g)
    outs = []
    for one_call in (True, False):  # (inference mode, as propose runs: the module's Linears on their Q8_0 blocks)
        layer, d.q8_layer = d.q8_layer, d.q8_layer if one_call else None
        slots = d.kv.alloc(n)
        plan = plan_flat([slots], causal_masks([n], [0]), [n])
        with torch.inference_mode():
            outs.append(d._layer(ids, feat, torch.arange(n), slots, plan))
        d.q8_layer = layer
        d.kv.free(slots)
    assert torch.allclose(outs[0], outs[1], rtol=1e-4, atol=1e-4 * outs[1].abs().max().item())


def test_eagle3_extend_on_q8_runs_the_layer_for_each_requests_last_pair_only(smollm2_q8):
    """Beside a q8 target, a prompt's pairs before its last get the layer's K/V alone (Q8Stack.draft_kv): the root
    output and every pair's K/V equal what extending pair by pair through draft_layer gives."""
    from helpers import extend_whole_and_pair_by_pair

    from sglang_ext.drafters import make_drafter

    for lengths in ([9, 1, 4], [2, 1, 3]):  # (11 pairs before the last ones: K/V alone; 3: the whole layer)
        whole, stepwise = make_drafter("eagle3", smollm2_q8), make_drafter("eagle3", smollm2_q8)
        assert whole.q8_layer is not None
        extend_whole_and_pair_by_pair(whole, stepwise, lengths, 49152, seed=1)


def test_a_stacks_reused_scratch_never_reaches_a_result():
    """The stack reuses its scratch buffers for few rows (a decode, a verify, a draft): what one call returned stays
    as it was after the next calls of the same shape (results are copied out), a call's result does not depend on
    the calls before it, and another stack of other sizes gets its own scratch."""
    g = torch.Generator().manual_seed(9)
    for layers, hidden_seed in ((2, 0), (1, 1)):  # (two stacks of different sizes, one after the other)
        model = tiny_q8(seed=hidden_seed, layers=layers)
        kv = model.new_kv_pool(32)
        pos = torch.arange(3)
        cos, sin = model.rope(pos)
        x1, x2 = torch.randn(3, 128, generator=g), torch.randn(3, 128, generator=g)
        q1 = model.q8.layer_qkv(x1, 0, cos[:, 0], sin[:, 0], kv.k[0], kv.v[0], torch.tensor([1, 2, 3]))
        kept = q1.clone()
        q2 = model.q8.layer_qkv(x2, 0, cos[:, 0], sin[:, 0], kv.k[0], kv.v[0], torch.tensor([4, 5, 6]))
        assert torch.equal(q1, kept) and not torch.equal(q1, q2)
        a = torch.randn(3, 128, generator=g)
        o1 = model.q8.layer_out(x1, a, 0)
        kept = o1.clone()
        o2 = model.q8.layer_out(x2, a, 0)
        assert torch.equal(o1, kept) and not torch.equal(o1, o2)
        assert torch.equal(model.q8.layer_out(x1, a, 0), kept)  # (after another call: the same bits)
        assert torch.equal(
            model.q8.layer_qkv(x1, 0, cos[:, 0], sin[:, 0], kv.k[0], kv.v[0], torch.tensor([1, 2, 3])), q1
        )


def test_a_heads_norm_topk_is_its_softmaxs_top_k():
    """Q8Matrix.norm_topk (a draft head's one-level search in one call): the logits are the matrix's own (forward of
    RMSNorm(x) * w), the probabilities the softmax's k largest in descending order (ties: the lower index), their
    ids, and a per-row flag that every logit was finite; a NaN / +inf row gets NaN probabilities (no child passes
    min_prob); bad input is refused clearly."""
    g = torch.Generator().manual_seed(11)
    lin = torch.nn.Linear(96, 300, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(300, 96, generator=g))
    assert kernels.attach_q8(lin, "Q4_1") == 1
    head, norm = kernels.q8_of(lin), torch.rand(96, generator=g) + 0.5
    x = torch.randn(6, 96, generator=g) * torch.tensor([0.1, 1, 3, 10, 30, 100])[:, None]
    with torch.no_grad():
        logits = head.forward(torch.ops.moa_cpu.rms_norm(x, norm, 1e-5))
    for k in (1, 2, 5):
        p, ids, finite = head.norm_topk(x, norm, 1e-5, k)
        ref_p, ref_ids = torch.softmax(logits, -1).topk(k, -1)
        assert torch.equal(ids, ref_ids) and ids.dtype == torch.int64 and bool(finite.all())
        assert torch.allclose(p, ref_p, rtol=1e-5, atol=1e-7) and bool((p[:, :-1] >= p[:, 1:]).all())
    tie = torch.zeros(1, 96)  # every logit 0: the lowest indices, each 1 / 300
    p, ids, _ = head.norm_topk(tie, norm, 1e-5, 3)
    assert ids.tolist() == [[0, 1, 2]] and torch.allclose(p, torch.full((1, 3), 1 / 300))
    bad = x.clone()
    bad[1, 0], bad[4, 3] = float("nan"), float("inf")  # (RMSNorm spreads them over the row)
    p, ids, finite = head.norm_topk(bad, norm, 1e-5, 2)
    assert finite.tolist() == [True, False, True, True, False, True]
    assert bool(p[[1, 4]].isnan().all()) and torch.equal(
        p[[0, 2, 3, 5]], head.norm_topk(x, norm, 1e-5, 2)[0][[0, 2, 3, 5]]
    )
    for args, msg in (
        ((x[:, :64], norm, 1e-5, 2), "x must be"),
        ((x, norm[:64], 1e-5, 2), "norm must be"),
        ((x, norm, 1e-5, 0), "k must be"),
    ):
        with pytest.raises(RuntimeError, match=msg):
            head.norm_topk(*args)
    with torch.no_grad():
        lin.weight.add_(1.0)
    assert kernels.q8_of(lin) is None  # a changed weight: its blocks are stale


def test_eagle3_one_level_search_on_q8_is_search_trees(smollm2_q8, monkeypatch):
    """Beside a q8 target, EAGLE-3's one-level search (its CPU default) takes the head's norm, matmul, softmax and
    top-k in one call (Q8Matrix.norm_topk): every tree equals the one search_tree builds from the head's logits
    (tokens in target ids, parents, positions, mask, retrieve fields; scores to float rounding)."""
    import sglang_ext.drafters.eagle3 as eagle3
    from sglang_ext.drafters import make_drafter
    from sglang_ext.drafters.base import DraftInput
    from sglang_ext.drafters.search import search_tree
    from sglang_ext.sampling import SamplingParams
    from sglang_ext.tree import TreeShape

    def searched(*a, **k):
        raise AssertionError("the one-level path runs no search_tree")

    monkeypatch.setattr(eagle3, "search_tree", searched)
    d = make_drafter("eagle3", smollm2_q8)
    g = torch.Generator().manual_seed(3)
    batch = [
        DraftInput(i, torch.randint(3, 49152, (5 + i,), generator=g).tolist(), SamplingParams(), None) for i in range(4)
    ]
    for label in ("1,2,3,0.1", "1,3,4,0.05", "1,2,3"):
        shape = TreeShape.parse(label)
        root_out = torch.randn(4, 576, generator=g) * 2

        def no_step(tokens, parent_beam):
            raise AssertionError("one level")

        with torch.inference_mode():
            ref = search_tree(d.draft.logits(root_out).float(), no_step, shape, batch)
            d._extend = lambda batch, shape=None, out=root_out: out  # (the root outputs above)
            fast = d.propose(batch, shape)
            del d._extend
        for a, b in zip(fast, ref):
            assert torch.equal(a.draft_tokens, torch.cat([b.draft_tokens[:1], d.hot_ids[b.draft_tokens[1:]]]))
            for name in (
                "parents",
                "positions",
                "tree_mask",
                "retrieve_index",
                "retrieve_next_token",
                "retrieve_next_sibling",
            ):
                assert torch.equal(getattr(a, name), getattr(b, name)), name
            assert torch.allclose(a.scores, b.scores, rtol=1e-5) and bool(a.finite)


def _error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    return _error(a, b) <= tol


def test_moa_on_q8_stacks_is_the_modules_math(smollm2_q8, smollm2_fp32):
    """Beside a q8 target, MoA's commit (LSA, Ekv2E, the CA keys/values), SA commit and draft pass (SA, CA, the TLI
    layer, norm, head rows) run as native calls on q8 stacks (kernels.q8_moa_stacks): the module's math on the same
    Q8_0 weights and 8-bit inputs, up to the norms' and attentions' summation order (8-bit inputs amplify it), the
    same argmax; a token's CA keys/values are bit for bit the same alone or in a batch. The commit's LSA runs its
    down projection once on each token's mean over the layers (down is linear): other roundings than the module's
    per-row ones, and as close to the module's fp32 math."""
    from sglang_ext.drafters import make_drafter
    from sglang_ext.drafters.base import DraftInput
    from sglang_ext.drafters.moa import LSA_CHUNK, _RequestState, _TreePaths
    from sglang_ext.drafters.moa_core import commit_ca, commit_sa, draft_logits, draft_pass, lsa_memory
    from sglang_ext.kernels import q8_moa_stacks
    from sglang_ext.sampling import SamplingParams

    d, m = make_drafter("moa", smollm2_q8), smollm2_q8.model
    assert d.q8 is not None and d.tli_layers
    shipped = d.q8  # (the module's math: on the weights the modules' matmuls use, Q8_0)
    d.q8 = (q8_moa_stacks(d.draft, m, d.tli_layers, pass_kind="Q8_0")[0], shipped[1])
    g = torch.Generator().manual_seed(8)
    kv = m.new_kv_pool(64)
    for t in kv.k + kv.v:
        t.copy_(torch.randn(t.shape, generator=g))
    with torch.inference_mode():
        slots, positions = torch.tensor([5, 9, 2, 33, 17]), torch.tensor([0, 1, 2, 3, 40])
        k, v = d._commit_q8(kv, slots, positions)  # LSA, Ekv2E and the CA keys/values in one call
        want_k, want_v = commit_ca(d.draft, lsa_memory(d.draft, kv.k, kv.v, slots), positions)
        assert _close(k, want_k, 1e-2) and _close(v, want_v, 1e-2)
        d32 = make_drafter("moa", smollm2_fp32).draft
        exact = commit_ca(d32, lsa_memory(d32, kv.k, kv.v, slots), positions)
        for got, module, fp32 in zip((k, v), (want_k, want_v), exact):
            assert _error(got, fp32) <= 1.1 * _error(module, fp32)
        k2, v2 = d._commit_q8(kv, slots[1:3], positions[1:3])
        assert torch.equal(k2, k[1:3]) and torch.equal(v2, v[1:3])
        many = torch.randperm(64, generator=g)[: LSA_CHUNK + 7]  # (a prompt: its tokens LSA_CHUNK at a time)
        k3, v3 = d._commit_q8(kv, many, torch.arange(many.numel()))
        k4, v4 = d._commit_q8(kv, many[-3:], torch.arange(many.numel())[-3:])
        assert torch.equal(k3[-3:], k4) and torch.equal(v3[-3:], v4) and k3.shape == (many.numel(), *k.shape[1:])
        # the SA commit: K/V of verified tokens' embeddings into the SA pool
        ids, pos = torch.tensor([7, 300, 4100]), torch.tensor([0, 1, 2])
        sa = d.sa.alloc(3)
        cos, sin = m.rope(pos)
        d.q8[0].layer_kv(m.embed[ids], 0, cos[:, 0], sin[:, 0], d.sa.k[0], d.sa.v[0], sa)  # (the engine's: no q)
        k, v = commit_sa(d.draft, m.embed, ids, pos)
        assert _close(d.sa.k[0][sa], k, 1e-3) and _close(d.sa.v[0][sa], v, 1e-3)
        kv_only = d.sa.k[0][sa].clone(), d.sa.v[0][sa].clone()
        d.q8[0].layer_qkv(m.embed[ids], 0, cos[:, 0], sin[:, 0], d.sa.k[0], d.sa.v[0], sa)
        assert torch.equal(d.sa.k[0][sa], kv_only[0]) and torch.equal(d.sa.v[0][sa], kv_only[1])  # (the same rows)
        # a pass over 3 frontier nodes of a request with 20 verified tokens (random SA, memory and target K/V)
        st = d.reqs[0] = _RequestState()
        st.sa_slots, st.mem_slots, st.target_slots = d.sa.alloc(20), d.mem.alloc(20), torch.arange(30, 50)
        for pool, s in ((d.sa, st.sa_slots), (d.mem, st.mem_slots)):
            for t in (pool.k[0], pool.v[0]):
                t[s] = torch.randn(20, *t.shape[1:], generator=g)
        d.tli_kv = kv
        paths = _TreePaths(d, [DraftInput(0, list(range(21)), SamplingParams(), None)])
        try:
            at = paths(torch.zeros(1, 3, dtype=torch.long))
            tokens = torch.tensor([11, 2000, 30000])
            native = d._pass_q8(tokens, at, False)
            ref = draft_logits(d.parts, draft_pass(d.parts, d.kv, tokens, at))
            assert native.shape == ref.shape == (3, d.hot_ids.numel())
            assert _close(native, ref, 1e-2)
            assert torch.equal(native.argmax(-1), ref.argmax(-1))
            d.q8 = shipped  # the pass's weights as Q4_1 blocks (the default): the same logits up to their rounding
            assert _close(d._pass_q8(tokens, at, False), native, 0.1)
        finally:
            paths.free()
            d.remove_request(0)
            d.sa.free(sa)


def test_q4_1_blocks_round_to_the_grid_and_run_on_the_kernels():
    """kernels.q4_1_blocks: GGUF Q4_1 blocks of an fp32 weight (a drafter's pass weights), as gguf reads them: every
    weight within half a step of its block's grid d q + m (a constant block exact); the q8 kernels multiply those."""
    from sglang_ext.kernels import _q8_matrix, q4_1_blocks

    g = torch.Generator().manual_seed(4)
    w = torch.randn(48, 96, generator=g)
    w[3, :32] = 0.5
    blocks = q4_1_blocks(w)
    grid = gguf_dequant("Q4_1", blocks)  # (the gguf package's reading of them)
    d = blocks.reshape(48, 3, 20)[..., :2].contiguous().view(torch.float16).float()
    assert bool(((grid - w).abs().reshape(48, 3, 32) <= d / 2 * (1 + 1e-3) + 1e-6).all())
    assert torch.equal(grid[3, :32], w[3, :32])
    x = torch.randn(5, 96, generator=g)
    assert _close(_q8_matrix(blocks, "Q4_1", 96).forward(x), x @ grid.T, 1e-2)
    with pytest.raises(ValueError, match="multiple of 32"):
        q4_1_blocks(torch.zeros(2, 40))
