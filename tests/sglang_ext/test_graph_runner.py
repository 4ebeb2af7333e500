"""CUDA graphs for the target's decode / verify forward (sglang_ext/models/graph_runner.py).

On the CPU the runner's static padded path runs eagerly: it must give the eager forward's outputs for
decode and verify batches at several buckets (batch, tree nodes and context padded), pick the smallest
bucket that fits, refuse what fits none, and leave an engine's greedy tokens unchanged. The `gpu`
tests replay the captured graphs on CUDA against the eager engine.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import compare_to_reference, slots_whole, static_runs, tiny_target, tree_rows_against_decodes

from serving.config import EngineConfig
from serving.engine import Engine
from sglang_ext.attention import FrontierPaths, causal_mask, plan_attention, plan_frontier, prefix_and_tree_mask
from sglang_ext.drafters import DraftInput, TargetCapture, make_drafter
from sglang_ext.drafters.moa_core import MEMORY_TOKENS
from sglang_ext.models.checkpoint import CheckpointError
from sglang_ext.models.graph_runner import GraphRunner, bucket, context_buckets, static_attention, static_plan
from sglang_ext.sampling import SamplingParams
from sglang_ext.tree import TREE_FIELDS, TreeShape

gpu = pytest.mark.gpu


def _prefill(model, kv, lens: list[int], seed: int = 0) -> list[torch.Tensor]:
    """Each request's prompt of random tokens prefilled eagerly; returns their committed slots."""
    g = torch.Generator().manual_seed(seed)
    prefixes = []
    for n in lens:
        s = kv.alloc(n)
        ids = torch.randint(0, model.cfg.vocab_size, (n,), generator=g)
        model.forward(ids, torch.arange(n), s, plan_attention([s], [causal_mask(n, 0)]), kv)
        prefixes.append(s)
    return prefixes


def _tree_mask(parents: list[int]) -> torch.Tensor:
    n = len(parents)
    m = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        m[i] |= m[parents[i]]
    return m


# a decode step (root-only trees) and verify steps (trees of several shapes side by side)
BATCHES = {
    "decode-bs1": ([[-1]], [5]),
    "decode-bs3": ([[-1], [-1], [-1]], [5, 9, 2]),
    "verify-bs1": ([[-1, 0, 0, 1, 2]], [7]),
    "verify-bs3": ([[-1, 0, 1], [-1], [-1, 0, 0, 1, 1, 3]], [4, 11, 6]),
}


@pytest.mark.parametrize("model_kind", ["tiny", "smollm2"])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_static_path_equals_eager_forward(batch, model_kind, request):
    target = tiny_target(vocab=64, hidden=64, heads=4, kv_heads=2) if model_kind == "tiny" else None
    if target is None:
        target = request.getfixturevalue("smollm2_fp32")
    model = target.model
    parents, prefix_lens = BATCHES[batch]
    kv = model.new_kv_pool(256)
    prefixes = _prefill(model, kv, prefix_lens)
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, model.cfg.vocab_size, (len(p),), generator=g) for p in parents]
    trees = [_tree_mask(p) for p in parents]
    depth = [t.sum(1) - 1 for t in trees]
    pos = [n + d for n, d in zip(prefix_lens, depth)]
    slots = [kv.alloc(len(p)) for p in parents]
    layers = (0, len(model.layers) // 2)
    plan = plan_attention(
        [torch.cat([p, s]) for p, s in zip(prefixes, slots)],
        [prefix_and_tree_mask(t, p.numel()) for t, p in zip(trees, prefixes)],
    )
    eager = model.forward(torch.cat(ids), torch.cat(pos), torch.cat(slots), plan, kv, layers)
    tree_kv = [(kv.k[li][torch.cat(slots)].clone(), kv.v[li][torch.cat(slots)].clone()) for li in range(len(kv.k))]
    # buckets that pad the batch (3 -> 4), the nodes (1 -> 2, 3/6 -> 8) and the context (-> 16)
    runner = GraphRunner(model, layers, graphs=False, batch_buckets=(1, 4), node_buckets=(2, 8), context=(16, 64))
    static = runner.run(ids, pos, slots, prefixes, trees, kv)
    assert not runner.graphs and runner.runs == 1
    assert static.hidden.shape == eager.hidden.shape
    torch.testing.assert_close(static.hidden, eager.hidden, atol=1e-4, rtol=1e-4)
    for l in layers:
        torch.testing.assert_close(static.captured[l], eager.captured[l], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(model.logits(static.hidden), model.logits(eager.hidden), atol=1e-3, rtol=1e-4)
    assert torch.equal(model.logits(static.hidden).argmax(-1), model.logits(eager.hidden).argmax(-1))
    # the tree's K/V as the eager forward wrote it; padded rows wrote nothing but the scratch slot 0
    untouched = torch.ones(kv.num_slots, dtype=torch.bool)
    untouched[torch.cat(prefixes + slots)] = False
    untouched[0] = False
    for li, (k, v) in enumerate(tree_kv):
        torch.testing.assert_close(kv.k[li][torch.cat(slots)], k, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(kv.v[li][torch.cat(slots)], v, atol=1e-4, rtol=1e-4)
        assert not kv.k[li][untouched].any() and not kv.v[li][untouched].any()


def test_padding_never_changes_a_real_row():
    """The same batch in a bigger bucket (more padded requests, nodes and prefix columns) gives the same
    rows up to the matmuls' rounding (their blocking changes with the shape): padded columns get weight
    exactly 0, padded rows touch no real row."""
    model = tiny_target(vocab=64, hidden=64, heads=4, kv_heads=2).model
    kv = model.new_kv_pool(128)
    prefixes = _prefill(model, kv, [6, 3])
    trees = [_tree_mask([-1, 0, 0]), _tree_mask([-1, 0])]
    ids = [torch.tensor([3, 4, 5]), torch.tensor([7, 8])]
    pos = [torch.tensor([6, 7, 7]), torch.tensor([3, 4])]
    slots = [kv.alloc(3), kv.alloc(2)]
    tight = GraphRunner(model, graphs=False, batch_buckets=(2,), node_buckets=(3,), context=(6,))
    loose = GraphRunner(model, graphs=False, batch_buckets=(8,), node_buckets=(16,), context=(64,))
    assert tight.bucket_of([3, 2], [6, 3]) == (2, 3, 6) and loose.bucket_of([3, 2], [6, 3]) == (8, 16, 64)
    a = tight.run(ids, pos, slots, prefixes, trees, kv).hidden
    b = loose.run(ids, pos, slots, prefixes, trees, kv).hidden
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_inputs_placed_on_the_device_fill_the_buffers_as_host_packing_does():
    """Trees built on the device (tokens, positions, masks) are copied into the buffers on the device
    (_place) instead of being packed on the host: the same buffers."""
    from sglang_ext.models.graph_runner import _host_inputs, _place

    key, q_lens = (4, 8, 16), [3, 1, 6]
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 50, (n,), generator=g) for n in q_lens]
    pos = [torch.arange(n) + 7 for n in q_lens]
    slots = [torch.arange(n) + 20 * (i + 1) for i, n in enumerate(q_lens)]
    prefixes = [torch.arange(5), torch.arange(9), torch.arange(2)]
    masks = [_tree_mask([-1] + list(range(n - 1))) for n in q_lens]
    packed = _host_inputs(key, q_lens, slots, prefixes, ids, pos, masks)
    longs, mask = _host_inputs(key, q_lens, slots, prefixes)
    assert not torch.equal(longs, packed[0])
    rows = torch.cat([torch.arange(i * 8, i * 8 + n) for i, n in enumerate(q_lens)])
    bufs = {"longs": longs.clone(), "mask": mask.clone()}
    _place(bufs, key, rows, ids, pos, masks)
    assert torch.equal(bufs["longs"], packed[0]) and torch.equal(bufs["mask"], packed[1])


def _host_inputs_loop(key, q_lens, out_slots, prefixes, ids=None, positions=None, tree_masks=None):
    """_host_inputs request by request (the reference its batch-wide scatters must equal)."""
    b, q, p = key
    tok, pos, slot = (torch.zeros(b, q, dtype=torch.long) for _ in range(3))
    prefix, prefix_len = torch.zeros(b, p, dtype=torch.long), torch.zeros(b, dtype=torch.long)
    mask = torch.eye(q, dtype=torch.bool).repeat(b, 1, 1)
    for i, (n, s, pre) in enumerate(zip(q_lens, out_slots, prefixes)):
        slot[i, :n], prefix[i, : pre.numel()], prefix_len[i] = s, pre, pre.numel()
        if ids is not None:
            tok[i, :n], pos[i, :n], mask[i, :n, :n] = ids[i], positions[i], tree_masks[i]
    return torch.cat([tok.view(-1), pos.view(-1), slot.view(-1), prefix.view(-1), prefix_len]), mask


@pytest.mark.parametrize("sizes", [[3, 1, 6], [1, 1, 1, 1], [5, 5], [4, 1, 4], [1, 4, 4, 1, 2], [2], [2] * 8])
def test_host_inputs_scatter_the_batch_as_a_loop_per_request_does(sizes):
    """The bucket's host inputs in a fixed number of ops (one scatter per kind) equal the per-request loop,
    for trees of one size, of mixed sizes, root-only ones, empty prefixes; and placed on the device (_place)."""
    from sglang_ext.models.graph_runner import _host_inputs, _place, _real_rows

    g = torch.Generator().manual_seed(len(sizes))
    key = (8, 8, 16)
    ids = [torch.randint(0, 50, (n,), generator=g) for n in sizes]
    pos = [torch.arange(n) + 7 * i for i, n in enumerate(sizes)]
    slots = [torch.randint(1, 99, (n,), generator=g) for n in sizes]
    prefixes = [torch.randint(1, 99, (int(torch.randint(0, 17, (), generator=g)),), generator=g) for _ in sizes]
    prefixes[0] = torch.empty(0, dtype=torch.long)
    masks = [_tree_mask([-1] + [int(torch.randint(0, j, (), generator=g)) for j in range(1, n)]) for n in sizes]
    for args in ((), (ids, pos, masks)):
        got, want = (
            _host_inputs(key, sizes, slots, prefixes, *args),
            _host_inputs_loop(key, sizes, slots, prefixes, *args),
        )
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), args
    longs, mask = _host_inputs(key, sizes, slots, prefixes)
    bufs = {"longs": longs.clone(), "mask": mask.clone()}
    _place(bufs, key, torch.tensor(_real_rows(sizes, key[1])), ids, pos, masks)
    want = _host_inputs_loop(key, sizes, slots, prefixes, ids, pos, masks)
    assert torch.equal(bufs["longs"], want[0]) and torch.equal(bufs["mask"], want[1])
    assert torch.equal(_host_inputs(key, [], [], [])[0], _host_inputs_loop(key, [], [], [])[0])
    if all(n == sizes[0] for n in sizes):  # every request fills a bucket of its Q rows: placed by slices
        key = (len(sizes) + 1, sizes[0], 16)
        longs, mask = _host_inputs(key, sizes, slots, prefixes)
        bufs = {"longs": longs.clone(), "mask": mask.clone()}
        _place(bufs, key, None, ids, pos, masks)
        want = _host_inputs_loop(key, sizes, slots, prefixes, ids, pos, masks)
        assert torch.equal(bufs["longs"], want[0]) and torch.equal(bufs["mask"], want[1])


def test_static_attention_masks_padding_and_keeps_rows_apart():
    """static_attention against a dense softmax per request: prefix columns past prefix_len and tree
    columns outside the mask get no weight."""
    g = torch.Generator().manual_seed(0)
    k_pool, v_pool = torch.randn(20, 2, 8, generator=g), torch.randn(20, 2, 8, generator=g)
    q = torch.randn(2 * 3, 4, 8, generator=g)
    prefix = torch.tensor([[5, 6, 7, 0], [9, 0, 0, 0]])
    prefix_len = torch.tensor([3, 1])
    extra = torch.tensor([[1, 2, 3], [4, 0, 0]])
    tree = torch.stack([_tree_mask([-1, 0, 0]), torch.eye(3, dtype=torch.bool)])
    out = static_attention(q, k_pool, v_pool, static_plan(prefix, prefix_len, extra, tree), 0.5)
    for b in range(2):
        for j in range(3):
            cols = prefix[b, : prefix_len[b]].tolist() + [int(extra[b, i]) for i in range(3) if tree[b, j, i]]
            for h in range(4):
                w = (k_pool[cols, h // 2] @ q[b * 3 + j, h] * 0.5).softmax(0)
                torch.testing.assert_close(out[b * 3 + j, h], w @ v_pool[cols, h // 2], atol=1e-5, rtol=1e-5)


def test_bucket_selection_and_fallback():
    model = tiny_target().model
    r = GraphRunner(model, graphs=False, batch_buckets=(1, 2, 4), node_buckets=(1, 8), context=(32, 64), max_rows=16)
    assert bucket(3, (1, 2, 4)) == 4 and bucket(5, (1, 2, 4)) is None
    assert r.bucket_of([1], [10]) == (1, 1, 32)
    assert r.bucket_of([1, 1, 1], [40, 3, 3]) == (4, 1, 64)
    assert r.bucket_of([1, 5], [3, 3]) == (2, 8, 32)
    assert r.bucket_of([1] * 5, [3] * 5) is None  # batch over the largest bucket
    assert r.bucket_of([9], [3]) is None  # a tree over the largest node bucket
    assert r.bucket_of([1], [65]) is None  # a context over the largest context bucket
    assert r.bucket_of([8, 8, 8], [3] * 3) is None  # 4 x 8 rows > max_rows
    assert r.bucket_of([], []) is None and not r.can_run([2], [70])
    assert context_buckets(1000) == (128, 256, 512, 1024) and context_buckets(128) == (128,)
    assert GraphRunner(model, graphs=False).context[-1] >= model.cfg.max_position
    assert not GraphRunner(model).graphs  # graphs only on CUDA: the static path runs eagerly here
    kv = model.new_kv_pool(16)
    with pytest.raises(ValueError, match="fits no graph bucket"):
        r.run([torch.tensor([1] * 9)], [torch.arange(9)], [kv.alloc(9)], [torch.empty(0, dtype=torch.long)], [], kv)
    with pytest.raises(ValueError, match="tree mask"):
        r.run([torch.tensor([1, 2])], [torch.arange(2)], [kv.alloc(2)], [kv.alloc(1)], [torch.eye(3).bool()], kv)
    with pytest.raises(ValueError, match="increasing"):
        GraphRunner(model, batch_buckets=(4, 2))


DEVICES = ["cpu", pytest.param("cuda", marks=gpu)]


def _target_on(device: str, request):
    return request.getfixturevalue("smollm2_fp32") if device == "cpu" else _cuda_target()


@pytest.mark.parametrize("device", DEVICES)
def test_a_searchs_packed_trees_verify_as_the_same_trees_placed_one_by_one(device):
    """A verify of one search's trees (unpack_trees of its padded batch: 3 requests of 4, 6 nodes each, orphans
    and unlinked nodes among them) takes the batch whole (the "packed" bucket: two device copies, no node
    padding; captured and replayed on CUDA) and gives what the same trees give placed tree by tree (the "verify"
    bucket): logits, argmax, greedy paths, the invalid-token flags and the captured rows; an assigned field (the
    trees no longer the batch's) takes the other path."""
    from sglang_ext.tree import tree_batch, unpack_trees

    model = tiny_target(vocab=64, hidden=64, heads=4, kv_heads=2).model if device == "cpu" else _cuda_target().model
    kv = model.new_kv_pool(256)
    prefixes = _prefill(model, kv, [9, 4, 13])
    g = torch.Generator().manual_seed(4)
    lens = [p.numel() for p in prefixes]
    flat_parent = torch.tensor([-1, -1, 0, 1, 2, -1, 4, 3, 6])
    selected = torch.stack([torch.randperm(9, generator=g)[:5].sort().values for _ in range(4)])
    tokens = torch.randint(0, 64, (4, 5), generator=g)
    tokens[1, 2] = model.cfg.vocab_size + 6  # (a drafted token outside the vocabulary: never accepted, flagged)
    keep = torch.rand(4, 5, generator=g) > 0.2
    roots, seq = torch.randint(0, 64, (4,), generator=g), torch.tensor([*lens, 0])
    dev = model.device
    longs, mask, scores = (
        x.to(dev) for x in tree_batch(roots, selected, tokens, torch.rand(4, 5), flat_parent[selected], seq, keep)
    )
    packed = unpack_trees(longs, mask, scores, None, 3)
    plain = [replace(t, batch=None) for t in packed]
    runner = GraphRunner(model, (1,), graphs=device == "cuda")
    outs = []
    for trees in (packed, plain, packed):  # (on CUDA: the packed bucket's capture, then a replay)
        slots = [kv.alloc(6) for _ in trees]
        ids, pos, masks = ([getattr(t, n) for t in trees] for n in ("draft_tokens", "positions", "tree_mask"))
        fwd, greedy = runner.run(ids, pos, slots, prefixes, masks, kv, [0, 1, 2], trees)
        outs.append([greedy.logits, greedy.argmax, greedy.nodes[:, :6], greedy.tokens[:, :6], greedy.bad])
        outs[-1] = [x.clone() for x in outs[-1]] + [fwd.captured[1].clone()]
        for s in slots:
            kv.free(s)
        runner.forget(0), runner.forget(1), runner.forget(2)
    assert [k[-1] for k in runner.cache.entries] == ["packed", "verify"]
    for a, b in zip(outs[0], outs[1]):  # (up to the matmuls' rounding: their blocking changes with the shape)
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)
    assert torch.equal(outs[0][1], outs[1][1]) and torch.equal(outs[0][3], outs[1][3])
    assert outs[0][4].tolist() == [False, True, False] and all(torch.equal(a, b) for a, b in zip(outs[0], outs[2]))
    packed[0].draft_tokens = packed[0].draft_tokens.clone()  # (a field assigned: no longer the batch's trees)
    assert not packed[0].batch.holds(packed)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("b,kk,depth", [(1, 1, 1), (3, 2, 2), (2, 3, 3)])
def test_eagle3_frontier_step_static_equals_eager(b, kk, depth, device, request):
    """The EAGLE-3 drafter's frontier step through its FrontierRunner (batch and nodes padded to the
    buckets; captured and replayed on CUDA) == its eager step over plan_frontier: outputs and draft
    logits, same argmax."""
    target = _target_on(device, request)
    d = make_drafter("eagle3", target)
    g = torch.Generator().manual_seed(b * 10 + kk)
    h = target.cfg.hidden_size

    def fill(slots):  # K/V of earlier draft steps
        shape = (slots.numel(), *d.kv.k[0].shape[1:])
        d.kv.k[0][slots] = torch.randn(shape, generator=g).to(d.kv.device, d.kv.k[0].dtype)
        d.kv.v[0][slots] = torch.randn(shape, generator=g).to(d.kv.device, d.kv.v[0].dtype)

    prefixes = [d.kv.alloc(n) for n in (9, 4, 20)[:b]]
    for p in prefixes:
        fill(p)
    # each node's path through `depth` passes of kk nodes per request, parents drawn at random
    paths = FrontierPaths.start(b, device)
    for step in range(depth):
        new = d.kv.alloc(b * kk)
        if step + 1 < depth:
            fill(new)  # (the last pass's K/V is the step's own write)
        parent = None if step == 0 else torch.randint(0, kk, (b, kk), generator=g).to(device)
        paths = paths.advance(new, parent)
    pos = torch.tensor([p.numel() + depth - 1 for p in prefixes for _ in range(kk)])
    ids = torch.randint(0, d.hot_ids.numel(), (b * kk,), generator=g).to(device)
    feat = torch.randn(b * kk, h, generator=g).to(device)
    plan = plan_frontier(prefixes, paths.slots, paths.seen, device=device)
    out = d._layer(d.hot_ids[ids], feat, pos.to(device), new, plan)
    logits = d.draft.logits(out).float()
    for _ in range(2):  # on CUDA: the capture, then a replay
        static = d._frontier(d.hot_ids[ids], feat, pos, new, prefixes, paths)
    assert static is not None and d._steps.runs == 2 and d._steps.cache.graphs == (device == "cuda")
    torch.testing.assert_close(static[0], out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(static[1], logits, atol=1e-3, rtol=1e-4)
    assert torch.equal(static[1].argmax(-1), logits.argmax(-1))
    # outside the buckets (65 temporary slots per request): None, the caller's eager step runs
    rows = {"positions": pos, "slots": new}
    wide = (torch.arange(100, 165).repeat(b, 1), torch.ones(b, kk, 65, dtype=torch.bool, device=device))
    assert d._steps.run(ids, feat, rows, {"draft": (prefixes, *wide)}, (d.kv,)) is None
    assert d._steps.bucket_of(65, 1, {"draft": (3, 1)}) is None and d._steps.bucket_of(1, 65, {"draft": (3, 1)}) is None
    assert d._steps.bucket_of(1, 1, {"draft": (1 << 20, 1)}) is None


@pytest.mark.parametrize("device", DEVICES)
def test_eagle3_static_extend_equals_eager(device, request):
    """The EAGLE-3 drafter's draft-extend through its ExtendRunner (one graph: prefixes from its slot table on the
    device, extended there by the new pairs' slots) == its eager extend, round after round of verified tokens (1
    to 5 per request): odd rounds compare each request's root output (the extend alone, as before a sampled
    chain), even rounds the trees of a whole propose (the extend and the search in one graph). The first round's
    extend is past the buckets (a 70-token prompt): it runs eagerly and its search alone (the SearchRunner, sending
    the prefixes the table lacks); the next extend sends the table what it lacks. After each static extend the
    table holds every request's pairs, so the search reads its prefixes there."""
    target = _target_on(device, request)
    eager, static = make_drafter("eagle3", target), make_drafter("eagle3", target)
    static.step_graphs = True
    g = torch.Generator().manual_seed(5)
    ht = target.cfg.hidden_size
    params, shape = SamplingParams(max_new_tokens=8), TreeShape(3, 2, 6)

    def hidden(n):
        return {l: torch.randn(n, ht, generator=g).to(device) for l in eager.capture_layers}

    tokens = {rid: torch.randint(0, 1000, (n,), generator=g).tolist() for rid, n in ((7, 9), (8, 4), (9, 70))}
    for rid, t in tokens.items():
        cap = TargetCapture(t, torch.arange(len(t)), torch.arange(len(t)), hidden(len(t)))
        for d in (eager, static):
            d.add_request(rid, cap)
    for step in range(4):
        for t in tokens.values():
            t.append(int(torch.randint(0, 1000, (1,), generator=g)))  # the root
        batch = [DraftInput(rid, t, params, None, []) for rid, t in tokens.items()]
        if step % 2:  # (on CUDA: captured on a bucket's first use)
            torch.testing.assert_close(static._extend(batch), eager._extend(batch), atol=1e-4, rtol=1e-4)
        else:
            for x, y in zip(eager.propose(batch, shape), static.propose(batch, shape)):
                assert torch.equal(x.draft_tokens, y.draft_tokens) and torch.equal(x.parents, y.parents)
        table, slots = static._extender.table, [static.reqs[rid].slots for rid in tokens]
        rows, cells, _, _ = table.pending(list(tokens), slots, 8)  # what a search would send: nothing lacking
        assert not any(cells)  # (after the eager first extend, its search sent the table what it lacked)
        assert all(torch.equal(table.table[r, : x.numel()].cpu(), x) for r, x in zip(rows, slots))
        for rid, t in tokens.items():  # 1 to 5 verified tokens each (the root and accepted drafts)
            k = 1 + (rid + step) % 5
            t += torch.randint(0, 1000, (k - 1,), generator=g).tolist()
            cap = TargetCapture(t[-k:], torch.arange(len(t) - k, len(t)), torch.arange(k), hidden(k))
            for d in (eager, static):
                d.commit(rid, cap)
    assert static._extender.runs == 3 and static._search.runs == 1
    assert static._extender.cache.graphs == (device == "cuda")
    assert eager._extender is None and eager.kv.num_free == static.kv.num_free + static._held.host.numel()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sampled", [False, True])
def test_moa_static_commit_equals_eager(device, sampled, request):
    """MoA's commit of queued verified tokens (their LSA memory, CA and SA K/V) as its RowRunner's function (each
    token alone) stores what its eager _flush stores: two drafters hear the same requests and commits of an engine
    serving three prompts; at every propose the static one's pools hold, at its slots, the eager one's K/V, and their
    slot lists are as long. Greedy, the commit runs first in its search's graph, and the search, reading the slot
    tables it appended to, proposes the eager trees; sampled chains (no static search), it runs alone. A prompt
    longer than MEMORY_TOKENS (the chat template's) is flushed eagerly by both (memory for its last tokens only)."""
    target = _target_on(device, request)
    eager, static = make_drafter("moa", target), make_drafter("moa", target)
    static.step_graphs = True
    adding, add, commit = [], eager.add_request, eager.commit

    def hear(rid, cap, first=True):  # the static drafter hears what the eager one hears (add_request commits too)
        if not adding:
            (static.add_request if first else static.commit)(rid, cap)
        adding.append(first)
        try:
            (add if first else commit)(rid, cap)
        finally:
            adding.pop()

    eager.add_request, eager.commit = hear, lambda rid, cap: hear(rid, cap, False)
    propose, checked, flushed = eager.propose, [], []

    def compare(batch, shape):
        queued = [sum(c.slots.numel() for c in static.reqs[d.rid].pending) for d in batch]
        flushed.append(max(queued) > MEMORY_TOKENS)
        got = static.propose(batch, shape)  # (its static commit, then its static search, reading the slot tables)
        trees = propose(batch, shape)  # (the eager flush, then the search)
        for x, y in zip(trees, got):  # (sampled chains: each drafter's own draws)
            assert sampled or (torch.equal(x.draft_tokens, y.draft_tokens) and torch.equal(x.parents, y.parents))
        for d in batch:
            a, b = eager.reqs[d.rid], static.reqs[d.rid]
            assert torch.equal(a.target_slots, b.target_slots) and not b.pending
            for pa, pb, x, y in (
                (eager.mem, static.mem, a.memory_of_tokens(), b.memory_of_tokens()),
                (eager.sa, static.sa, a.sa_slots, b.sa_slots),
            ):
                assert x.numel() == y.numel() == a.target_slots.numel() and torch.equal(x < 0, y < 0)
                x, y = x[x >= 0], y[y >= 0]
                torch.testing.assert_close(pb.k[0][y], pa.k[0][x], atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(pb.v[0][y], pa.v[0][x], atol=1e-4, rtol=1e-4)
        checked.append(len(batch))
        return trees

    eager.propose = compare
    prompts = [target.encode_chat([{"role": "user", "content": t}]) for t in ("Name three rivers.", "Hi!", "7*8?")]
    tree = TreeShape(3, 1, 4) if sampled else TreeShape(2, 2, 3)
    params = SamplingParams(max_new_tokens=4, temperature=0.8 if sampled else 0.0, seed=3)
    Engine(target, eager, EngineConfig(tree=tree, adaptive=False, cuda_graphs=False)).generate(prompts, params)
    assert flushed[0] and not any(flushed[1:]) and static._commits.runs == len(checked) - 1 >= 2
    assert static._search.runs == (0 if sampled else len(checked))  # (sampled: each commit alone, in its graph)
    assert static._commits.cache.graphs == (device == "cuda") and bool(static._commits.cache.entries) == sampled


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tree", ["3,2,6", "6,4,24"])
@pytest.mark.parametrize("name", ["moa", "moa-tli0"])
def test_moa_static_draft_passes_propose_the_eager_trees(name, tree, device, request):
    """The MoA drafter's whole search through its SearchRunner (3 requests: batch padded to 4; every pass
    with SA, CA and TLI plans in static form; captured and replayed on CUDA) proposes the trees its eager
    passes propose, from the same state."""
    target = _target_on(device, request)
    config = EngineConfig(tree=TreeShape.parse(tree), cuda_graphs=False)
    try:
        drafter = make_drafter(name, target)
    except CheckpointError as e:  # (a GPU job stages only some of the shipped heads)
        pytest.skip(str(e))
    eng = Engine(target, drafter, config)
    prompts = [target.encode_chat([{"role": "user", "content": t}]) for t in ("Name three rivers.", "Hi!", "7*8?")]
    reqs = [eng.add_request(p, SamplingParams(max_new_tokens=8)) for p in prompts]
    eng.step()  # prefill: each request's first token, the drafter's add_request
    batch = [DraftInput(r.rid, r.token_ids, r.params, r.generator, r.reference) for r in reqs]
    d = eng.drafter
    eager = d.propose(batch, TreeShape.parse(tree))  # (ingests the prompts: their SA / memory slots)
    free = (d.sa.num_free, eng.kv.num_free)
    d.step_graphs = True
    for _ in range(2):  # on CUDA: the captures, then replays
        static = d.propose(batch, TreeShape.parse(tree))
    # the roots' pass and both search steps in one static search, twice
    assert d._search.runs == 2 and d._steps is None and d._search.cache.graphs == (device == "cuda")
    # temporary slots freed either way (the static search's SA ones held for good: one table for every batch)
    assert (d.sa.num_free + d._held.host.numel(), eng.kv.num_free) == free
    for a, b in zip(eager, static):
        for name in (
            "draft_tokens",
            "parents",
            "positions",
            "tree_mask",
            "retrieve_next_token",
            "retrieve_next_sibling",
        ):
            assert torch.equal(getattr(a, name), getattr(b, name)), name


def _kept(out: list, trees: list) -> list:
    """trees, with copies of them appended to out."""
    copy = lambda t: {f: getattr(t, f).clone() for f in TREE_FIELDS if getattr(t, f) is not None}  # noqa: E731
    out.append([replace(t, batch=None, **copy(t)) for t in trees])
    return trees


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tree", ["3,2,6", "6,4,24", "4,1,5"])
def test_eagle3_static_search_proposes_the_eager_trees(tree, device, request):
    """The EAGLE-3 drafter's draft-extend and whole search in one graph (its ExtendRunner with the search after
    the extend; 3 requests padded to 4; captured and replayed on CUDA) proposes the trees of its eager extend and
    step-by-step eager search: two engines serving the same requests, every TokenTree field of every proposal
    compared."""
    target = _target_on(device, request)
    shape = TreeShape.parse(tree)
    prompts = [target.encode_chat([{"role": "user", "content": t}]) for t in ("Name three rivers.", "Hi!", "7*8?")]
    proposals = ([], [])
    drafters = []
    for static in (False, True):
        d = make_drafter("eagle3", target)
        d.step_graphs = static
        propose = d.propose
        # (copies kept: a static search's trees are views of its graph's outputs, valid until its next run)
        d.propose = lambda batch, shape, propose=propose, out=proposals[static]: _kept(out, propose(batch, shape))
        eng = Engine(target, d, EngineConfig(tree=shape, cuda_graphs=False))
        eng.generate(prompts, SamplingParams(max_new_tokens=8))
        drafters.append(d)
    assert len(proposals[0]) == len(proposals[1]) >= 2  # (on CUDA: the capture, then replays)
    fields = ("draft_tokens", "parents", "positions", "tree_mask", "retrieve_index", "retrieve_next_token")
    for eager, static in zip(*proposals):
        for a, b in zip(eager, static):
            for name in (*fields, "retrieve_next_sibling"):
                assert torch.equal(getattr(a, name), getattr(b, name)), name
            torch.testing.assert_close(a.scores, b.scores)
            assert bool(a.finite) and bool(b.finite)
    d = drafters[1]
    # (the draft-extend and the whole search in one graph: the extend runner's)
    assert d._extender.runs == len(proposals[1]) and d._search is None and d._steps is None
    assert d._extender.cache.graphs == (device == "cuda")
    assert d.kv.num_free + d._held.host.numel() == drafters[0].kv.num_free  # temporary slots freed (or held)


@pytest.mark.parametrize("device", DEVICES)
def test_draft_model_static_steps_propose_the_eager_trees(device, request):
    """The self-draft model's search steps through its FrontierRunner (3 requests padded to 4; captured
    and replayed on CUDA) propose the trees of its eager steps: two drafters fed the same requests."""
    target = _target_on(device, request)
    prompts = [target.encode_chat([{"role": "user", "content": t}]) for t in ("Name three rivers.", "Hi!", "7*8?")]
    params = SamplingParams(max_new_tokens=8)
    batch = [DraftInput(i, p, params, None, []) for i, p in enumerate(prompts)]
    eager, static = make_drafter("draft-model", target), make_drafter("draft-model", target)
    static.step_graphs = True
    for d in (eager, static):
        for x in batch:
            ids = torch.arange(len(x.token_ids))
            d.add_request(x.rid, TargetCapture(x.token_ids, ids, ids))
    for _ in range(2):  # on CUDA: the captures, then replays (the second propose has nothing new to extend)
        batch = [DraftInput(x.rid, x.token_ids + [x.token_ids[-1]], params, None, []) for x in batch]
        a, b = eager.propose(batch, TreeShape(3, 2, 6)), static.propose(batch, TreeShape(3, 2, 6))
        for x, y in zip(a, b):
            assert torch.equal(x.draft_tokens, y.draft_tokens) and torch.equal(x.parents, y.parents)
    assert static._steps.runs == 4 and static._steps.cache.graphs == (device == "cuda")
    assert eager._steps is None and eager.kv.num_free == static.kv.num_free


def _outputs(engine: Engine, prompts: list[list[int]], bs: int, n: int) -> list[list[int]]:
    outs = []
    for i in range(0, len(prompts), bs):
        outs += [r.output_ids for r in engine.generate(prompts[i : i + bs], SamplingParams(max_new_tokens=n))]
    assert slots_whole(engine), "KV slots leaked"
    return outs


@pytest.mark.parametrize("drafter,bs", [(None, 1), (None, 4), ("eagle3", 1), ("eagle3", 4), ("moa", 1), ("moa", 4)])
def test_engine_tokens_with_the_static_path_equal_eager(smollm2_fp32, eval_prompts, drafter, bs):
    """An engine whose decode / verify steps take the runner's static path (forced on the CPU) gives the
    eager engine's greedy tokens; prefill steps and batches outside the buckets run eagerly."""
    prompts, n = eval_prompts[: max(bs, 2)], 12
    config = EngineConfig(tree=TreeShape(3, 2, 6) if drafter else None)

    def engine(runner_kw=None):
        eng = Engine(smollm2_fp32, make_drafter(drafter, smollm2_fp32) if drafter else None, config)
        assert eng.runner.graph_runner is None  # graphs are a CUDA feature: off on the CPU whatever the config
        if runner_kw is not None:
            eng.runner.graph_runner = GraphRunner(eng.model, eng.capture_layers, graphs=False, **runner_kw)
            if drafter:
                eng.drafter.step_graphs = True  # its frontier steps on the static path too
        return eng

    ref = _outputs(engine(), prompts, bs, n)
    eng = engine({})
    outs = _outputs(eng, prompts, bs, n)
    verdicts = [compare_to_reference(smollm2_fp32.model, p, r, o) for p, r, o in zip(prompts, ref, outs)]
    assert "bug" not in verdicts, verdicts
    assert eng.runner.graph_runner.runs > 0
    if drafter:
        assert static_runs(eng.drafter) > 0
        # the drafted steps verified the searches' packed trees whole (GraphRunner's "packed" buckets)
        assert any(k[-1] == "packed" for k in eng.runner.graph_runner.cache.entries), list(
            eng.runner.graph_runner.cache.entries
        )
    if bs == 4 and drafter is None:  # contexts over the buckets (every prompt is longer than 8 tokens): all eager
        small = engine({"context": (8,)})
        assert _outputs(small, prompts, bs, n) == ref and small.runner.graph_runner.runs == 0


# --- on CUDA: captured graphs replayed --------------------------------------------------------------


def _cuda_target():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from sglang_ext.models import load_target

    # fp32: graphs and eager attention differ in summation order; bf16 would turn that into token ties
    return load_target("smollm2", dtype="float32", device="cuda")


@gpu
@pytest.mark.parametrize("drafter", [None, "eagle3", "moa"])
@pytest.mark.parametrize("bs", [1, 4])
def test_cuda_graph_replay_equals_eager_tokens(drafter, bs):
    target = _cuda_target()
    prompts = [target.encode_chat([{"role": "user", "content": t}]) for t in ("Name three rivers.", "What is 7*8?")]
    prompts = (prompts * 2)[: max(bs, 2)]

    def outputs(graphs: bool):
        config = EngineConfig(device="cuda", cuda_graphs=graphs, tree=TreeShape(3, 2, 6) if drafter else None)
        eng = Engine(target, make_drafter(drafter, target) if drafter else None, config)
        assert (eng.runner.graph_runner is not None) == graphs
        return _outputs(eng, prompts, bs, 24), eng

    ref, _ = outputs(False)
    got, eng = outputs(True)
    assert eng.runner.graph_runner.graphs and eng.runner.graph_runner.runs > 0
    assert any(graph is not None for _, graph, _ in eng.runner.graph_runner.cache.entries.values())
    verdicts = [compare_to_reference(target.model, p, r, o) for p, r, o in zip(prompts, ref, got)]
    assert "bug" not in verdicts, verdicts


@gpu
def test_cuda_graph_replay_equals_the_static_path_eagerly():
    """One captured bucket replayed with new inputs gives the eager static path's outputs."""
    model = _cuda_target().model
    kv = model.new_kv_pool(512)
    prefixes = _prefill(model, kv, [30, 70, 5])
    trees = [_tree_mask([-1, 0, 1]), _tree_mask([-1]), _tree_mask([-1, 0, 0, 2])]
    g = torch.Generator().manual_seed(2)
    ids = [torch.randint(0, model.cfg.vocab_size, (t.shape[0],), generator=g) for t in trees]
    pos = [p.numel() + t.sum(1) - 1 for p, t in zip(prefixes, trees)]
    slots = [kv.alloc(t.shape[0]) for t in trees]
    graphs, eager = GraphRunner(model, (1, 15)), GraphRunner(model, (1, 15), graphs=False)
    graphs.run(ids, pos, slots, prefixes, trees, kv)  # capture (and a first replay)
    ids = [(i + 1) % model.cfg.vocab_size for i in ids]  # new inputs, same bucket: a replay
    got, ref = graphs.run(ids, pos, slots, prefixes, trees, kv), eager.run(ids, pos, slots, prefixes, trees, kv)
    assert len(graphs.cache.entries) == 1
    torch.testing.assert_close(got.hidden, ref.hidden, atol=1e-4, rtol=1e-4)
    for l in (1, 15):
        torch.testing.assert_close(got.captured[l], ref.captured[l], atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def random_bf16_target():
    """SmolLM2's shape with random weights in bf16 on CUDA: no staged files, and bf16 turns any
    difference in a forward's arithmetic into changed tokens."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from helpers import smollm2_config

    from sglang_ext.models import Target
    from sglang_ext.models.synthetic import random_target

    return Target(model=random_target(smollm2_config(), "cuda", dtype=torch.bfloat16), tokenizer=None, path=None)


def _repetitive_prompts(vocab: int, n: int) -> list[list[int]]:
    """Random 6-token phrases repeated (so lookup drafters find continuations), of different lengths."""
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (6,), generator=g).tolist() * (3 + i) for i in range(n)]


@gpu
@pytest.mark.parametrize("bs", [1, 4])
def test_bf16_graphs_equal_eager_and_drafters_equal_vanilla_exactly(random_bf16_target, bs):
    """bf16 on CUDA, greedy: the same tokens with graphs replayed and eagerly, and with a lookup drafter
    (verify trees of several rows) as with vanilla decoding (one row), with no tie excused: a graph's
    attention is the eager kernel in its padded form, so a row's arithmetic never depends on the batch,
    the bucket or the tree beside it."""
    target = random_bf16_target
    prompts = _repetitive_prompts(target.model.cfg.vocab_size, 4)
    runs, drafted = {}, {}
    for drafter, tree in ((None, None), ("ngram", TreeShape(6, 2, 12)), ("lookahead", TreeShape(3, 1, 4))):
        for graphs in (True, False):
            config = EngineConfig(tree=tree, cuda_graphs=graphs)
            eng = Engine(target, make_drafter(drafter, target) if drafter else None, config)
            reqs = [
                r
                for i in range(0, 4, bs)
                for r in eng.generate(prompts[i : i + bs], SamplingParams(max_new_tokens=48, ignore_eos=True))
            ]
            runs[drafter, graphs] = [r.output_ids for r in reqs]
            drafted[drafter, graphs] = sum(r.stats.draft_tokens for r in reqs)
            assert not graphs or eng.runner.graph_runner.runs > 0
    ref = runs[None, False]
    assert all(len(o) == 48 for o in ref)
    assert drafted["ngram", True] > 0 and drafted["lookahead", True] > 0  # verify trees were checked
    for key, outs in runs.items():
        first = [next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), None) for o, r in zip(outs, ref)]
        assert outs == ref, f"{key}: first differing token per prompt {first}"


@gpu
@pytest.mark.parametrize("path", ["graphs", "static-eager", "ragged-eager"])
def test_bf16_a_tree_row_equals_its_decode_bit_for_bit(random_bf16_target, path):
    """The lossless contract at its root: a verify tree's row (its K/V and hidden state at every layer)
    is bit for bit what decoding that token alone after the same committed tokens computes, in bf16 on
    CUDA. Token-level identity tests only see a difference that flips an argmax; this sees any."""
    diffs = tree_rows_against_decodes(random_bf16_target.model, path)
    assert not diffs, f"(chain position, first differing layer, max |diff|): {diffs}"


def test_padded_prefixes_equal_the_request_by_request_fill():
    """The runners' prefix table in one masked assignment equals it filled request by request."""
    from sglang_ext.models.draft_graphs import padded_prefixes

    gen = torch.Generator().manual_seed(0)
    for lens in ([5, 0, 17, 1], [32], []):
        prefixes = [torch.randint(1, 1000, (n,), generator=gen) for n in lens]
        prefix, prefix_len = padded_prefixes(prefixes, 8, 32)
        ref = torch.zeros(8, 32, dtype=torch.long)
        for i, p in enumerate(prefixes):
            ref[i, : p.numel()] = p
        assert torch.equal(prefix, ref)
        assert prefix_len.tolist() == lens + [0] * (8 - len(lens))
