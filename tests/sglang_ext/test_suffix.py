"""Suffix drafter: the index against brute force, corpus files, online learning, build-corpus CLI.

Greedy identity with the real SmolLM2 runs in test_engine.py (parametrized over drafters)."""

import json
import os
import random
import subprocess
import sys

import pytest
import torch

from moa_serve.benchmarks.bench import bench_drafter
from sglang_ext.drafters import make_drafter
from sglang_ext.drafters.base import DraftInput, TargetCapture
from sglang_ext.drafters.ngram import FULL_CONFIDENCE_MATCH, match_confidence, trie_tree
from sglang_ext.drafters.suffix import CorpusError, SuffixDrafter, load_corpus, save_corpus
from sglang_ext.drafters.suffix_index import SuffixIndex
from sglang_ext.sampling import SamplingParams
from sglang_ext.settings import reload_settings
from sglang_ext.tree import TreeShape


def _brute(docs, ctx, length, max_len):
    for n in range(min(max_len, len(ctx)), 0, -1):
        pat = ctx[-n:]
        conts = [d[i + n : i + n + length] for d in docs for i in range(len(d) - n + 1) if d[i : i + n] == pat]
        if conts:
            return n, len(conts), sorted(c for c in conts if c)
    return 0, 0, []


def test_index_matches_brute_force():
    rng = random.Random(1)
    docs = [[rng.randrange(5) for _ in range(rng.randrange(0, 40))] for _ in range(30)]
    idx = SuffixIndex(docs, key_len=6)
    assert len(idx) == sum(map(len, docs))
    for _ in range(1500):
        ctx = [rng.randrange(6) for _ in range(rng.randrange(1, 10))]  # token 5 never occurs in the docs
        m = idx.lookup(ctx, 4, max_samples=10**9)
        assert (m.length, m.count, sorted(m.continuations)) == _brute(docs, ctx, 4, 6), ctx


def test_index_never_crosses_documents_and_respects_min_len():
    idx = SuffixIndex([[1, 2, 3], [4, 5, 6]], key_len=4)
    m = idx.lookup([9, 2, 3], 5)
    assert (m.length, m.continuations) == (2, [])  # doc 0 ends after 3: no continuation into doc 1
    assert idx.lookup([9, 3], 5, min_len=2).length == 0
    assert idx.lookup([1], 5).continuations == [[2, 3]]
    assert idx.lookup([7], 5).length == 0 and SuffixIndex([]).lookup([1], 3).length == 0
    with pytest.raises(ValueError):
        SuffixIndex([[1, -2]])


def test_index_samples_evenly_when_a_match_is_frequent():
    docs = [[7, 8 + i] for i in range(1000)]
    m = SuffixIndex(docs).lookup([7], 1, max_samples=10)
    assert m.count == 1000 and len(m.continuations) == 10 and len({c[0] for c in m.continuations}) == 10


def _input(rid, tokens):
    return DraftInput(rid, list(tokens), SamplingParams(), None)


def _capture(tokens):
    n = len(tokens)
    return TargetCapture(list(tokens), torch.arange(n), torch.arange(n))


def _paths(tree):
    """Every root-to-node token path of a tree (root excluded)."""
    toks = tree.draft_tokens.tolist()
    return {tuple(toks[i] for i in tree.path_to(n)[1:]) for n in range(1, tree.num_nodes)}


def test_drafts_from_the_seed_corpus_when_the_request_has_no_match():
    d = SuffixDrafter([[50, 51, 52, 53, 54], [60, 61, 62]])
    tree = d.propose([_input(0, [1, 2, 50, 51])], TreeShape(4, 2, 6))[0]
    assert (52, 53, 54) in _paths(tree)
    # the plain n-gram drafter has nothing to say here
    assert make_drafter("ngram", None).propose([_input(0, [1, 2, 50, 51])], TreeShape(4, 2, 6))[0].num_nodes == 1


@pytest.mark.parametrize("name", ["ngram", "suffix"])
def test_lookup_drafters_draft_from_a_predicted_output(name):
    """A request's prediction (DraftInput.reference) is searched like its own context, first; a match
    at the reference's very end has no continuation and is skipped."""
    drafter = make_drafter(name, None) if name == "ngram" else SuffixDrafter([])
    tokens = [1, 2, 3, 9, 5, 6]
    plain = DraftInput(0, tokens, SamplingParams(), None)
    assert drafter.propose([plain], TreeShape(3, 1, 4))[0].num_nodes == 1  # (5, 6) is nowhere earlier
    predicted = DraftInput(0, tokens, SamplingParams(), None, reference=[8, 5, 6, 70, 71, 72, 73, 5, 6])
    assert _paths(drafter.propose([predicted], TreeShape(3, 1, 4))[0]) == {(70,), (70, 71), (70, 71, 72)}
    # the prediction's matches first, then the request's own, most recent first
    assert drafter.longest_match(tokens + [40, 5, 6], 2, reference=[5, 6, 70, 71]) == (2, [[70, 71], [40, 5]])


def test_own_context_outweighs_a_corpus_match_of_the_same_length():
    d = SuffixDrafter([[5, 6, 90, 91]] * 3)
    tree = d.propose([_input(0, [5, 6, 40, 41, 8, 5, 6])], TreeShape(2, 1, 3))[0]  # chain: one winner
    assert _paths(tree) == {(40,), (40, 41)}
    # a corpus match longer than the own one counts in full: both make the tree
    tree = d.propose([_input(0, [6, 40, 41, 8, 5, 6])], TreeShape(2, 2, 5))[0]
    assert _paths(tree) == {(40,), (40, 41), (90,), (90, 91)}


def test_finished_outputs_join_the_online_corpus():
    d = SuffixDrafter([])
    d.add_request(0, _capture([1, 2, 3]))
    d.propose([_input(0, [1, 2, 3, 70, 71, 72, 73, 74])], TreeShape(3, 1, 4))
    d.remove_request(0)
    assert d.online_docs == [[70, 71, 72, 73, 74]]
    tree = d.propose([_input(1, [9, 9, 71])], TreeShape(3, 1, 4))[0]
    assert _paths(tree) == {(72,), (72, 73), (72, 73, 74)}
    off = SuffixDrafter([], online=False)
    off.add_request(0, _capture([1, 2, 3]))
    off.propose([_input(0, [1, 2, 3, 70, 71])], TreeShape(3, 1, 4))
    off.remove_request(0)
    assert off.online_docs == [] and off.propose([_input(1, [9, 70])], TreeShape(3, 1, 4))[0].num_nodes == 1


def test_online_corpus_is_bounded_oldest_dropped():
    d = SuffixDrafter([], max_online_tokens=10)
    for i in range(5):
        d.add_output([100 + i] * 4)
    assert sum(map(len, d.online_docs)) <= 10 and d.online_docs[-1] == [104] * 4


def test_tree_respects_the_shape():
    rng = random.Random(0)
    d = SuffixDrafter([[rng.randrange(20) for _ in range(200)] for _ in range(20)])
    for shape in [TreeShape(6, 2, 12), TreeShape(8, 3, 24), TreeShape.chain(4)]:
        for _ in range(20):
            ctx = [rng.randrange(20) for _ in range(30)]
            tree = d.propose([_input(0, ctx)], shape)[0]
            assert 1 <= tree.num_nodes <= shape.num_draft_tokens
            assert max(len(p) for p in _paths(tree) | {()}) <= shape.depth
            kids = torch.bincount(tree.parents[1:], minlength=tree.num_nodes)
            assert int(kids.max()) <= shape.topk
            assert tree.positions.tolist() == [len(ctx) - 1 + len(tree.path_to(i)) - 1 for i in range(tree.num_nodes)]


def test_min_prob_cuts_lookup_nodes_by_share_times_match_confidence():
    """A lookup node's estimated probability is its share of the candidates times the confidence of
    the match behind them (0 for no match, 1 from FULL_CONFIDENCE_MATCH tokens); min_prob cuts below it."""
    assert [match_confidence(n) for n in range(5)] == [0.0, 1 / 3, 2 / 3, 1.0, 1.0] and FULL_CONFIDENCE_MATCH == 3
    weighted = [([5, 6, 7], 0.6), ([5, 8], 0.4)]  # node 5: share 1.0, 6 and 7: 0.6, 8: 0.4

    def paths(shape, confidence):
        return _paths(trie_tree(1, 10, weighted, shape, confidence=confidence))

    assert paths(TreeShape(3, 2, 5), 0.0) == {(5,), (5, 6), (5, 6, 7), (5, 8)}  # no min_prob: no cut
    cut = TreeShape(3, 2, 5, min_prob=0.3)
    assert paths(cut, 1.0) == {(5,), (5, 6), (5, 6, 7), (5, 8)}  # 0.4 >= 0.3
    assert paths(cut, 0.5) == {(5,), (5, 6), (5, 6, 7)}  # 0.4 x 0.5 < 0.3 <= 0.6 x 0.5
    assert paths(cut, 0.4) == {(5,)}  # 0.6 x 0.4 < 0.3
    assert paths(cut, 0.0) == set()  # no match: nothing is likely
    # the n-gram drafter: a 1-token match (confidence 1/3) drafts only at min_prob <= 1/3
    ctx = [3, 4, 9, 7, 9]  # tail 9 matched once, followed by 7
    ngram = make_drafter("ngram", None)
    assert ngram.propose([_input(0, ctx)], TreeShape(2, 1, 3, min_prob=0.3))[0].num_nodes == 3
    assert ngram.propose([_input(0, ctx)], TreeShape(2, 1, 3, min_prob=0.4))[0].num_nodes == 1
    # the suffix drafter: the request's own match sets the confidence, a corpus match alone gives none
    d = SuffixDrafter([[50, 51, 52, 53]])
    assert d.propose([_input(0, [1, 2, 50, 51])], TreeShape(2, 1, 3))[0].num_nodes == 3
    assert d.propose([_input(0, [1, 2, 50, 51])], TreeShape(2, 1, 3, min_prob=0.3))[0].num_nodes == 1
    own = [20, 21, 22, 23, 24, 9, 20, 21, 22]  # own match of 3 tokens: full confidence
    assert _paths(d.propose([_input(0, own)], TreeShape(2, 1, 3, min_prob=0.3))[0]) == {(23,), (23, 24)}


def test_lookup_drafters_with_min_prob_keep_greedy_output():
    from helpers import tiny_target

    from serving.config import EngineConfig
    from serving.engine import Engine

    t = tiny_target(seed=2, vocab=16)
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 6, 4, 5, 6, 4]]
    sp = SamplingParams(max_new_tokens=40, ignore_eos=True)
    ref = [r.output_ids for r in Engine(t, None).generate(prompts, sp)]
    for drafter in (make_drafter("ngram", None), SuffixDrafter([[1, 2, 3, 4, 5, 6]])):
        eng = Engine(t, drafter, EngineConfig(tree=TreeShape(4, 2, 8, min_prob=0.3)))
        reqs = eng.generate(prompts, sp)
        assert [r.output_ids for r in reqs] == ref
        assert sum(r.stats.draft_tokens for r in reqs) > 0  # the cut left some nodes to verify


def test_corpus_round_trip_and_errors(tmp_path):
    docs = [[1, 2, 3], [], [40000, 5]]
    save_corpus(tmp_path / "c", docs, {"vocab_size": 49152, "target": "x"})
    back, meta = load_corpus(tmp_path / "c", 49152)
    assert [d.tolist() for d in back] == [[1, 2, 3], [40000, 5]]
    assert meta["kind"] == "suffix-corpus" and meta["num_docs"] == 2 and meta["num_tokens"] == 5
    with pytest.raises(CorpusError, match="vocabulary of 49152"):
        load_corpus(tmp_path / "c", 32000)
    with pytest.raises(CorpusError, match="not a suffix corpus"):
        load_corpus(tmp_path / "missing")
    with pytest.raises(CorpusError, match="outside"):
        save_corpus(tmp_path / "d", [[1, 70000]], {"vocab_size": 49152})
    (tmp_path / "c" / "corpus.npz").write_bytes(b"garbage")
    with pytest.raises(CorpusError, match="not a suffix corpus"):
        load_corpus(tmp_path / "c")


def test_drafters_of_one_corpus_share_its_index_until_the_corpus_changes(tmp_path):
    """An index is read only: drafters made from the same corpus file share one (built once); a corpus rewritten
    in place gets a new one, and a drafter refuses an index built for another match length."""
    from types import SimpleNamespace

    from sglang_ext.drafters.suffix_index import SuffixIndex

    target = SimpleNamespace(cfg=SimpleNamespace(vocab_size=100))
    save_corpus(tmp_path / "c", [[1, 2, 3, 4], [5, 6]], {"vocab_size": 100})
    a, b = (SuffixDrafter.from_target(target, tmp_path / "c") for _ in range(2))
    assert a.seed is b.seed and a.seed.lookup([2, 3], 1).continuations == [[4]]
    os.utime(tmp_path / "c" / "corpus.npz", ns=(1, 1))  # the same file with another stamp: rebuilt
    c = SuffixDrafter.from_target(target, tmp_path / "c")
    assert c.seed is not a.seed and c.seed.lookup([2, 3], 1).continuations == [[4]]
    save_corpus(tmp_path / "c", [[2, 3, 9]], {"vocab_size": 100})
    assert SuffixDrafter.from_target(target, tmp_path / "c").seed.lookup([2, 3], 1).continuations == [[9]]
    assert SuffixDrafter.from_target(target, tmp_path / "c", max_match=4).seed.key_len == 4
    with pytest.raises(ValueError, match="key_len 8 for max_match 3"):
        SuffixDrafter(SuffixIndex([[1, 2]]), max_match=3)


def test_shipped_corpus_loads_for_smollm2(smollm2_fp32, monkeypatch):
    d = make_drafter("suffix", smollm2_fp32)
    assert isinstance(d, SuffixDrafter) and len(d.seed) > 100_000 and d.online
    assert not bench_drafter("suffix", smollm2_fp32).online  # benchmarks repeat prompts: no learning the answers
    monkeypatch.setenv("MOA_SERVE_SUFFIX_ONLINE", "0")
    reload_settings()
    assert not make_drafter("suffix", smollm2_fp32).online
    # the target's own phrasing is in there: an answer opener is found, and (no pruning) drafts a continuation
    ids = smollm2_fp32.tokenizer.encode("Here is a", add_special_tokens=False)
    m = d.seed.lookup(ids, 4)
    assert m.length == len(ids) and m.count >= 10
    unpruned = SuffixDrafter.from_target(smollm2_fp32, min_share=0.0)
    assert unpruned.propose([_input(0, ids)], TreeShape(4, 2, 8))[0].num_nodes > 1


def test_build_corpus_cli(tmp_path, smollm2_fp32):
    from sglang_ext.training.data import eval_prompts

    evp = sorted(eval_prompts())
    data = tmp_path / "answers.jsonl"
    recs = [
        {
            "id": "a",
            "conversations": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi there!"}],
            "finish_reason": "stop",
        },
        {
            "id": "b",
            "conversations": [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "One two three"}],
            "finish_reason": "length",
        },
    ] + (
        [{"id": "e", "conversations": [{"role": "user", "content": evp[0]}, {"role": "assistant", "content": "leak"}]}]
        if evp
        else []
    )
    data.write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = tmp_path / "corpus"
    res = subprocess.run(
        [sys.executable, "-m", "moa_serve.entrypoints.cli", "build-corpus", "--data", str(data), "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    docs, meta = load_corpus(out, smollm2_fp32.cfg.vocab_size)
    tok = smollm2_fp32.tokenizer
    eot = tok.eos_token_id
    assert [d.tolist() for d in docs] == [
        tok.encode("Hi there!", add_special_tokens=False) + [eot],
        tok.encode("One two three", add_special_tokens=False),
    ]
    assert make_drafter(str(out), smollm2_fp32).seed.num_docs == 2  # --drafter PATH
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "moa_serve.entrypoints.cli",
            "build-corpus",
            "--data",
            str(empty),
            "--out",
            str(tmp_path / "x"),
        ],
        capture_output=True,
        text=True,
    )
    assert res.returncode != 0 and "empty" in res.stderr


def test_auto_drafter_is_suffix_only_with_a_shipped_corpus(smollm2_fp32, tmp_path):
    from types import SimpleNamespace

    from sglang_ext.drafters import resolve_drafter

    assert resolve_drafter("auto", smollm2_fp32) == "suffix"
    assert isinstance(make_drafter("auto", smollm2_fp32), SuffixDrafter)
    other = SimpleNamespace(path=str(tmp_path / "SomeOtherModel"))  # no corpus shipped for it
    assert resolve_drafter("auto", other) == "ngram" and resolve_drafter("eagle3", other) == "eagle3"
