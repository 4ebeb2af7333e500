"""Penalties and logit bias: hand-checked rows, per-path contexts in a tree, parameter errors."""

import pytest
import torch

from sglang_ext.grammar import JSON_OBJECT
from sglang_ext.penalties import (
    ban_early_stops,
    bias_row,
    output_counts,
    penalize,
    penalize_rows,
    penalize_tree,
    penalty_values,
    prompt_mask,
    tree_output_counts,
)
from sglang_ext.sampling import InvalidRequest, SamplingParams
from sglang_ext.tree import chain_tree, tree_from_parents


def test_penalize_by_hand():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    counts = output_counts([3, 3, 1], 5)  # output: token 3 twice, token 1 once
    assert counts.tolist() == [0, 1, 0, 2, 0]
    p = SamplingParams(
        presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0, logit_bias=((0, -10.0), (4, 1.5))
    )
    got = penalize(logits, p, counts, prompt_ids=[2])
    # 0: bias only; 1: seen (output), negative -> *2, then -0.25*1 - 0.5; 2: in the prompt -> /2, no
    # output count; 3: seen, positive -> /2, then -0.25*2 - 0.5; 4: bias only
    assert got.tolist() == [[-8.0, -2.75, 0.25, 0.5, -0.5]]
    assert logits.tolist() == [[2.0, -1.0, 0.5, 3.0, -2.0]]  # the caller's rows are not modified


@pytest.mark.parametrize("rules", range(1, 16))
def test_a_requests_penalize_is_every_rules_ops_bit_for_bit(rules):
    """The host path runs only the rules a request sets; the graphs run all of them for a batch (penalize_rows), the
    ones off as identities: the same values either way (a -0.0 logit the graph's + 0 makes +0.0: equal), for every
    combination of bias, repetition, frequency and presence (logits with zeros of both signs, -inf; counts 0-2)."""
    gen = torch.Generator().manual_seed(rules)
    logits = torch.randn(4, 64, generator=gen) * 3
    logits[:, :4] = torch.tensor([0.0, -0.0, float("-inf"), 1.0])
    counts = torch.randint(0, 3, (4, 64), generator=gen).float()
    p = SamplingParams(
        logit_bias=((5, -1.5), (9, 2.25)) if rules & 1 else (),
        repetition_penalty=1.3 if rules & 2 else 1.0,
        frequency_penalty=0.4 if rules & 4 else 0.0,
        presence_penalty=0.7 if rules & 8 else 0.0,
    )
    prompt = [1, 7, 9, 30]
    rep, freq, pres = torch.tensor([penalty_values(p)]).unbind(1)
    every = penalize_rows(logits, counts, prompt_mask(prompt, 64), bias_row(p.logit_bias, 64), rep, freq, pres)
    got = penalize(logits, p, counts, prompt)
    assert torch.equal(got, every)
    assert got.data_ptr() != logits.data_ptr()


def test_tree_rows_count_their_own_path():
    #        root(7) ─┬─ 1(a=2) ── 3(b=2)
    #                 └─ 2(c=4)
    tree = tree_from_parents(torch.tensor([7, 2, 4, 2]), torch.tensor([-1, 0, 0, 1]), seq_len=10)
    base = output_counts([7, 5], 8)  # the root (7) is already in the output
    rows = tree_output_counts(base, tree)
    expect = base.expand(4, -1).clone()
    expect[1, 2] += 1
    expect[2, 4] += 1
    expect[3, 2] += 2
    assert torch.equal(rows, expect)


def test_penalized_tree_rows_equal_penalized_paths():
    """Each tree row is what a plain decode would penalize after that node's path."""
    g = torch.Generator().manual_seed(0)
    vocab, prompt, output = 16, [3, 4, 5], [9, 3, 9]
    tree = tree_from_parents(torch.tensor([9, 1, 3, 3, 1, 9]), torch.tensor([-1, 0, 0, 1, 3, 2]), seq_len=6)
    logits = torch.randn(tree.num_nodes, vocab, generator=g)
    p = SamplingParams(presence_penalty=0.7, frequency_penalty=0.3, repetition_penalty=1.3, logit_bias=((5, 2.0),))
    got = penalize_tree(logits, p, prompt, output, tree)
    for i in range(tree.num_nodes):
        path = [int(tree.draft_tokens[j]) for j in tree.path_to(i)[1:]]
        want = penalize(logits[i : i + 1], p, output_counts(output + path, vocab), prompt)
        assert torch.equal(got[i : i + 1], want), i
    chain = chain_tree(9, [], 6)  # a plain decode step: the output's counts alone
    assert torch.equal(
        penalize_tree(logits[:1], p, prompt, output, chain),
        penalize(logits[:1], p, output_counts(output, vocab), prompt),
    )


def test_min_tokens_bans_stops_by_depth():
    #  depth:   0       1        2       3
    #          root ─┬─ 1 ──── 3 ───── 4
    #                └─ 2
    tree = tree_from_parents(torch.tensor([9, 1, 3, 3, 1]), torch.tensor([-1, 0, 0, 1, 3]), seq_len=6)
    logits = torch.zeros(5, 8)
    got = ban_early_stops(logits, tree, output_len=3, min_tokens=5, stop_ids={0, 7})
    # row i chooses output token 3 + depth(i): tokens 3 and 4 may not stop -> the rows at depth 0 and 1
    banned = [bool(torch.isinf(got[i, [0, 7]]).all()) for i in range(5)]
    assert banned == [True, True, True, False, False]
    assert torch.isfinite(got[:, 1:7]).all() and torch.equal(logits, torch.zeros(5, 8))
    assert ban_early_stops(logits, tree, output_len=5, min_tokens=5, stop_ids={0}) is logits  # nothing to ban


def test_unpenalized_params_are_not_penalized():
    assert not SamplingParams().penalized
    assert not SamplingParams(presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0).penalized
    assert SamplingParams(logit_bias=((1, 0.0),)).penalized


@pytest.mark.parametrize(
    "kw,param",
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"frequency_penalty": True}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": 2.5}, "repetition_penalty"),
        ({"logit_bias": ((-1, 1.0),)}, "logit_bias"),
        ({"logit_bias": ((1, 101.0),)}, "logit_bias"),
        ({"logit_bias": ((1, 1.0), (1, 2.0))}, "logit_bias"),
        ({"logit_bias": tuple((i, 1.0) for i in range(301))}, "logit_bias"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 200, "max_new_tokens": 100}, "min_tokens"),
        ({"min_tokens": True}, "min_tokens"),
        ({"min_tokens": 3, "grammar": JSON_OBJECT}, "min_tokens"),
    ],
)
def test_bad_penalties_name_their_parameter(kw, param):
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(**kw)
    assert e.value.param == param


def test_a_draft_token_outside_the_vocabulary_counts_as_the_nearest_id():
    """A faulty drafter's token (never accepted) fails nothing: its row and those below it count the nearest id, the
    others their own paths (the request then falls back to vanilla decoding, as without penalties)."""
    tree = tree_from_parents(torch.tensor([9, 20, 3, 4]), torch.tensor([-1, 0, 0, 1]), seq_len=6)  # node 1: 20
    rows = tree_output_counts(output_counts([9], 16), tree)
    assert rows[1, 15] == rows[3, 15] == rows[3, 4] == rows[2, 3] == 1 and rows[0].sum() == 1 and rows[2, 15] == 0
