"""Merged multi-drafter trees (drafters/merged.py): the merge (prefix sharing, budget, parents closure,
provenance, layout), the sampled rows, the registry's '+' names, greedy identity on the real SmolLM2, and
tau against the members alone (the CLI: tests/entrypoints/test_generate_merged.py).

The sampled law is checked twice with the chi-square pattern of test_distribution.py: on the merge and
sampling_verify alone, with proposal laws chosen so members collide often (many cheap samples; two
broken merge rules must fail), and end to end in the engine with real drafters on a tiny Llama (there
the members seldom collide with a surviving point mass, so a broken rule's bias is too rare to show: the
first rule below passed the end-to-end test at p = 0.25; hence the verify-level failing tests)."""

import random

import pytest
import torch
from helpers import alone_or_batched, compare_to_reference, slots_whole, tiny_target
from oracles import sampling_verify
from test_distribution import PROMPT, SAMPLES, chi2_pvalue, exact_joint_t2_t3

from serving.config import EngineConfig
from serving.engine import Engine
from sglang_ext.drafters import DraftModelDrafter, NgramDrafter, default_tree, make_drafter, merge_members
from sglang_ext.drafters.base import DraftInput, TargetCapture
from sglang_ext.drafters.lookahead import LookaheadDrafter
from sglang_ext.drafters.merged import MemberShape, MergedDrafter, Trie, merge_trees
from sglang_ext.drafters.ngram import trie_tree
from sglang_ext.sampling import SamplingParams
from sglang_ext.tree import TreeShape, tree_from_parents

SEQ = 10  # the root's position in the hand-built trees


def _tree(tokens, parents, scores=None, probs=None):
    s = None if scores is None else torch.tensor(scores, dtype=torch.float)
    return tree_from_parents(torch.tensor(tokens), torch.tensor(parents), SEQ, draft_probs=probs, scores=s)


def _paths(tree) -> dict[tuple[int, ...], int]:
    """token path (root excluded) -> node index."""
    toks = tree.draft_tokens.tolist()
    return {tuple(toks[j] for j in tree.path_to(i)[1:]): i for i in range(tree.num_nodes)}


def check_layout(tree, seq_len=SEQ):
    """The SGLang layout fields agree with the parents: positions, mask rows, child / sibling lists, and
    siblings hold distinct tokens (a trie: the accepted path is unique)."""
    n, par, toks = tree.num_nodes, tree.parents.tolist(), tree.draft_tokens.tolist()
    assert par[0] == -1 and all(0 <= par[i] < i for i in range(1, n))
    for i in range(n):
        path = tree.path_to(i)
        assert int(tree.positions[i]) == seq_len + len(path) - 1
        assert tree.tree_mask[i].nonzero().flatten().tolist() == sorted(path)
        kids = [c for c in range(n) if par[c] == i]
        assert len({toks[c] for c in kids}) == len(kids), "siblings must hold distinct tokens"
        listed, c = [], int(tree.retrieve_next_token[i])
        while c != -1:
            listed.append(c)
            c = int(tree.retrieve_next_sibling[c])
        assert listed == kids


A = _tree([9, 1, 2, 3], [-1, 0, 1, 2], [1, 0.9, 0.8, 0.7])
B = _tree([9, 1, 2, 4, 5], [-1, 0, 1, 2, 0], [1, 0.6, 0.5, 0.4, 0.3])


def test_common_prefixes_are_shared_and_each_node_remembers_its_drafters():
    tree, prov, where = merge_trees([A, B], [1, 2], budget=10, seq_len=SEQ)
    check_layout(tree)
    paths = _paths(tree)
    assert set(paths) == {(), (1,), (1, 2), (1, 2, 3), (1, 2, 4), (5,)}
    bits = {p: int(prov[i]) for p, i in paths.items()}
    assert bits == {(): 0, (1,): 3, (1, 2): 3, (1, 2, 3): 1, (1, 2, 4): 2, (5,): 2}
    assert where == [
        [0, paths[(1,)], paths[(1, 2)], paths[(1, 2, 3)]],
        [0, paths[(1,)], paths[(1, 2)], paths[(1, 2, 4)], paths[(5,)]],
    ]
    # a shared node's score is the noisy-or of its proposers' (ranked up), the others keep their own
    assert tree.scores[paths[(1,)]].item() == pytest.approx(1 - 0.1 * 0.4)
    assert tree.scores[paths[(5,)]].item() == pytest.approx(0.3)
    assert tree.draft_probs is None  # point masses only


def test_the_budget_keeps_the_best_nodes_closed_under_parents():
    tree, prov, where = merge_trees([A, B], [1, 2], budget=4, seq_len=SEQ)
    check_layout(tree)
    assert set(_paths(tree)) == {(), (1,), (1, 2), (1, 2, 3)}  # 0.96, 0.9, 0.7 beat 0.4 and 0.3
    assert where[1] == [0, 1, 2, -1, -1]  # B's cut nodes
    # two drafters agreeing on a node rank it above a single drafter's likelier one
    agree = [_tree([9, 7], [-1, 0], [1, 0.5]), _tree([9, 7], [-1, 0], [1, 0.5]), _tree([9, 8], [-1, 0], [1, 0.7])]
    tree, prov, _ = merge_trees(agree, [1, 2, 4], budget=2, seq_len=SEQ)
    assert tree.draft_tokens.tolist() == [9, 7] and prov.tolist() == [0, 3]


def test_random_merges_keep_the_layout_the_budget_and_every_members_paths():
    rng = random.Random(0)
    for trial in range(40):
        shape = TreeShape(rng.randint(1, 4), rng.randint(1, 3), 2)
        shape = TreeShape(shape.depth, shape.topk, rng.randint(2, 1 + shape.topk * shape.depth))
        members = []
        for _ in range(rng.randint(2, 4)):
            conts = [[rng.randrange(6) for _ in range(rng.randint(1, 4))] for _ in range(rng.randint(0, 5))]
            members.append(trie_tree(9, SEQ, [(c, rng.random() + 0.1) for c in conts], shape, confidence=rng.random()))
        budget = rng.randint(1, 12)
        tree, prov, where = merge_trees(members, [1 << k for k in range(len(members))], budget, SEQ)
        check_layout(tree)
        assert tree.num_nodes <= budget or tree.num_nodes == 1
        paths = _paths(tree)
        scores = tree.scores.tolist()
        for k, m in enumerate(members):
            mine = _paths(m)
            for path, node in mine.items():
                got = where[k][node]
                assert (got >= 0) == (path in paths), f"trial {trial}: member {k}'s map"
                if got >= 0:
                    assert paths[path] == got and (node == 0 or int(prov[got]) >> k & 1)
        for i in range(1, tree.num_nodes):
            assert int(prov[i]) != 0 and scores[i] <= scores[int(tree.parents[i])] + 1e-6
        # nothing cut scores above a kept node whose parent is kept (the cut is by score)
        cut = [p for k, m in enumerate(members) for p in _paths(m) if p not in paths and p[:-1] in paths]
        if cut and tree.num_nodes > 1:
            best_cut = max(
                1 - torch.tensor([1 - float(m.scores[_paths(m)[p]]) for m in members if p in _paths(m)]).prod().item()
                for p in cut
            )
            assert best_cut <= min(scores[1:]) + 1e-6


def _q(seed, vocab=8):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(vocab, generator=g) * 2, -1)


def _sampled(tokens, seed):
    rows = torch.stack([torch.zeros(8)] + [_q(seed + i) for i in range(len(tokens) - 1)])
    return _tree(tokens, list(range(-1, len(tokens) - 1)), probs=rows)


def test_sampled_nodes_come_first_with_their_rows_restricted_to_earlier_siblings():
    a = _sampled([9, 3, 4], seed=1)  # member 0: a sampled chain
    c = _sampled([9, 3, 7], seed=5)  # member 1: another; 3 joins a's node, 7 is a sibling of 4
    d = _sampled([9, 2, 6], seed=9)  # member 2: 2 is a new root child (beside 3)
    points = _tree([9, 3, 6, 5], [-1, 0, 1, 0], [1, 0.9, 0.8, 0.7])  # member 3: point masses
    tree, prov, where = merge_trees([points, a, c, d], [8, 1, 2, 4], budget=9, seq_len=SEQ)
    check_layout(tree)
    p = _paths(tree)
    rows = tree.draft_probs
    assert torch.allclose(rows[p[(3,)]], a.draft_probs[1].double())  # first at the root: q as drawn
    assert torch.allclose(rows[p[(3, 4)]], a.draft_probs[2].double())
    q7 = c.draft_probs[2].double().clone()
    q7[4] = 0
    assert torch.allclose(rows[p[(3, 7)]], q7 / q7.sum())  # without a's 4, renormalised
    q2 = d.draft_probs[1].double().clone()
    q2[3] = 0
    assert torch.allclose(rows[p[(2,)]], q2 / q2.sum())
    for path in [(3, 6), (5,)]:  # point masses: one-hot rows, after the sampled siblings
        assert rows[p[path]].tolist() == torch.nn.functional.one_hot(torch.tensor(path[-1]), 8).double().tolist()
    assert p[(3, 4)] < p[(3, 7)] < p[(3, 6)] and p[(3,)] < p[(2,)] < p[(5,)]
    assert int(prov[p[(3,)]]) == 1 | 2 | 8 and int(prov[p[(3, 6)]]) == 8
    # each member's sampled nodes take at most its share of the budget: ceil((5 - 1) / 4) = 1
    tree, _, where = merge_trees([points, a, c, d], [8, 1, 2, 4], budget=5, seq_len=SEQ)
    check_layout(tree)
    assert where[1] == [0, 1, -1] and set(_paths(tree)) >= {(3,), (2,)}


def test_registry_parses_merged_names_and_their_default_tree():
    assert merge_members("suffix+eagle3") == ["suffix", "eagle3"] and merge_members("suffix") is None
    assert default_tree("suffix+eagle3") == TreeShape(3, 2, 6, 0.1)  # 3,1,4 and 1,2,3,0.1: both whole
    assert default_tree("ngram+lookahead") == TreeShape(6, 2, 15)
    for bad in ["suffix+nope", "suffix+suffix", "suffix+none", "suffix+", "auto+eagle3"]:
        with pytest.raises(ValueError, match="merged drafter"):
            make_drafter(bad, None)
    d = make_drafter("ngram+lookahead-w5-n3", None)
    assert d.name == "ngram+lookahead-w5-n3" and d.members[1].window == 5
    assert (d.capture_layers, d.needs_commit, d.wants_tree_argmax, d.reads_reference) == ((), True, True, True)
    with pytest.raises(ValueError, match="2 to"):
        MergedDrafter([NgramDrafter()])


def _input(rid, tokens):
    return DraftInput(rid, list(tokens), SamplingParams(), None)


def test_members_share_the_lifecycle_and_get_their_own_tree_argmax():
    look = LookaheadDrafter(window=3, ngram=3)
    d = MergedDrafter([NgramDrafter(), look], ["ngram", "lookahead"])
    seq = [7, 1, 2, 7, 3, 4, 7, 5, 6, 9, 7]
    d.add_request(0, TargetCapture(seq[:-1], torch.arange(10), torch.arange(10)))
    tree = d.propose([_input(0, seq)], TreeShape(3, 3, 12))[0]
    check_layout(tree, len(seq) - 1)
    prop = d._pending[0]
    mine = prop.where[1]
    assert min(mine) >= 0  # the budget kept every lookahead node
    argmax = torch.arange(100, 100 + tree.num_nodes)
    seen = []
    look_commit = look.commit
    look.commit = lambda rid, cap: (seen.append(cap.tree_argmax), look_commit(rid, cap))
    first = int(tree.draft_tokens[1])
    d.commit(0, TargetCapture([7, first], torch.tensor([10, 11]), torch.tensor([0, 1]), tree_argmax=argmax))
    assert seen[0].tolist() == [100 + n for n in mine]  # re-indexed to lookahead's own nodes
    assert d.stats.steps == 1 and sum(d.stats.accepted) >= 1
    # member arms: one member alone drafts exactly its own tree
    alone = d.propose([_input(0, seq + [first, 3])], MemberShape(3, 3, 12, members=(0,)))[0]
    own = NgramDrafter().propose([_input(0, seq + [first, 3])], TreeShape(3, 3, 12))[0]
    assert torch.equal(alone.draft_tokens, own.draft_tokens) and torch.equal(alone.parents, own.parents)
    d.remove_request(0)
    assert not d._pending and not look._states


# --- the sampled law ------------------------------------------------------------------------------


def _members(target):
    """Two sampling drafters (their chains carry q rows) and a lookup one (point masses)."""
    slots = SAMPLES * 16
    return (
        [
            DraftModelDrafter.self_draft(target.model, layers=[0], num_slots=slots),
            DraftModelDrafter.self_draft(target.model, layers=[1], num_slots=slots),
            NgramDrafter(),
        ],
        ["self-l0", "self-l1", "ngram"],
    )


def _sample_law(drafter, target, shape, params):
    eng = Engine(target, drafter, EngineConfig(tree=shape, kv_slots=SAMPLES * 16))
    fallbacks = []
    eng.on_fallback = lambda r, why: fallbacks.append(why)
    reqs = [eng.add_request(PROMPT, params) for _ in range(SAMPLES)]
    for i, r in enumerate(reqs):
        r.generator.manual_seed(i)
    while eng.has_work:
        eng.step()
    assert not fallbacks, f"drafter failed: {set(fallbacks)}"
    v = target.cfg.vocab_size
    counts = torch.zeros(v, v, dtype=torch.float64)
    for r in reqs:
        counts[r.output_ids[1], r.output_ids[2]] += 1
    return counts, sum(r.stats.accepted_tokens for r in reqs)


LAW_SHAPES = {"chain": TreeShape.chain(3), "tree": TreeShape(2, 2, 5)}
# a flat target law: a broken merge's bias is largest where the target's probabilities are moderate
LAW_TEMPERATURE = 1.5


@pytest.mark.parametrize("shape", LAW_SHAPES, ids=list(LAW_SHAPES))
def test_sampling_over_the_merged_tree_keeps_the_target_law(shape):
    """Unseeded sampling (sampling_verify with the merged rows) of the 2nd and 3rd tokens; the chain
    shape mixes restricted q rows (a second sampled member's new nodes) with point masses."""
    target = tiny_target(seed=3)
    params = SamplingParams(temperature=LAW_TEMPERATURE, max_new_tokens=3)
    drafter = MergedDrafter(*_members(target))
    counts, accepted = _sample_law(drafter, target, LAW_SHAPES[shape], params)
    assert accepted > SAMPLES * 0.3, "drafts must be accepted or this proves nothing"
    assert sum(drafter.stats.accepted[:2]) > 0 and drafter.stats.accepted[2] > 0
    assert chi2_pvalue(counts, exact_joint_t2_t3(target.model, params)) > 1e-3


def q_on_shared_node(trees, bits, budget, seq_len, batch_index=0):
    """Broken on purpose: point masses first; a sampled token equal to one takes the shared node with its
    q row (and a new sampled node keeps its whole q). The shared node's token is not a sample of q there."""
    trie = Trie([int(trees[0].draft_tokens[0])])
    where = [trie.add_points(t, b) if t.draft_probs is None else None for t, b in zip(trees, bits)]
    for k, (t, b) in enumerate(zip(trees, bits)):
        if t.draft_probs is not None:
            where[k] = trie.add_sampled(t, b, budget, -(-(budget - 1) // len(trees)))
            for i, w in enumerate(where[k][1:], 1):
                if w >= 0:
                    trie.row[w], trie.fixed[w] = t.draft_probs[i].double(), True
    kept = trie.select(budget)
    tree, prov = trie.build(kept, seq_len, batch_index)
    new = {o: n for n, o in enumerate(kept)}
    return tree, prov, [[new.get(w, -1) for w in wk] for wk in where]


def unrestricted_rows(trees, bits, budget, seq_len, batch_index=0):
    """Broken on purpose: the right order, but a sampled node keeps its member's whole q row although it
    exists only when its token differs from its earlier siblings'."""
    tree, prov, where = merge_trees(trees, bits, budget, seq_len, batch_index)
    for t, b, wk in zip(trees, bits, where):
        if t.draft_probs is not None:
            for i, w in enumerate(wk[1:], 1):
                made = w >= 0 and int(prov[w]) & -int(prov[w]) == b  # this member made the node (bits in order)
                if made:
                    tree.draft_probs[w] = t.draft_probs[i].double()
    return tree, prov, where


# the merge and sampling_verify alone, on proposal laws chosen so that a broken rule shows: the target's
# first two tokens (p1, p2[t1]); two sampled members (chains drawn from qa / qc here, rows as drawn) and
# a point-mass chain on the target's likeliest tokens. Many cheap samples: the exact law is known.
V, VERIFY_SAMPLES = 6, 20000


def _law(seed, flat):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(V, generator=g) / flat, -1).double()


def _peaked(token, mass):
    q = torch.full((V,), (1 - mass) / (V - 1), dtype=torch.float64)
    q[token] = mass
    return q


# both sampled members favour a token the target does not (1): they collide there often, and the
# second one's other draws are the case a restricted row exists for
P1, P2 = _law(0, 1.0), torch.stack([_law(10 + x, 1.0) for x in range(V)])
QA1, QA2 = _peaked(1, 0.9), torch.stack([_law(20 + x, 1.5) for x in range(V)])
QC1, QC2 = _peaked(1, 0.9), torch.stack([_law(30 + x, 0.7) for x in range(V)])


def _draw(q, g):
    return int(torch.multinomial(q, 1, generator=g))


def _merged_law(merge, budget):
    """Counts [V, V] of the first two tokens emitted: verify the merged tree of depth-2 member chains with
    the target's rows, then (a path shorter than 2) the next token from the target itself."""
    g = torch.Generator().manual_seed(0)
    b1 = int(P1.argmax())
    points = _tree([9, b1, int(P2[b1].argmax())], [-1, 0, 1], [1, 0.9, 0.8])
    counts = torch.zeros(V, V, dtype=torch.float64)
    merged = {}  # the members' draws -> (merged tree, the target's rows): a merge is a function of them
    for _ in range(VERIFY_SAMPLES):
        draws = []
        for q1, q2 in ((QA1, QA2), (QC1, QC2)):
            x1 = _draw(q1, g)
            draws.append((x1, _draw(q2[x1], g)))
        key = tuple(draws)
        if key not in merged:
            chains = [
                _tree([9, x1, x2], [-1, 0, 1], probs=torch.stack([q1, q1, q2[x1]]).float())
                for (x1, x2), (q1, q2) in zip(draws, ((QA1, QA2), (QC1, QC2)))
            ]
            tree = merge(chains + [points], [1, 2, 4], budget, SEQ)[0]
            toks, depth = tree.draft_tokens.tolist(), (tree.positions - SEQ).tolist()
            # the target after each node: P1 at the root, P2[x] after a depth-1 node x (deeper: not recorded)
            merged[key] = (
                tree,
                torch.stack([P2[toks[i]] if depth[i] == 1 else P1 for i in range(tree.num_nodes)]).float(),
            )
        tree, rows = merged[key]
        res = sampling_verify(tree, rows, g)
        t1 = res.tokens[0]
        t2 = res.tokens[1] if len(res.tokens) > 1 else _draw(P2[t1], g)
        counts[t1, t2] += 1
    return counts


@pytest.mark.parametrize("budget", [4, 6])
def test_the_merge_rule_keeps_the_law_where_members_collide(budget):
    """Two sampled members and a point mass collide at the root and below (joins, restricted siblings,
    point masses after sampled ones); budget 4: each sampled member's share is 1, 6: 2."""
    counts = _merged_law(merge_trees, budget)
    assert chi2_pvalue(counts, P1[:, None] * P2) > 1e-3


@pytest.mark.parametrize("broken", ["q_on_shared_node", "unrestricted_rows"])
def test_broken_merge_rules_fail_the_law(broken):
    counts = _merged_law(globals()[broken], 6)
    assert chi2_pvalue(counts, P1[:, None] * P2) < 1e-6


# --- the real SmolLM2 -----------------------------------------------------------------------------

NEW_TOKENS = 16
GREEDY_SHAPES = {"chain": TreeShape.chain(3), "tree": TreeShape(3, 2, 6)}


@pytest.fixture(scope="module")
def prompts(eval_prompts):
    return eval_prompts[::3]  # 8 prompts, from every eval set


@pytest.fixture(scope="module")
def vanilla_outputs(smollm2_fp32, prompts):
    eng = Engine(smollm2_fp32, None)
    return [r.output_ids for r in eng.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS))]


@pytest.mark.parametrize("name", ["suffix+eagle3", "ngram+lookahead"])
@pytest.mark.parametrize("shape", GREEDY_SHAPES, ids=list(GREEDY_SHAPES))
@pytest.mark.parametrize("bs", [1, 4])
def test_greedy_identity(smollm2_fp32, prompts, vanilla_outputs, name, shape, bs):
    half = alone_or_batched(bs)
    prompts, vanilla_outputs = prompts[half], vanilla_outputs[half]
    drafter = make_drafter(name, smollm2_fp32)
    eng = Engine(smollm2_fp32, drafter, EngineConfig(tree=GREEDY_SHAPES[shape]))
    outs = []
    for i in range(0, len(prompts), bs):
        outs += [r.output_ids for r in eng.generate(prompts[i : i + bs], SamplingParams(max_new_tokens=NEW_TOKENS))]
    verdicts = [compare_to_reference(smollm2_fp32.model, p, r, o) for p, r, o in zip(prompts, vanilla_outputs, outs)]
    assert "bug" not in verdicts, f"{name}/{shape}/bs{bs}: output differs from vanilla away from a tie: {verdicts}"
    assert slots_whole(eng), "KV slots leaked"
    st = drafter.stats
    assert st.steps > 0 and all(a > 0 for a in st.accepted), f"every member must get drafts accepted: {st}"
    assert all(a <= p for a, p in zip(st.accepted, st.proposed))


def test_tau_of_the_merge_is_at_least_its_best_members_at_the_same_budget(smollm2_fp32, eval_prompts):
    """suffix+eagle3 against suffix and eagle3 alone, all at the merge's default tree (3,2,6,0.1): the
    same node budget. One prompt per eval set, 24 tokens."""
    shape = default_tree("suffix+eagle3")
    sp = SamplingParams(max_new_tokens=24)
    tau = {}
    for name in ["suffix", "eagle3", "suffix+eagle3"]:
        eng = Engine(smollm2_fp32, make_drafter(name, smollm2_fp32), EngineConfig(tree=shape))
        reqs = [eng.generate([p], sp)[0] for p in eval_prompts[::4]]
        steps = sum(r.stats.verify_steps for r in reqs)
        tau[name] = (steps + sum(r.stats.accepted_tokens for r in reqs)) / steps
    assert tau["suffix+eagle3"] >= max(tau["suffix"], tau["eagle3"]), tau
