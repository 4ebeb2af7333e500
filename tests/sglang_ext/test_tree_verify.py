"""Token-tree layout and verification on hand-built examples."""

import itertools
import random

import pytest
import torch
from oracles import coupled_verify, greedy_verify, sampling_verify

from sglang_ext.sampling import (
    InvalidRequest,
    SamplingParams,
    greedy_tokens,
    logits_to_probs,
    position_gumbel,
    seeded_sample,
)
from sglang_ext.tree import (
    TreeSearch,
    TreeShape,
    build_trees,
    chain_tree,
    root_tree,
    tree_batch,
    tree_from_parents,
    unpack_trees,
)
from sglang_ext.verify import greedy_path, greedy_paths, greedy_results, to_host

#        0 (root, token 10)
#       / \
#      1   2          tokens 11, 12
#     / \    \
#    3   4    5       tokens 13, 14, 15
PARENTS = torch.tensor([-1, 0, 0, 1, 1, 2])
TOKENS = torch.tensor([10, 11, 12, 13, 14, 15])


def test_layout_hand_checked():
    t = tree_from_parents(TOKENS, PARENTS, seq_len=7)
    assert t.positions.tolist() == [7, 8, 8, 9, 9, 9]
    assert t.retrieve_next_token.tolist() == [1, 3, 5, -1, -1, -1]
    assert t.retrieve_next_sibling.tolist() == [-1, 2, -1, 4, -1, -1]
    assert t.tree_mask[4].tolist() == [True, True, False, False, True, False]
    assert t.tree_mask[5].tolist() == [True, False, True, False, False, True]
    assert t.path_to(4) == [0, 1, 4]


@pytest.mark.parametrize("seed", range(6))
def test_a_host_trees_python_layout_is_the_tensor_ops_one(seed, monkeypatch):
    """tree_from_parents lays out a small host tree in Python (a lookup drafter's, every step): every field equals
    the tensor ops' layout (ancestor_masks, child_lists), on random trees of 2-64 nodes with unlinked nodes given as
    indices or as a bool mask, and a batch index."""
    import sglang_ext.tree as tree_mod

    g = random.Random(seed)
    for _ in range(20):
        n = g.randint(2, 64)
        parents = torch.tensor([-1] + [g.randrange(i) for i in range(1, n)])
        tokens = torch.randint(0, 1000, (n,))
        unlinked = {i for i in range(1, n) if g.random() < 0.2}
        as_mask = torch.tensor([i in unlinked for i in range(n)])
        for how in (sorted(unlinked), as_mask):
            args = (tokens, parents, g.randint(0, 500), g.randint(0, 3))
            fast = tree_from_parents(*args, unlinked=how)
            monkeypatch.setattr(tree_mod, "HOST_TREE_NODES", 0)
            ref = tree_from_parents(*args, unlinked=how)
            monkeypatch.undo()
            for name in ("draft_tokens", "parents", "positions", "tree_mask", "retrieve_index"):
                a, b = getattr(fast, name), getattr(ref, name)
                assert a.dtype == b.dtype and torch.equal(a, b), name
            for name in ("retrieve_next_token", "retrieve_next_sibling"):
                a, b = getattr(fast, name), getattr(ref, name)
                assert a.dtype == b.dtype and torch.equal(a, b), name


def test_parents_must_precede_children():
    with pytest.raises(ValueError):
        tree_from_parents(TOKENS, torch.tensor([-1, 0, 3, 1, 1, 2]), 0)


def test_tree_shape_validation_and_parse():
    assert TreeShape.parse("5") == TreeShape(5, 1, 6)
    assert TreeShape.parse("6,4,16") == TreeShape(6, 4, 16)
    for bad in ("0", "3,2", "a,b,c", "2,2,100", "2,1,5"):
        with pytest.raises(ValueError):
            TreeShape.parse(bad)


def _onehot_argmax(nodes_to_token):
    return torch.tensor(nodes_to_token)


@pytest.mark.parametrize(
    "target_argmax,nodes,tokens",
    [
        ([11, 14, 99, 99, 7, 99], [0, 1, 4], [11, 14, 7]),  # accept 1 then 4, bonus = argmax at 4
        ([12, 99, 15, 99, 99, 3], [0, 2, 5], [12, 15, 3]),  # second sibling
        ([42, 99, 99, 99, 99, 99], [0], [42]),  # nothing accepted: bonus only
        ([11, 13, 99, 5, 99, 99], [0, 1, 3], [11, 13, 5]),
    ],
)
def test_greedy_verify_table(target_argmax, nodes, tokens):
    t = tree_from_parents(TOKENS, PARENTS, 7)
    r = greedy_verify(t, torch.tensor(target_argmax))
    assert r.accepted_nodes == nodes and r.tokens == tokens and r.num_accepted == len(tokens) - 1


def test_search_orders_parents_first_and_keeps_best():
    torch.manual_seed(0)
    k, depth, n = 3, 4, 12
    s = TreeSearch.start(k)
    tokens, scores = s.first(*torch.softmax(torch.randn(2, 50), -1).topk(k))
    for step in range(1, depth):
        p, i = torch.softmax(torch.randn(2 * k, 50), -1).topk(k)
        tokens, scores, _ = s.expand(step, scores, p, i)
    trees = build_trees(torch.tensor([1, 2]), s, [5, 9], n)
    for t in trees:
        assert t.num_nodes == n and (t.parents[1:] < torch.arange(1, n)).all()
        assert t.positions.min() >= 5


def test_sampling_verify_point_mass_certain_accept():
    # target puts all mass on the drafted tokens: always accepted, whatever the coins say
    t = chain_tree(1, [2, 3], 0)
    probs = torch.zeros(3, 5)
    probs[0, 2] = probs[1, 3] = probs[2, 4] = 1.0
    r = sampling_verify(t, probs, torch.Generator().manual_seed(0))
    assert r.tokens == [2, 3, 4]


def test_sampling_verify_zero_prob_draft_rejected():
    t = chain_tree(1, [2], 0)
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5], [0.25] * 4])
    for seed in range(20):
        r = sampling_verify(t, probs, torch.Generator().manual_seed(seed))
        assert r.tokens[0] in (1, 3) and r.num_accepted == 0


def test_logits_to_probs_top_p_top_k():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert p[0, 2:].sum() == 0 and abs(float(p.sum()) - 1) < 1e-6
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=1))
    assert p[0].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert logits_to_probs(logits, SamplingParams()).argmax() == 0


def test_greedy_tokens_is_torch_argmax_with_ties_infinities_and_nans():
    """The CPU's argmax (numpy's) picks torch's index: the first of tied maxima, the first NaN, 1-D and strided rows,
    bf16 (upcast first)."""
    g = torch.Generator().manual_seed(0)
    for trial in range(300):
        x = torch.randn(3, 40, generator=g)
        x[torch.rand(3, 40, generator=g) < 0.15] = float("nan") if trial % 3 == 0 else 0.0
        if trial % 5 == 0:
            x[:, [7, 9]] = float("inf")
        if trial % 7 == 0:
            x[:] = -float("inf")
        if trial % 2:
            x = x.round()
        for rows in (x, x[0], x[:, ::3], x.bfloat16()):
            assert torch.equal(greedy_tokens(rows), rows.float().argmax(-1)), trial


@pytest.mark.parametrize(
    "kw",
    [
        dict(max_new_tokens=0),
        dict(max_new_tokens=-3),
        dict(temperature=-0.1),
        dict(temperature=float("nan")),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(top_k=-1),
    ],
)
def test_bad_sampling_params(kw):
    with pytest.raises(InvalidRequest):
        SamplingParams(**kw)


def _nucleus_by_full_sort(logits, temperature, top_p):
    probs = torch.softmax(logits.float() / temperature, -1)
    sp, idx = probs.sort(-1, descending=True)
    sp = sp.masked_fill((sp.cumsum(-1) - sp) >= top_p, 0.0)
    out = torch.zeros_like(probs).scatter_(-1, idx, sp)
    return out / out.sum(-1, keepdim=True)


@pytest.mark.parametrize(
    "scale", [8.0, 1.0, 0.05], ids=["peaky", "medium", "flat"]
)  # flat: nucleus wider than 4096 ids
def test_top_p_partial_topk_equals_full_sort(scale):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 49152, generator=g) * scale
    for temperature, top_p in [(0.7, 0.95), (1.0, 0.5), (1.3, 0.99)]:
        got = logits_to_probs(logits, SamplingParams(temperature=temperature, top_p=top_p))
        assert torch.allclose(got, _nucleus_by_full_sort(logits, temperature, top_p), atol=1e-7)


def test_sampling_verify_lazy_probabilities_same_result_fewer_rows():
    t = chain_tree(1, [2, 3, 1], 0)
    probs = torch.softmax(torch.randn(4, 6, generator=torch.Generator().manual_seed(1)), -1)
    for seed in range(30):
        seen = []
        lazy = sampling_verify(t, lambda i, seen=seen: seen.append(i) or probs[i], torch.Generator().manual_seed(seed))
        eager = sampling_verify(t, probs, torch.Generator().manual_seed(seed))
        assert lazy == eager and seen == lazy.accepted_nodes  # only the accepted path and its last node


# --- min_prob: nodes of low path probability are not verified --------------------------------
def _paths(tree) -> dict[tuple[int, ...], int]:
    """Token path (root excluded) -> node index, for every node but the root."""
    return {tuple(int(tree.draft_tokens[i]) for i in tree.path_to(n)[1:]): n for n in range(1, tree.num_nodes)}


def _hand_search() -> TreeSearch:
    """k = 2, three steps; path scores (products of the draft probabilities):
    step 0: a=10 0.6, b=11 0.3
    step 1: a->20 0.30, a->21 0.12, b->22 0.27, b->23 0.015   frontier: 20 (0.30), 22 (0.27)
    step 2: 20->30 0.15, 20->31 0.03, 22->32 0.108, 22->33 0.081"""
    s = TreeSearch.start(2)
    _, scores = s.first(torch.tensor([[0.6, 0.3]]), torch.tensor([[10, 11]]))
    _, scores, _ = s.expand(1, scores, torch.tensor([[0.5, 0.2], [0.9, 0.05]]), torch.tensor([[20, 21], [22, 23]]))
    s.expand(2, scores, torch.tensor([[0.5, 0.1], [0.4, 0.3]]), torch.tensor([[30, 31], [32, 33]]))
    return s


def test_min_prob_keeps_exactly_the_nodes_at_or_above_it():
    full = build_trees(torch.tensor([1]), _hand_search(), [5], 8)[0]
    assert set(_paths(full)) == {(10,), (11,), (10, 20), (11, 22), (10, 21), (10, 20, 30), (11, 22, 32)}  # the 7 best
    pruned = build_trees(torch.tensor([1]), _hand_search(), [5], 8, min_prob=0.12)[0]
    # 0.6, 0.3, 0.30, 0.27, 0.15, 0.12 reach 0.12; 0.108 (11, 22, 32) does not
    assert set(_paths(pruned)) == {(10,), (11,), (10, 20), (11, 22), (10, 21), (10, 20, 30)}
    assert pruned.num_nodes == 7 and (pruned.parents[1:] < torch.arange(1, 7)).all()
    assert sorted(pruned.positions.tolist()) == [5, 6, 6, 7, 7, 7, 8]  # seq_len + depth
    # every kept node hangs off its real parent (no orphan re-attached to the root)
    for path, n in _paths(pruned).items():
        assert _paths(pruned).get(path[:-1], 0) == int(pruned.parents[n])
    only_root = build_trees(torch.tensor([1]), _hand_search(), [5], 8, min_prob=0.7)[0]
    assert only_root.num_nodes == 1 and only_root.draft_tokens.tolist() == [1]


def _reachable(tree) -> set[tuple[int, ...]]:
    """Token paths (root excluded) of the nodes verification can reach (the retrieve lists)."""
    out, todo = set(), [(0, ())]
    nxt, sib = tree.retrieve_next_token.tolist(), tree.retrieve_next_sibling.tolist()
    while todo:
        node, path = todo.pop()
        child = nxt[node]
        while child != -1:
            p = path + (int(tree.draft_tokens[child]),)
            out.add(p)
            todo.append((child, p))
            child = sib[child]
    return out


@pytest.mark.parametrize("min_prob", [0.12, 0.28, 0.7])
def test_min_prob_on_a_device_unlinks_what_the_cpu_leaves_out(min_prob):
    """Without dropping (a device's trees keep their size): every searched node stays, and verification
    reaches exactly the nodes the CPU's dropped tree holds."""
    dropped = build_trees(torch.tensor([1]), _hand_search(), [5], 8, min_prob=min_prob)[0]
    kept = build_trees(torch.tensor([1]), _hand_search(), [5], 8, min_prob=min_prob, drop=False)[0]
    assert kept.num_nodes == 8
    assert _reachable(kept) == _reachable(dropped) == set(_paths(dropped))
    assert set(_paths(kept)) >= set(_paths(dropped))


def test_search_stops_drafting_once_every_frontier_node_is_below_min_prob():
    from sglang_ext.drafters.base import DraftInput
    from sglang_ext.drafters.search import search_tree

    vocab = 8
    root = torch.log(torch.tensor([[0.4, 0.3, 0.1, 0.1, 0.05, 0.05, 0.0, 0.0]]) + 1e-12)
    calls = []

    def step_fn(tokens, parent_beam):
        calls.append(tokens.shape)
        flat = torch.full((vocab,), 1.0 / vocab)  # children of probability 1/8: path scores <= 0.05
        return torch.log(flat).expand(tokens.shape[0], tokens.shape[1], vocab)

    batch = [DraftInput(0, [1, 2, 3], SamplingParams(), None)]
    tree = search_tree(root, step_fn, TreeShape(4, 2, 10, min_prob=0.06), batch)[0]
    assert len(calls) == 1  # step 1 ran (0.4, 0.3 >= 0.06); its children (<= 0.05) ended the search
    assert set(_paths(tree)) == {(0,), (1,)}
    calls.clear()
    tree = search_tree(root, step_fn, TreeShape(4, 2, 10, min_prob=0.5), batch)[0]
    assert not calls and tree.num_nodes == 1  # nothing worth drafting: the root alone (a plain decode)
    calls.clear()
    tree = search_tree(root, step_fn, TreeShape(4, 2, 10), batch)[0]
    assert len(calls) == 3 and tree.num_nodes == 10  # without min_prob: every step, N nodes


@pytest.mark.parametrize("native", [True, False], ids=["softmax_topk", "torch"])
@pytest.mark.parametrize("shape", ["1,2,3,0.1", "1,2,3", "1,3,4,0.2", "1,4,5,0.05", "1,1,2", "1,4,3,0.1"])
def test_a_one_level_search_written_out_is_the_searched_trees(shape, native, monkeypatch):
    """search_tree's one-level CPU path (the neural drafters' CPU default) gives every field of the trees that
    top_k_search + build_trees give (children kept, dropped by min_prob, or all dropped), request by request
    (1,4,3: fewer nodes than candidates, the searched path); its softmax + top-k as the layer ops' one call
    (scores to the last bit) or as torch's ops (bit for bit)."""
    from sglang_ext import kernels
    from sglang_ext.drafters.base import DraftInput
    from sglang_ext.drafters.search import search_tree, top_k_search

    if native and kernels.softmax_topk is None:
        pytest.skip("the CPU layer ops are not built here")
    if not native:
        monkeypatch.setattr(kernels, "softmax_topk", None)

    shape = TreeShape.parse(shape)
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(6, 50, generator=gen) * torch.tensor([0.5, 1, 2, 4, 8, 30])[:, None]
    logits[5, 3] = logits[5, 9] = 40.0  # a tie at the top
    batch = [DraftInput(i, list(range(3 + i)), SamplingParams(), None) for i in range(6)]

    def no_step(tokens, parent_beam):
        raise AssertionError("a one-level search runs no draft step")

    fast = search_tree(logits, no_step, shape, batch)
    search = top_k_search(logits, no_step, shape.topk, shape.depth, shape.min_prob)
    roots = torch.tensor([d.token_ids[-1] for d in batch])
    ref = build_trees(roots, search, [d.seq_len for d in batch], shape.num_draft_tokens, shape.min_prob)
    for a, b in zip(fast, ref):
        for name in ("draft_tokens", "parents", "positions", "tree_mask", "retrieve_index", "retrieve_next_token"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert torch.equal(a.retrieve_next_sibling, b.retrieve_next_sibling)
        assert a.scores.dtype == b.scores.dtype
        assert torch.allclose(a.scores, b.scores, rtol=1e-6) if native else torch.equal(a.scores, b.scores)
        assert bool(a.finite)


def test_tree_shape_min_prob_parses_labels_and_validates():
    s = TreeShape.parse("1,2,3,0.1")
    assert (s.depth, s.topk, s.num_draft_tokens, s.min_prob) == (1, 2, 3, 0.1) and s.label == "1,2,3,0.1"
    assert TreeShape.parse(s.label) == s and TreeShape.parse("3,1,4").label == "3,1,4"
    for bad in ("1,2,3,1.5", "1,2,3,-0.1", "1,2,3,x", "1,2,3,0.1,4"):
        with pytest.raises(ValueError):
            TreeShape.parse(bad)


def test_seeded_sample_is_a_sample_of_p_and_positions_are_independent():
    """Over seeds, the seeded token has the law p (within 5 sigma on 6,000 draws), the noise is a pure
    function of (seed, position), and two positions' draws are independent (agreement ~ sum p^2)."""
    p = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03, 0.0])
    draws = torch.tensor([seeded_sample(p, seed, 17) for seed in range(6000)])
    freq = torch.bincount(draws, minlength=6).double() / 6000
    sigma = (p.double() * (1 - p.double()) / 6000).sqrt()
    assert ((freq - p.double()).abs() <= 5 * sigma + 1e-12).all(), freq
    assert freq[5] == 0  # a token of probability 0 is never drawn
    assert torch.equal(position_gumbel(3, 5, 100), position_gumbel(3, 5, 100))
    assert not torch.equal(position_gumbel(3, 5, 100), position_gumbel(3, 6, 100))
    assert not torch.equal(position_gumbel(3, 5, 100), position_gumbel(4, 5, 100))
    other = torch.tensor([seeded_sample(p, seed, 18) for seed in range(6000)])
    agree, expected = (draws == other).double().mean(), float((p.double() ** 2).sum())
    assert abs(agree - expected) < 5 * (expected * (1 - expected) / 6000) ** 0.5, (agree, expected)


def _path_probs(path: list[int], vocab: int = 7) -> torch.Tensor:
    """A synthetic target: the next-token law is a fixed function of the context."""
    g = torch.Generator().manual_seed(hash(tuple(path)) & 0xFFFFFFFF)
    return torch.softmax(torch.randn(vocab, generator=g) * 1.5, -1)


@pytest.mark.parametrize("seed", range(40))
def test_coupled_verify_reproduces_plain_seeded_decoding(seed):
    """Whatever the tree (right, wrong or partly right candidates, siblings), the tokens coupled
    verification emits are exactly those plain seeded decoding emits at the same positions."""
    rng = torch.Generator().manual_seed(1000 + seed)
    context, seq_len = [1, 2, 3], 2  # the root (3) sits at position 2
    plain = []
    for _ in range(6):
        plain.append(seeded_sample(_path_probs(context + plain), seed, seq_len + 1 + len(plain)))
    # a random tree of depth <= 4 whose nodes are the plain tokens with probability 1/2, else random
    tokens, parents = [3], [-1]
    for _ in range(int(torch.randint(1, 9, (), generator=rng))):
        parent = int(torch.randint(0, len(tokens), (), generator=rng))
        depth = len(_path(parents, parent)) - 1
        right = plain[depth] if depth < len(plain) else 0
        tok = right if torch.rand((), generator=rng) < 0.5 else int(torch.randint(0, 7, (), generator=rng))
        tokens.append(tok)
        parents.append(parent)
    tree = tree_from_parents(torch.tensor(tokens), torch.tensor(parents), seq_len)
    res = coupled_verify(tree, lambda node: _path_probs(context + [tokens[i] for i in _path(parents, node)[1:]]), seed)
    assert res.tokens == plain[: len(res.tokens)]
    assert [tokens[i] for i in res.accepted_nodes[1:]] == res.tokens[:-1]


def _path(parents: list[int], node: int) -> list[int]:
    out = []
    while node != -1:
        out.append(node)
        node = parents[node]
    return out[::-1]


# --- greedy verification of a whole batch at once --------------------------------------------------


def _random_tree(rng: random.Random, vocab: int):
    """A tree of 1-12 nodes from tree_from_parents (some nodes unlinked, some tokens outside the vocab),
    and the argmax rows that accept all of it along first children, none of it, or at random."""
    n = rng.randrange(1, 13)
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    tokens = [rng.randrange(vocab + 1 if rng.random() < 0.1 else vocab) for _ in range(n)]
    unlinked = {i for i in range(1, n) if rng.random() < 0.1}
    tree = tree_from_parents(torch.tensor(tokens), torch.tensor(parents), rng.randrange(50), unlinked=unlinked)
    kind = rng.choice(["all", "none", "random"])
    if kind == "random":
        target = [rng.randrange(vocab) for _ in range(n)]
    elif kind == "none":
        target = [vocab - 1] * n  # (tokens below are drawn from 0..vocab-2 for these)
        tokens = [min(x, vocab - 2) for x in tokens]
        tree = tree_from_parents(torch.tensor(tokens), torch.tensor(parents), rng.randrange(50), unlinked=unlinked)
    else:  # each node's first linked child holds the target's token there: the walk goes to a leaf
        nxt = tree.retrieve_next_token.tolist()
        target = [tokens[c] if c >= 0 else rng.randrange(vocab) for c in nxt]
    if rng.random() < 0.3:
        tree.finite = torch.tensor(rng.random() < 0.8)
    return tree, torch.tensor(target)


def _one_by_one(trees, targets, vocab):
    """greedy_path per request, draft_invalid as the engine sets it (drafted trees only)."""
    paths = []
    for t, target in zip(trees, targets):
        path = greedy_path(t, target)
        if t.num_nodes > 1:
            invalid = ((t.draft_tokens < 0) | (t.draft_tokens >= vocab)).any()
            path.draft_invalid = invalid if t.finite is None else invalid | ~t.finite
        paths.append(path)
    return to_host(paths)


@pytest.mark.parametrize("seed", range(20))
def test_greedy_paths_equal_greedy_path_per_request(seed):
    rng, vocab = random.Random(seed), 6
    trees, targets = zip(*[_random_tree(rng, vocab) for _ in range(rng.randrange(1, 9))])
    if rng.random() < 0.5:  # requests with no draft: root-only trees (a plain decode step)
        k = rng.randrange(len(trees) + 1)
        trees = trees[:k] + (root_tree(3, 17),) + trees[k:]
        targets = targets[:k] + (torch.tensor([rng.randrange(vocab)]),) + targets[k:]
    batched = to_host(greedy_paths(list(trees), torch.cat(targets), vocab))
    assert batched == _one_by_one(trees, targets, vocab)
    starts = list(itertools.accumulate([t.num_nodes for t in trees], initial=0))[:-1]
    assert greedy_results(list(trees), torch.cat(targets).tolist(), starts, vocab) == batched  # (the CPU's walk)
    assert [p.nodes.numel() for p in greedy_paths(list(trees), torch.cat(targets))] == [t.num_nodes for t in trees]


def test_greedy_paths_on_a_search_batch_views():
    """Trees that are views of one packed batch (tree_batch), some nodes left unverified (keep), beside a
    lookup's tree of another size and a root-only tree."""
    g = torch.Generator().manual_seed(0)
    b, m, vocab = 5, 9, 4
    selected = torch.stack([torch.randperm(20, generator=g)[:m].sort().values for _ in range(b)])
    parent_flat = torch.where(selected < 4, -1, selected // 2)  # some parents not selected: orphans
    tokens = torch.randint(0, vocab, (b, m), generator=g)
    keep = torch.rand(b, m, generator=g) > 0.2
    trees = unpack_trees(
        *tree_batch(
            torch.randint(0, vocab, (b,), generator=g),
            selected,
            tokens,
            torch.rand(b, m, generator=g),
            parent_flat,
            torch.arange(b) + 30,
            keep,
        ),
        torch.tensor(True),
    )
    searched = len(trees)
    trees += [chain_tree(1, [2, 3, 1], 12), root_tree(2, 40)]
    for trial in range(20):
        targets = [torch.randint(0, vocab, (t.num_nodes,), generator=g) for t in trees]
        if trial % 4 == 0:  # every tree accepted along its first children
            targets = [
                torch.where(t.retrieve_next_token >= 0, t.draft_tokens[t.retrieve_next_token.clamp(min=0)], 0)
                for t in trees
            ]
        assert to_host(greedy_paths(trees, torch.cat(targets), vocab)) == _one_by_one(trees, targets, vocab)
        # the search's trees alone (one size, rows one after another: packed without padding), and some
        # of them with their rows elsewhere (starts)
        expect = _one_by_one(trees[:searched], targets[:searched], vocab)
        assert to_host(greedy_paths(trees[:searched], torch.cat(targets[:searched]), vocab)) == expect
        rows = torch.cat([torch.zeros(3, dtype=torch.long)] + [x for t in targets[:searched] for x in (t, t)])
        starts = [3 + (m + 1) * (2 * b + 1) for b in range(searched)]  # each tree's second copy
        assert to_host(greedy_paths(trees[:searched], rows, vocab, starts)) == expect
        assert greedy_results(trees[:searched], rows.tolist(), starts, vocab) == expect
