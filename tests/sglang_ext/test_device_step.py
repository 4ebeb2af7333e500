"""A decoding step's core math on an accelerator, checked on the CPU.

Fake CUDA tensors (FakeTensorMode: any CPU tensor mixed into device math, any host read of a device
value, any data-dependent shape raises) run a verify step at SmolLM2's shape with random weights: trees
built on the device, the attention plan, the model's forward with the torch reference attention,
penalties and the logits -> probs transform, greedy / speculative-sampling / seeded verification, and
KV compaction; only the step's one copy of the accepted paths to the host is refused.

On real CPU tensors the device-path functions give the host code's results (its loops are copied
below as references): the same tree layouts, greedy and seeded paths, penalty rows and multinomial's
draws. Speculative sampling on the device draws its random numbers in another order (all up front),
so its samples for a seed differ from the oracle's (tests/oracles.py sampling_verify): a chi-square test
checks its law, and the same test must fail without the residual's renormalization. The `gpu` tests run these on CUDA.
"""

from __future__ import annotations

from dataclasses import replace

import oracles
import pytest
import torch
from helpers import smollm2_config
from oracles import coupled_verify, verify_tree_greedy
from test_distribution import chi2_pvalue
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

from sglang_ext import sampling
from sglang_ext import verify as verify_mod
from sglang_ext.attention import plan_attention, prefix_and_tree_mask, tree_attention_torch
from sglang_ext.device import to_device
from sglang_ext.models.kv_pool import KVPool
from sglang_ext.penalties import ban_early_stops, output_counts, penalize_tree, tree_output_counts
from sglang_ext.sampling import SamplingParams, draw, greedy_tokens, logits_to_probs
from sglang_ext.tree import TreeSearch, build_trees, chain_tree, root_tree, tree_from_parents
from sglang_ext.verify import (
    AcceptedPath,
    coupled_path,
    greedy_path,
    sampling_path,
    to_host,
)

cuda = pytest.mark.gpu


def _skip_without_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


# --- the host code's loops, as references ----------------------------------------------------------


def host_layout(parents: list[int], seq_len: int, unlinked=()) -> dict[str, torch.Tensor]:
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    depth, next_token, next_sibling, last_child = [0] * n, [-1] * n, [-1] * n, [-1] * n
    mask[0, 0] = True
    for i in range(1, n):
        p = parents[i]
        mask[i] = mask[p]
        mask[i, i] = True
        depth[i] = depth[p] + 1
        if i in unlinked:
            continue
        if next_token[p] == -1:
            next_token[p] = i
        else:
            next_sibling[last_child[p]] = i
        last_child[p] = i
    return {
        "tree_mask": mask,
        "positions": torch.tensor(depth) + seq_len,
        "retrieve_next_token": torch.tensor(next_token),
        "retrieve_next_sibling": torch.tensor(next_sibling),
    }


def host_verify_tree_greedy(candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling, target, num_spec):
    bs, n = candidates.shape
    cand, ridx = candidates.tolist(), retrieve_index.tolist()
    nxt, sib, tgt = retrieve_next_token.tolist(), retrieve_next_sibling.tolist(), target.reshape(-1).tolist()
    predicts, accept_index, accept_num = [0] * (bs * n), [[-1] * num_spec for _ in range(bs)], [0] * bs
    for b in range(bs):
        last = ridx[b][0]
        accept_index[b][0] = last
        cur = 0
        for j in range(1, num_spec):
            cur = nxt[b][cur]
            t = tgt[last]
            while cur != -1 and cand[b][cur] != t:
                cur = sib[b][cur]
            if cur == -1:
                break
            predicts[last] = t
            accept_num[b] += 1
            last = ridx[b][cur]
            accept_index[b][j] = last
        predicts[last] = tgt[last]
    return torch.tensor(predicts), torch.tensor(accept_index), torch.tensor(accept_num)


def host_tree_output_counts(counts, tree):
    rows = counts.expand(tree.num_nodes, -1).clone()
    node, ancestor = tree.tree_mask[:, 1:].nonzero(as_tuple=True)
    rows.index_put_((node, tree.draft_tokens[ancestor + 1].long()), torch.ones(len(node)), accumulate=True)
    return rows


def random_parents(n: int, gen: torch.Generator) -> list[int]:
    return [-1] + [int(torch.randint(0, i, (), generator=gen)) for i in range(1, n)]


def random_tree(n: int, gen: torch.Generator, vocab: int = 5, seq_len: int = 3, unlinked=()):
    tokens = torch.randint(vocab, (n,), generator=gen)
    return tree_from_parents(tokens, torch.tensor(random_parents(n, gen)), seq_len, unlinked=unlinked)


# --- the same results as the host code, on the CPU -------------------------------------------------


def test_tree_layout_equals_the_host_loop():
    gen = torch.Generator().manual_seed(0)
    for trial in range(150):
        n = int(torch.randint(1, 40, (), generator=gen))
        parents = random_parents(n, gen)
        unlinked = {i for i in range(1, n) if torch.rand((), generator=gen) < 0.15}
        as_mask = torch.zeros(n, dtype=torch.bool)
        as_mask[list(unlinked)] = True
        want = host_layout(parents, 11, unlinked)
        for given in (unlinked, as_mask):
            tree = tree_from_parents(torch.arange(n), torch.tensor(parents), 11, batch_index=2, unlinked=given)
            for name, value in want.items():
                assert torch.equal(getattr(tree, name), value), (trial, name)
            assert torch.equal(tree.retrieve_index, torch.arange(n) + 2 * n)


def test_a_batch_of_trees_equals_each_request_built_alone():
    """tree_batch (the whole batch at once, as a captured search builds it) gives link_selected +
    tree_from_parents per request: random candidate sets with orphans (a parent not selected) and
    nodes outside `keep` (unlinked)."""
    from sglang_ext.tree import link_selected, tree_batch, unpack_trees

    gen = torch.Generator().manual_seed(3)
    for trial in range(60):
        b, s = int(torch.randint(1, 5, (), generator=gen)), int(torch.randint(2, 40, (), generator=gen))
        m = int(torch.randint(1, s + 1, (), generator=gen))
        flat_parent = torch.tensor([-1 if i == 0 else int(torch.randint(-1, i, (), generator=gen)) for i in range(s)])
        selected = torch.stack([torch.randperm(s, generator=gen)[:m].sort().values for _ in range(b)])
        tokens, scores = torch.randint(0, 50, (b, m), generator=gen), torch.rand(b, m, generator=gen)
        keep = torch.rand(b, m, generator=gen) > 0.2
        roots, lens = torch.randint(0, 50, (b,), generator=gen), torch.randint(1, 30, (b,), generator=gen)
        for k in (None, keep):
            got = unpack_trees(*tree_batch(roots, selected, tokens, scores, flat_parent[selected], lens, k))
            for i, t in enumerate(got):
                parents, unlinked = link_selected(selected[i], flat_parent[selected[i]])
                if k is not None:
                    unlinked = unlinked | torch.cat([torch.zeros(1, dtype=torch.bool), ~k[i]])
                want = tree_from_parents(
                    torch.cat([roots[i : i + 1], tokens[i]]), parents, int(lens[i]), batch_index=i, unlinked=unlinked
                )
                for name in ("draft_tokens", "parents", "positions", "tree_mask", "retrieve_index"):
                    assert torch.equal(getattr(t, name), getattr(want, name)), (trial, name)
                for name in ("retrieve_next_token", "retrieve_next_sibling"):
                    assert torch.equal(getattr(t, name), getattr(want, name)), (trial, name)
                assert torch.equal(t.scores, torch.cat([torch.ones(1), scores[i]]))


def test_root_trees_at_once_equal_each_built_alone():
    """root_trees (every plain decode request of a step in a fixed number of ops) gives root_tree's
    layout per request, on the CPU and on (fake) CUDA."""
    from sglang_ext.tree import root_trees

    tokens, lens = [5, 0, 49151, 7], [30, 1, 12, 4096]
    assert root_trees([], [], "cpu") == []
    for t, tok, n in zip(root_trees(tokens, lens), tokens, lens):
        want = root_tree(tok, n)
        for name in ("draft_tokens", "parents", "positions", "tree_mask", "retrieve_index"):
            assert torch.equal(getattr(t, name), getattr(want, name)), name
        for name in ("retrieve_next_token", "retrieve_next_sibling"):
            assert torch.equal(getattr(t, name), getattr(want, name)), name
        assert t.num_nodes == 1 and t.draft_probs is None and t.scores is None and t.finite is None
    with FakeTensorMode(allow_non_fake_inputs=True):
        on = root_trees(tokens, lens, "cuda")
        assert all(_on("cuda", t.draft_tokens, t.positions, t.tree_mask, t.parents) for t in on)


def test_rejoin_gives_a_splits_whole_without_a_copy_and_cats_anything_else():
    """rejoin (a batch's rows split per request, joined again by a drafter): the split's pieces in order, covering
    their tensor, are that tensor (no op); a subset, another order, other tensors' pieces or a single piece give
    torch.cat's values."""
    from sglang_ext.device import rejoin

    base = torch.arange(24.0).reshape(12, 2) * 1  # (a tensor of its own, not a view)
    parts = list(base.split([3, 4, 5]))
    assert rejoin(parts) is base and rejoin(list(base.split(1))) is base
    other = torch.ones(2, 2)
    for pieces in ([parts[0], parts[2]], parts[::-1], [parts[0], other], [*parts, other], [parts[1]]):
        assert torch.equal(rejoin(pieces), torch.cat(pieces))
    cols = list(base[:, :1].split([6, 6]))  # (not contiguous: the column's rows)
    assert torch.equal(rejoin(cols), base[:, :1])


def test_upload_packs_each_dtype_once_and_keeps_shapes():
    from sglang_ext.device import upload

    host = [torch.arange(5), None, torch.ones(2, 3, dtype=torch.bool), torch.tensor(7), torch.arange(6).view(3, 2).t()]
    with FakeTensorMode(allow_non_fake_inputs=True):
        placed = upload(host, "cuda")
        assert placed[1] is None and _on("cuda", *[p for p in placed if p is not None])
        assert [tuple(p.shape) for p in placed if p is not None] == [(5,), (2, 3), (), (2, 3)]
    got = upload(host, "meta")
    assert [p.shape for p in got if p is not None] == [h.shape for h in host if h is not None]
    same = upload(host, "cpu")  # already there: as they are
    assert all(a is b for a, b in zip(same, host))


def _agreeing_targets(trees, gen, vocab):
    """[bs, N] target tokens: at each node, usually one of its children's tokens, else a random one."""
    rows = []
    for t in trees:
        row = []
        for node in range(t.num_nodes):
            kids = (t.parents == node).nonzero().flatten().tolist()
            if kids and torch.rand((), generator=gen) < 0.8:
                row.append(int(t.draft_tokens[kids[int(torch.randint(len(kids), (), generator=gen))]]))
            else:
                row.append(int(torch.randint(vocab, (), generator=gen)))
        rows.append(row)
    return torch.tensor(rows)


def test_verify_tree_greedy_and_greedy_path_equal_the_host_loop():
    gen = torch.Generator().manual_seed(1)
    for trial in range(60):
        bs, n = int(torch.randint(1, 5, (), generator=gen)), int(torch.randint(1, 24, (), generator=gen))
        trees = []
        for b in range(bs):
            unlinked = {i for i in range(1, n) if torch.rand((), generator=gen) < 0.1}
            t = random_tree(n, gen, vocab=4, unlinked=unlinked)
            trees.append(tree_from_parents(t.draft_tokens, t.parents, 3, batch_index=b, unlinked=unlinked))
        target = _agreeing_targets(trees, gen, 4)
        args = [torch.stack([getattr(t, f) for t in trees]) for f in ("draft_tokens", "retrieve_index")]
        args += [torch.stack([getattr(t, f) for t in trees]) for f in ("retrieve_next_token", "retrieve_next_sibling")]
        for num_spec in {1, 2, 4, n}:
            got = verify_tree_greedy(*args, target, num_spec)
            want = host_verify_tree_greedy(*args, target, num_spec)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), (trial, num_spec)
        _, accept_index, accept_num = host_verify_tree_greedy(*args, target, n)
        for b, (t, res) in enumerate(zip(trees, to_host([greedy_path(t, target[i]) for i, t in enumerate(trees)]))):
            nodes = [i - b * n for i in accept_index[b, : int(accept_num[b]) + 1].tolist()]
            tokens = [int(t.draft_tokens[i]) for i in nodes[1:]] + [int(target[b, nodes[-1]])]
            assert (res.accepted_nodes, res.tokens) == (nodes, tokens), trial


@pytest.mark.parametrize("k", [0, 3])
def test_logprobs_in_the_copy_equal_the_hosts(k):
    """path_logprobs (on the device, copied by to_host with the path) gives token_logprobs' numbers for
    the accepted tokens at their rows, batch after batch, mixed with paths that did not ask."""
    gen = torch.Generator().manual_seed(9)
    for trial in range(20):
        trees = [random_tree(int(n), gen, vocab=8) for n in torch.randint(1, 9, (3,), generator=gen)]
        logits = [torch.randn(t.num_nodes, 8, generator=gen) * 3 for t in trees]
        paths = [greedy_path(t, greedy_tokens(lg)) for t, lg in zip(trees, logits)]
        for p, lg in zip(paths[:2], logits):
            verify_mod.path_logprobs(p, lg, k)
        got = to_host(paths)
        for res, lg in zip(got[:2], logits):
            want = sampling.token_logprobs(lg[res.accepted_nodes], res.tokens, k)
            assert len(res.logprobs) == len(want) and all(
                a.token == b.token
                and a.logprob == pytest.approx(b.logprob, abs=1e-6)
                and [t for t, _ in a.top] == [t for t, _ in b.top]
                and [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-6)
                for a, b in zip(res.logprobs, want)
            ), trial
        assert got[2].logprobs is None and got[2].tokens == to_host([paths[2]])[0].tokens


def test_tree_shortcuts_equal_the_general_list_walk():
    """tree_lists and path_in_tree (a TokenTree's index-ordered lists) give sibling_lists' and walk's results."""
    gen = torch.Generator().manual_seed(6)
    for trial in range(100):
        n = int(torch.randint(1, 30, (), generator=gen))
        tree = random_tree(n, gen, unlinked={i for i in range(1, n) if torch.rand((), generator=gen) < 0.2})
        owner, rank = oracles.sibling_lists(tree.retrieve_next_token, tree.retrieve_next_sibling)
        t_owner, t_rank = verify_mod.tree_lists(tree)
        listed = owner >= 0
        assert torch.equal(owner, t_owner) and torch.equal(rank[listed], t_rank[listed]), trial
        choice = verify_mod.first_passing_child(owner, rank, torch.rand(n, generator=gen) < 0.5)
        assert torch.equal(verify_mod.path_in_tree(tree, choice), oracles.walk(choice, n)), trial


def test_coupled_path_equals_coupled_verify():
    gen = torch.Generator().manual_seed(2)
    for trial in range(80):
        n = int(torch.randint(1, 12, (), generator=gen))
        tree = random_tree(n, gen, vocab=4, seq_len=9)
        probs = torch.softmax(torch.randn(n, 4, generator=gen) * 2, -1)
        depth = int((tree.positions - 9).max())
        for seed in (trial, 1000 + trial):
            want = coupled_verify(tree, probs.__getitem__, seed)
            for max_depth in (None, depth):
                assert to_host([coupled_path(tree, probs, seed, 9, max_depth)])[0] == want, (trial, seed)


def test_draw_is_multinomials_draw():
    gen = torch.Generator().manual_seed(3)
    for s in range(200):
        p = torch.softmax(torch.randn(3, 50, generator=gen) * 2, -1)
        want = torch.multinomial(p, 1, generator=torch.Generator().manual_seed(s))[:, 0]
        assert torch.equal(draw(p, torch.Generator().manual_seed(s)), want)


def test_penalty_rows_equal_the_host_code():
    gen = torch.Generator().manual_seed(4)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.4, logit_bias=((3, 2.0),))
    for trial in range(40):
        tree = random_tree(int(torch.randint(1, 16, (), generator=gen)), gen, vocab=12, seq_len=20)
        output = torch.randint(12, (int(torch.randint(0, 9, (), generator=gen)),), generator=gen).tolist()
        counts = output_counts(output, 12)
        assert torch.equal(counts, torch.bincount(torch.tensor(output, dtype=torch.long), minlength=12).float())
        assert torch.equal(tree_output_counts(counts, tree), host_tree_output_counts(counts, tree))
        logits = torch.randn(tree.num_nodes, 12, generator=gen)
        rows = penalize_tree(logits, params, [1, 2, 5], output, tree)
        banned = ban_early_stops(rows, tree, len(output), 6, {0, 7})
        depth = tree.positions - 20
        early = (len(output) + depth < 6).nonzero()[:, 0]
        want = rows.clone()
        if len(early):
            want[early[:, None], torch.tensor([0, 7])[None, :]] = float("-inf")
        assert torch.equal(banned, want), trial


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_pools_buffers_are_zero_separate_and_aligned(dtype):
    """The host pool's layers share one lazily zeroed allocation: each is zero, its own memory, cache-line
    aligned, and a write to one reaches no other."""
    pool = KVPool(3, 100, 3, 8, dtype)
    bufs = pool.k + pool.v
    assert len(bufs) == 6 and all(b.shape == (100, 3, 8) and b.dtype == dtype for b in bufs)
    assert all(b.is_contiguous() and b.data_ptr() % 64 == 0 and not b.any() for b in bufs)
    for i, b in enumerate(bufs):
        b[torch.tensor([1, 99])] = i + 1.0
    for i, b in enumerate(bufs):
        assert b[1].eq(i + 1).all() and b[99].eq(i + 1).all() and b[2:99].eq(0).all() and b[0].eq(0).all()
    # as torch.zeros' tensors: a pool made under no_grad takes values that require grad, layer after layer
    with torch.no_grad():
        pool = KVPool(2, 8, 1, 4, torch.float32)
    w = torch.ones(1, 1, 4, requires_grad=True)
    for layer in range(2):
        pool.write(layer, torch.tensor([3]), w * (layer + 1), w)
    (pool.k[0].sum() + pool.k[1].sum()).backward()
    assert w.grad.eq(3).all()


def test_kv_compaction_moves_the_accepted_path_to_the_front():
    pool = KVPool(2, 64, 3, 8, torch.float32)
    for layer in range(2):
        pool.k[layer].copy_(torch.randn(64, 3, 8))
        pool.v[layer].copy_(torch.randn(64, 3, 8))
    before = [t.clone() for t in pool.k + pool.v]
    slots = pool.alloc(7)
    nodes = torch.tensor([0, 2, 5, -1, -1, -1, -1])  # the path: nodes 0 -> 2 -> 5
    pool.compact(slots, nodes)
    for now, old in zip(pool.k + pool.v, before):
        assert torch.equal(now[slots[:3]], old[slots[[0, 2, 5]]])
        assert torch.equal(now[slots[3:]], old[slots[3:]])  # past the path: unchanged (freed by the host)
        untouched = torch.ones(64, dtype=torch.bool)
        untouched[slots] = False
        assert torch.equal(now[untouched], old[untouched])


# --- speculative sampling on the device: its law --------------------------------------------------

VOCAB = 5


def _law(context: tuple[int, ...], scale: float = 1.2, salt: int = 0) -> torch.Tensor:
    """A synthetic next-token law, a fixed function of the context (the target, or a drafter with a salt)."""
    g = torch.Generator().manual_seed((hash(context) + salt) & 0xFFFFFFFF)
    return torch.softmax(torch.randn(VOCAB, generator=g) * scale, -1)


CONTEXT = (3, 1)
#  root ─┬─ 4 ─┬─ 1          siblings hold a token twice (4), so a rejected token must stay rejected;
#        ├─ 3  └─ 3          4 holds most of the root's law, so its siblings' residual differs much from p
#        ├─ 4 ── 4
#        └─ 0
POINT_TOKENS = [1, 4, 3, 4, 0, 1, 3, 4]
POINT_PARENTS = [-1, 0, 0, 0, 0, 1, 1, 3]


def _node_probs(tokens: list[int], parents: list[int]) -> torch.Tensor:
    """[N, V] the target's law after each node's path."""
    rows = []
    for node in range(len(tokens)):
        path = []
        while node > 0:
            path.append(tokens[node])
            node = parents[node]
        rows.append(_law(CONTEXT + tuple(reversed(path))))
    return torch.stack(rows)


def _first_two(kind: str, samples: int, device: str, generator: torch.Generator) -> torch.Tensor:
    """[V, V] counts of the first two tokens emitted by sampling_path (plain sampling after a bonus)."""
    host_gen = torch.Generator().manual_seed(7)
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    point_tree = tree_from_parents(
        torch.tensor(POINT_TOKENS, device=device), torch.tensor(POINT_PARENTS, device=device), 4
    )
    point_probs = _node_probs(POINT_TOKENS, POINT_PARENTS).to(device)
    for _ in range(samples):
        if kind == "point":
            tree, probs = point_tree, point_probs
        else:  # a chain of 2 sampled from a drafter's own law q
            q1 = _law(CONTEXT, salt=1)
            x1 = int(torch.multinomial(q1, 1, generator=host_gen))
            q2 = _law(CONTEXT + (x1,), salt=1)
            x2 = int(torch.multinomial(q2, 1, generator=host_gen))
            q = torch.stack([torch.zeros(VOCAB), q1, q2]).to(device)
            tree = chain_tree(CONTEXT[-1], [x1, x2], 4, draft_probs=q)
            probs = _node_probs([CONTEXT[-1], x1, x2], [-1, 0, 1]).to(device)
        out = to_host([sampling_path(tree, probs, generator, max_children=None if kind == "point" else 1)])[0].tokens
        if len(out) == 1:
            out.append(int(torch.multinomial(_law(CONTEXT + (out[0],)), 1, generator=host_gen)))
        counts[out[0], out[1]] += 1
    return counts


def _exact_first_two() -> torch.Tensor:
    p1 = _law(CONTEXT).double()
    return torch.stack([p1[a] * _law(CONTEXT + (a,)).double() for a in range(VOCAB)])


_point_mass_trials = verify_mod.point_mass_trials


def _unnormalized_point_mass_trials(p, x, owner, rank, u):
    """Broken on purpose: a later sibling is accepted with p(x) instead of the renormalized residual's."""
    ok, residual = _point_mass_trials(p, x, owner, rank, u)
    px = p[owner.clamp(min=0), x]
    return ok & (u < px), residual


def _check_law(kind: str, device: str, generator: torch.Generator, samples: int = 4000) -> float:
    return chi2_pvalue(_first_two(kind, samples, device, generator), _exact_first_two())


@pytest.mark.parametrize("kind", ["point", "chain"])
def test_sampling_path_keeps_the_target_law(kind):
    assert _check_law(kind, "cpu", torch.Generator().manual_seed(11)) > 1e-3


def test_sampling_path_without_renormalization_fails_the_same_test(monkeypatch):
    monkeypatch.setattr(verify_mod, "point_mass_trials", _unnormalized_point_mass_trials)
    assert _check_law("point", "cpu", torch.Generator().manual_seed(11)) < 1e-6


def test_sampling_path_certain_accept_and_zero_probability_draft():
    t = chain_tree(1, [2, 3], 0)
    probs = torch.zeros(3, 5)
    probs[0, 2] = probs[1, 3] = probs[2, 4] = 1.0
    assert to_host([sampling_path(t, probs, torch.Generator().manual_seed(0))])[0].tokens == [2, 3, 4]
    t = chain_tree(1, [2], 0)
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5], [0.25] * 4])
    for seed in range(20):
        r = to_host([sampling_path(t, probs, torch.Generator().manual_seed(seed))])[0]
        assert r.tokens[0] in (1, 3) and r.num_accepted == 0


def test_a_root_only_tree_samples_as_multinomial():
    """A plain decode step's bonus is torch.multinomial's draw of the row, for the same generator state."""
    gen = torch.Generator().manual_seed(9)
    for seed in range(50):
        p = torch.softmax(torch.randn(1, 40, generator=gen) * 2, -1)
        got = to_host([sampling_path(root_tree(3, 17), p, torch.Generator().manual_seed(seed))])[0]
        want = int(torch.multinomial(p[0], 1, generator=torch.Generator().manual_seed(seed)))
        assert (got.accepted_nodes, got.tokens) == ([0], [want])


def test_out_of_vocabulary_drafts_are_left_out_and_flagged():
    """A faulty drafter's token outside the vocabulary: sampling_path treats its node as unlinked (the same
    draws, so the same result as the tree without it), greedy and coupled paths never accept it, and
    to_host brings the tree's flag in the same copy."""
    gen = torch.Generator().manual_seed(8)
    for trial in range(60):
        n = int(torch.randint(2, 14, (), generator=gen))
        tree = random_tree(n, gen, vocab=6, seq_len=4)
        bad = torch.rand(n, generator=gen) < 0.3
        bad[0] = False
        oov = replace(tree, draft_tokens=torch.where(bad, torch.where(bad.roll(1), -3, 6), tree.draft_tokens))
        unlinked = tree_from_parents(tree.draft_tokens, tree.parents, 4, unlinked=bad)
        probs = torch.softmax(torch.randn(n, 6, generator=gen) * 2, -1)
        for seed in range(3):
            got = sampling_path(oov, probs, torch.Generator().manual_seed(seed))
            want = sampling_path(unlinked, probs, torch.Generator().manual_seed(seed))
            assert to_host([got]) == to_host([want]), trial
        for path in (greedy_path(oov, probs.argmax(-1)), coupled_path(oov, probs, trial, 4)):
            assert not bad[to_host([path])[0].accepted_nodes].any(), trial
    flags = [AcceptedPath(torch.tensor([0, -1]), torch.tensor([5, -1]), torch.tensor(f)) for f in (True, False)]
    assert [r.draft_invalid for r in to_host(flags + [greedy_path(oov, probs.argmax(-1))])] == [True, False, False]


# --- a verify step on fake CUDA tensors ------------------------------------------------------------


def _device_trees(vocab: int, seq_lens: list[int], device: str):
    """An EAGLE-2 search over device probabilities -> one tree per request, built on the device."""
    k, depth, n = 4, 3, 16
    b = len(seq_lens)
    search = TreeSearch.start(k)
    tokens, scores = search.first(*torch.softmax(torch.randn(b, vocab, device=device), -1).topk(k))
    for step in range(1, depth):
        p, i = torch.softmax(torch.randn(b * k, vocab, device=device), -1).topk(k)
        tokens, scores, _ = search.expand(step, scores, p, i)
    return build_trees(torch.randint(vocab, (b,), device=device), search, seq_lens, n)


def _on(device: str, *tensors) -> bool:
    return all(t.device.type == device for t in tensors)


def test_a_plan_built_on_the_host_moves_to_the_device_once():
    """What the GPU run hit: a plan from host slots and masks, read by CUDA q/k/v in the torch backend."""
    gen = torch.Generator().manual_seed(5)
    trees = [random_tree(n, gen) for n in (6, 1, 11)]
    plan = plan_attention(
        [torch.arange(40 * i + 1, 40 * i + 11 + t.num_nodes) for i, t in enumerate(trees)],
        [prefix_and_tree_mask(t.tree_mask, 10) for t in trees],
    )
    assert plan.groups  # (a host plan's padded view is built at its first read, on the host: before the fake device)
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.randn(sum(t.num_nodes for t in trees), 9, 64, device="cuda")
        k, v = torch.randn(200, 3, 64, device="cuda"), torch.randn(200, 3, 64, device="cuda")
        out = tree_attention_torch(q, k, v, plan, 0.125)
        assert out.device.type == "cuda" and out.shape == q.shape
        assert plan.on("cuda") is plan.on("cuda") and plan.on("cpu") is plan  # moved once, then reused
        moved = plan.on("cuda")
        assert _on("cuda", moved.qo_indptr, moved.kv_indices, moved.custom_mask, moved.mask_indptr)
        assert all(_on("cuda", g.q_index, g.q_valid, g.kv_slots, g.valid_at) for g in moved.groups)


def _verify_requests(logits: torch.Tensor, trees, seq_lens: list[int]):
    """Greedy, penalized top-k/top-p sampling, and seeded verification of three requests' rows."""
    sizes = [t.num_nodes for t in trees]
    rows = logits.split(sizes)
    greedy = greedy_path(trees[0], greedy_tokens(rows[0]))
    params = SamplingParams(
        temperature=0.8,
        top_k=50,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=0.2,
        repetition_penalty=1.2,
        logit_bias=((5, 1.0),),
        min_tokens=8,
        stop_token_ids=(2,),
    )
    output = [7, 8, 7]
    x = penalize_tree(rows[1], params, [1, 2, 3, 4], output, trees[1])
    x = ban_early_stops(x, trees[1], len(output), params.min_tokens, {2})
    sampled = sampling_path(trees[1], logits_to_probs(x, params), None)
    seeded = coupled_path(trees[2], logits_to_probs(rows[2], SamplingParams(temperature=1.0, seed=7)), 7, seq_lens[2])
    return [greedy, sampled, seeded]


def test_a_verify_step_stays_on_the_device(monkeypatch):
    """SmolLM2's shape, random weights, three requests: trees, plan, forward, logits, penalties, probs,
    verification and KV compaction on fake CUDA tensors; the paths' copy to the host is the one read."""
    from sglang_ext.models import synthetic

    cfg = smollm2_config()
    # NOTE: a CUDA generator needs a CUDA runtime; fake tensors take a CPU one (a real GPU would refuse it)
    monkeypatch.setattr(sampling, "device_generator", lambda seed, device="cpu": torch.Generator().manual_seed(seed))
    seq_lens = [37, 120, 5]
    with FakeTensorMode(allow_non_fake_inputs=True):
        target = synthetic.random_target(cfg, "cuda")
        target.attention = tree_attention_torch  # (the Triton kernels need a real GPU)
        target.gpu_layer_ops = False
        kv = target.new_kv_pool(512)
        trees = _device_trees(cfg.vocab_size, seq_lens, "cuda")
        for t in trees:
            assert _on("cuda", t.draft_tokens, t.positions, t.tree_mask, t.retrieve_next_token, t.retrieve_next_sibling)
        prefixes = [kv.alloc(n) for n in seq_lens]  # slot ids: host bookkeeping
        new = [kv.alloc(t.num_nodes) for t in trees]
        masks = [prefix_and_tree_mask(t.tree_mask, n) for t, n in zip(trees, seq_lens)]
        plan = plan_attention([torch.cat([p, s]) for p, s in zip(prefixes, new)], masks, device="cuda")
        assert _on("cuda", plan.qo_indptr, plan.kv_indices, plan.custom_mask, plan.mask_indptr)
        assert all(_on("cuda", g.q_index, g.kv_slots, g.valid_at) for g in plan.groups)
        ids, pos = torch.cat([t.draft_tokens for t in trees]), torch.cat([t.positions for t in trees])
        hidden = target.forward(ids, pos, to_device(torch.cat(new), "cuda"), plan, kv).hidden
        logits = target.logits(hidden, fp32=False)
        assert logits.device.type == "cuda" and logits.shape == (48, cfg.vocab_size)
        paths = _verify_requests(logits, trees, seq_lens)
        batch = [torch.stack([getattr(t, f) for t in trees]) for f in ("draft_tokens", "retrieve_index")]
        batch += [torch.stack([getattr(t, f) for t in trees]) for f in ("retrieve_next_token", "retrieve_next_sibling")]
        batched = verify_tree_greedy(*batch, greedy_tokens(logits).view(3, 16), 4)
        chain = chain_tree(3, [5, 9], 40, draft_probs=torch.softmax(torch.randn(3, cfg.vocab_size, device="cuda"), -1))
        paths.append(sampling_path(chain, torch.softmax(logits[:3].float(), -1), None, max_children=1))
        for s, path in zip(new, paths):
            kv.compact(s, path.nodes)
        assert all(_on("cuda", p.nodes, p.tokens) for p in paths) and _on("cuda", *batched)
        with pytest.raises(DataDependentOutputException):
            to_host(paths)  # the step's one device-to-host copy


# --- the same on a real GPU (skipped without CUDA) --------------------------------------------------


@cuda
def test_gpu_attention_backends_agree():
    _skip_without_cuda()
    from test_attention import random_pools, random_tree_batch

    from sglang_ext.attention.triton_tree import tree_attention_triton

    gen = torch.Generator().manual_seed(0)
    requests = random_tree_batch([0, 5, 300, 70], [1, 7, 48, 33], 600, gen)
    slots, masks = [r[0] for r in requests], [r[1] for r in requests]
    k, v = random_pools(600, 3, 64, gen)
    q = torch.randn(sum(m.shape[0] for m in masks), 9, 64, generator=gen)
    ref = tree_attention_torch(q, k, v, plan_attention(slots, masks), 0.125)
    qc, kc, vc = q.cuda(), k.cuda(), v.cuda()
    host_plan = plan_attention(slots, masks)
    dev_plan = plan_attention([s.cuda() for s in slots], [m.cuda() for m in masks])
    for plan in (host_plan, dev_plan):
        torch_out = tree_attention_torch(qc, kc, vc, plan, 0.125)
        assert torch.allclose(torch_out.cpu(), ref, atol=1e-5)
        assert torch.allclose(tree_attention_triton(qc, kc, vc, plan, 0.125), torch_out, atol=1e-5)


@cuda
def test_gpu_verification_is_sync_free_and_matches_the_cpu():
    _skip_without_cuda()
    gen = torch.Generator().manual_seed(1)
    for trial in range(20):
        tree = random_tree(int(torch.randint(2, 30, (), generator=gen)), gen, vocab=4, seq_len=9)
        probs = torch.softmax(torch.randn(tree.num_nodes, 4, generator=gen) * 2, -1)
        target = probs.argmax(-1)
        dev_tree = tree_from_parents(tree.draft_tokens.cuda(), tree.parents.cuda(), 9)
        dev_probs, dev_target = probs.cuda(), target.cuda()
        g = torch.Generator(device="cuda").manual_seed(trial)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any synchronizing call in here raises
        try:
            paths = [greedy_path(dev_tree, dev_target), coupled_path(dev_tree, dev_probs, trial, 9)]
            paths.append(sampling_path(dev_tree, dev_probs, g))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        greedy, seeded, _ = to_host(paths)
        assert greedy == to_host([greedy_path(tree, target)])[0]
        assert seeded == coupled_verify(dev_tree, dev_probs.__getitem__, trial)  # the same device's noise


@cuda
@pytest.mark.parametrize("kind", ["point", "chain"])
def test_gpu_sampling_path_keeps_the_target_law(kind):
    _skip_without_cuda()
    assert _check_law(kind, "cuda", torch.Generator(device="cuda").manual_seed(11)) > 1e-3


@cuda
def test_gpu_probs_and_penalties_match_the_cpu():
    _skip_without_cuda()
    gen = torch.Generator().manual_seed(2)
    tree = random_tree(12, gen, vocab=1000, seq_len=30)
    logits = torch.randn(12, 1000, generator=gen) * 3
    for params in (
        SamplingParams(temperature=0.7, top_k=40, top_p=0.9),
        SamplingParams(
            temperature=1.0, top_p=0.5, repetition_penalty=1.3, presence_penalty=0.4, logit_bias=((4, 2.0),)
        ),
    ):
        rows = [penalize_tree(x, params, [1, 2, 3], [4, 5, 4], t) for x, t in ((logits, tree), (logits.cuda(), tree))]
        assert torch.allclose(rows[1].cpu(), rows[0], atol=1e-6)
        cpu, dev = logits_to_probs(rows[0], params), logits_to_probs(rows[1], params)
        assert torch.allclose(dev.cpu(), cpu, atol=1e-6)
