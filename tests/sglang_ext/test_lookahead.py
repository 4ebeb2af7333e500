"""Lookahead decoding drafter: the n-gram pool, diagonal n-grams and the Jacobi window on synthetic
trajectories; the engine's tree_argmax; greedy identity on the real SmolLM2; the sampled law (chi-square)."""

import pytest
import torch
from helpers import alone_or_batched, compare_to_reference, generate_in_groups, slots_whole, tiny_target
from test_distribution import PROMPT, SAMPLES, chi2_pvalue, exact_joint_t2_t3

from serving.config import EngineConfig
from serving.engine import Engine
from sglang_ext.drafters import available_drafters, default_tree, make_drafter
from sglang_ext.drafters.base import DraftInput, TargetCapture
from sglang_ext.drafters.lookahead import (
    LookaheadDrafter,
    NgramPool,
    diagonal_ngrams,
    parse_spec,
    sequence_ngrams,
)
from sglang_ext.sampling import SamplingParams
from sglang_ext.tree import TreeShape

NEW_TOKENS = 20
SHAPES = {"chain": TreeShape.chain(4), "tree": TreeShape(3, 3, 10)}


def _input(rid, tokens):
    return DraftInput(rid, list(tokens), SamplingParams(), None)


def _capture(tokens, argmax=None):
    n = len(tokens)
    return TargetCapture(list(tokens), torch.arange(n), torch.arange(n), tree_argmax=argmax)


def _chain(tree):
    """The tree's tokens along its first-child path, root first."""
    node, out = 0, [int(tree.draft_tokens[0])]
    while (node := int(tree.retrieve_next_token[node])) != -1:
        out.append(int(tree.draft_tokens[node]))
    return out


def test_spec_parsing_registry_and_default_tree():
    assert parse_spec("lookahead") == (3, 4) and parse_spec("lookahead-w7-n3") == (7, 3)
    assert parse_spec("lookahead-n5") == (3, 5) and parse_spec("ngram") is None and parse_spec(None) is None
    for bad in ["lookahead:x,y", "lookahead:5,4", "lookahead-wx", "lookahead-w0", "lookahead-n1", "lookahead-w3n4"]:
        with pytest.raises(ValueError, match=r"lookahead\[-wW\]\[-nN\]"):
            make_drafter(bad, None)
    d = make_drafter("lookahead-w7-n3", None)
    assert (d.window, d.ngram) == (7, 3) and (make_drafter("lookahead", None).window, d.wants_tree_argmax) == (3, True)
    assert default_tree("lookahead") == TreeShape.chain(3) and default_tree("lookahead-w7-n3") == TreeShape.chain(7)
    assert default_tree("lookahead-w1-n5") == TreeShape.chain(4)  # the spine holds a whole candidate
    assert {"lookahead", "lookahead[-wW][-nN]"} <= set(available_drafters())


def test_pool_keeps_the_most_recent_ngrams_per_first_token():
    pool = NgramPool(per_key=2)
    for gram in [(1, 2, 3), (1, 4, 5), (1, 2, 3), (1, 6, 7), (2, 9, 9)]:
        pool.add(gram)
    assert pool.candidates(1) == [(6, 7), (2, 3)]  # (4, 5) was the least recently seen
    assert pool.candidates(2) == [(9, 9)] and pool.candidates(3) == []
    assert sequence_ngrams([1, 2, 3, 4, 5], 3) == [[1, 2, 3], [2, 3, 4], [3, 4, 5]]
    assert sequence_ngrams([1, 2, 3, 4, 5], 3, start=4) == [[3, 4, 5]]  # only those ending at index 4 or later
    assert sequence_ngrams([1, 2], 3) == []


def test_diagonal_ngrams_follow_the_jacobi_trajectory():
    # iteration s: spine tokens y (root at position 10) and the target's argmax z after each
    y1, z1 = {10: 1, 11: 2, 12: 3}, {11: 5, 12: 6, 13: 7}
    y2, z2 = {11: 5, 12: 6, 13: 8}, {12: 9, 13: 4, 14: 0}  # position 13 was refilled: 8, not z1's 7
    assert diagonal_ngrams([(y1, z1)], 2) == [[1, 5], [2, 6], [3, 7]]  # N=2: (token, the target's next)
    # each link y^{s+1}_{q+1} == z^s_{q+1} holds except into position 13
    assert diagonal_ngrams([(y1, z1), (y2, z2)], 3) == [[1, 5, 9], [2, 6, 4]]
    assert diagonal_ngrams([(y1, z1)], 3) == []  # not yet N-1 iterations
    assert diagonal_ngrams([({}, {}), (y1, z1), (y2, z2)], 3) == [[1, 5, 9], [2, 6, 4]]  # the last N-1 only


def test_window_shifts_by_the_accepted_tokens_and_iterates():
    d = LookaheadDrafter(window=3, ngram=3)
    d.add_request(0, _capture([10, 11, 12]))  # the prompt seeds the pool
    assert d._states[0].pool.candidates(10) == [(11, 12)]
    seq = [10, 11, 12, 13]
    t1 = d.propose([_input(0, seq)], TreeShape.chain(3))[0]
    g = _chain(t1)[1:]  # no n-gram starts with 13: random prompt tokens
    assert len(g) == 3 and set(g) <= set(seq)
    d.commit(0, _capture([13], torch.tensor([20, 21, 22, 23])))  # nothing accepted, bonus 20
    seq += [20]
    t2 = d.propose([_input(0, seq)], TreeShape.chain(3))[0]
    assert _chain(t2) == [20, 21, 22, 23]  # the Jacobi update of the window, shifted by one
    d.commit(0, _capture([20, 21], torch.tensor([21, 30, 31, 32])))  # 21 accepted, bonus 30
    pool = d._states[0].pool
    # the diagonals of two iterations: (13, 20, 21), and (g_i, 21 + i, 30 + i) after each guess g_i
    assert (20, 21) in pool.candidates(13) and (21, 30) in pool.candidates(g[0])
    assert (22, 31) in pool.candidates(g[1]) and (23, 32) in pool.candidates(g[2])
    seq += [21, 30]
    t3 = d.propose([_input(0, seq)], TreeShape.chain(3))[0]
    assert _chain(t3)[:3] == [30, 31, 32]  # shifted by the accepted token + the bonus
    # a tree this drafter did not propose (or one without argmaxes) teaches nothing
    before = dict(d._states[0].guess)
    d.commit(0, _capture([30], torch.tensor([1, 2])))
    d.commit(0, _capture([30], None))
    assert d._states[0].guess == before
    d.remove_request(0)
    assert not d._states


def test_a_pool_candidate_heads_the_spine_and_the_tree_respects_the_shape():
    d = LookaheadDrafter(window=5, ngram=3)
    seq = [7, 1, 2, 7, 3, 4, 7, 5, 6, 9, 7]
    d.add_request(0, _capture(seq[:-1]))
    chain = d.propose([_input(0, seq)], TreeShape.chain(5))[0]
    assert _chain(chain)[:3] == [7, 5, 6]  # the most recent n-gram after 7, then the window
    for shape in [TreeShape(5, 2, 9), TreeShape(3, 3, 10), TreeShape(2, 2, 4), TreeShape.chain(1)]:
        tree = d.propose([_input(0, seq)], shape)[0]
        assert 1 < tree.num_nodes <= shape.num_draft_tokens
        assert int((tree.positions - tree.positions[0]).max()) <= shape.depth
        assert int(torch.bincount(tree.parents[1:], minlength=tree.num_nodes).max()) <= shape.topk
        if shape.topk > 1:  # other candidates (three n-grams start with 7) beside the spine
            assert int(torch.bincount(tree.parents[1:], minlength=tree.num_nodes)[0]) == min(3, shape.topk)


def test_engine_fills_tree_argmax_only_for_drafters_that_want_it():
    t = tiny_target(seed=2, vocab=16)

    class Recording(LookaheadDrafter):
        def __init__(self, wants):
            super().__init__(window=3, ngram=3)
            self.wants_tree_argmax, self.seen = wants, []

        def propose(self, batch, shape):
            self.trees = super().propose(batch, shape)
            return self.trees

        def commit(self, rid, capture):
            self.seen.append((self.trees[0].num_nodes, int(capture.positions[0]), capture.tree_argmax))
            super().commit(rid, capture)

    prompt, sp = [1, 2, 3, 1, 2], SamplingParams(max_new_tokens=12, ignore_eos=True)
    for wants in (True, False):
        d = Recording(wants)
        seq = prompt + Engine(t, d, EngineConfig(tree=TreeShape.chain(3))).generate([prompt], sp)[0].output_ids
        assert d.seen
        for n, root_pos, argmax in d.seen:
            if not wants:
                assert argmax is None
                continue
            assert argmax.shape == (n,) and int(argmax[0]) == seq[root_pos + 1]  # greedy: the root's argmax is next


@pytest.fixture(scope="module")
def prompts(eval_prompts):
    """Every other eval prompt (two of each set): the engine's identity tests cover all of them for the
    engine-side paths; these cover the lookahead drafter's own."""
    return eval_prompts[::2]


@pytest.fixture(scope="module")
def vanilla_outputs(smollm2_fp32, prompts):
    eng = Engine(smollm2_fp32, None)
    return [r.output_ids for r in eng.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS))]


@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
@pytest.mark.parametrize("bs", [1, 4])
def test_greedy_identity(smollm2_fp32, prompts, vanilla_outputs, shape, bs):
    half = alone_or_batched(bs)
    prompts, vanilla_outputs = prompts[half], vanilla_outputs[half]
    eng = Engine(smollm2_fp32, make_drafter("lookahead", smollm2_fp32), EngineConfig(tree=SHAPES[shape]))
    outs, steps = generate_in_groups(eng, prompts, bs, NEW_TOKENS)
    verdicts = [compare_to_reference(smollm2_fp32.model, p, r, o) for p, r, o in zip(prompts, vanilla_outputs, outs)]
    assert "bug" not in verdicts, f"lookahead/{shape}/bs{bs}: output differs from vanilla away from a tie: {verdicts}"
    assert steps > 0 and slots_whole(eng), "no draft accepted, or KV slots leaked"


def test_accepts_drafts_on_a_repetitive_prompt(smollm2_fp32):
    text = "Repeat this list five times, one per line: red, green, blue, yellow, purple, orange."
    prompt = smollm2_fp32.encode_chat([{"role": "user", "content": text}])
    sp = SamplingParams(max_new_tokens=60)
    vanilla = Engine(smollm2_fp32, None).generate([prompt], sp)[0].output_ids
    r = Engine(smollm2_fp32, make_drafter("lookahead", smollm2_fp32), EngineConfig(tree=TreeShape.chain(3))).generate(
        [prompt], sp
    )[0]
    assert compare_to_reference(smollm2_fp32.model, prompt, vanilla, r.output_ids) != "bug"
    assert r.stats.accept_length > 1.5, r.stats


@pytest.mark.parametrize("shape", [TreeShape.chain(3), TreeShape(2, 2, 5)], ids=["chain", "tree"])
def test_sampling_keeps_the_target_law(shape):
    """Unseeded sampling (speculative sampling, each request its own generator) of the 2nd and 3rd tokens."""
    target = tiny_target(seed=3)
    params = SamplingParams(temperature=0.7, max_new_tokens=3)
    eng = Engine(target, LookaheadDrafter(window=2, ngram=2), EngineConfig(tree=shape, kv_slots=SAMPLES * 16))
    reqs = [eng.add_request(PROMPT, params) for _ in range(SAMPLES)]
    for i, r in enumerate(reqs):
        r.generator.manual_seed(i)
    while eng.has_work:
        eng.step()
    v = target.cfg.vocab_size
    counts = torch.zeros(v, v, dtype=torch.float64)
    for r in reqs:
        counts[r.output_ids[1], r.output_ids[2]] += 1
    assert sum(r.stats.accepted_tokens for r in reqs) > SAMPLES * 0.2, "drafts must be accepted or this proves nothing"
    assert chi2_pvalue(counts, exact_joint_t2_t3(target.model, params)) > 1e-3
