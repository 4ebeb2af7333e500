"""Speculative sampling preserves the target distribution (chain and tree), on a tiny random Llama.

The exact joint law of the 2nd and 3rd generated tokens (the first ones produced by a verify step)
is computed by enumeration from the target; samples from the speculative engine (fixed seeds) must
pass a chi-square goodness-of-fit test, and a deliberately broken verifier (accept every draft
along the first-child path) must fail the same test. With penalties, the law is enumerated with each
sequence's own output counts, and penalising every tree node with the committed output only (what
SGLang's EAGLE verify does) must fail. With a grammar, the law is enumerated with each sequence's own
mask, and masking every node with the committed output's must fail. With min_tokens, each row bans
the stop tokens by its own depth, and banning them from the root's row only must fail.
"""

import itertools
from dataclasses import replace

import pytest
import torch
from helpers import tiny_config, tiny_state, tiny_target
from oracles import sampling_verify
from scipy.stats import chisquare

from serving.config import EngineConfig
from serving.engine import Engine
from serving.sampler import Sampler
from sglang_ext.attention import causal_mask, plan_attention, tree_attention_torch
from sglang_ext.drafters import DraftModelDrafter
from sglang_ext.grammar import Grammars, GrammarSpec, apply_bitmask, tree_bitmask
from sglang_ext.models import LlamaModel, Target
from sglang_ext.penalties import output_counts, penalize
from sglang_ext.sampling import SamplingParams, logits_to_probs
from sglang_ext.tree import TreeShape, chain_tree
from sglang_ext.verify import VerifyResult

PROMPT = [1, 5, 2, 7]
SAMPLES = 2000
GRAMMARS = Grammars.for_vocab([str(i) for i in range(8)], [])  # the tiny model's token i is the text "i"


def next_probs(model, seqs, params):
    """Processed target distribution after each sequence (all of equal length)."""
    kv = model.new_kv_pool(len(seqs) * len(seqs[0]) + 1)
    slots = [kv.alloc(len(s)) for s in seqs]
    plan = plan_attention(slots, [causal_mask(len(s), 0) for s in seqs])
    out = model.forward(
        torch.tensor(sum(seqs, [])), torch.cat([torch.arange(len(s)) for s in seqs]), torch.cat(slots), plan, kv
    )
    last = torch.tensor([len(seqs[0]) * (i + 1) - 1 for i in range(len(seqs))])
    logits = model.logits(out.hidden[last])
    if params.penalized:
        v = logits.shape[-1]
        counts = torch.stack([output_counts(s[len(PROMPT) :], v, logits.device) for s in seqs])
        logits = penalize(logits, params, counts, PROMPT)
    if len(seqs[0]) - len(PROMPT) < params.min_tokens:  # the next token is output token number len(output)
        logits[:, list(params.stop_token_ids)] = float("-inf")
    if params.grammar is not None:
        logits = torch.cat([_masked(row[None], s[len(PROMPT) :], params.grammar) for row, s in zip(logits, seqs)])
    return logits_to_probs(logits, params)


def _masked(row, output, spec):
    """The row masked after `output`, or as is when `output` leaves the grammar (its probability is 0)."""
    m = GRAMMARS.matcher(spec)
    if not all(m.accept_token(t) for t in output):
        return row
    return apply_bitmask(row, tree_bitmask(m, chain_tree(0, [], 0), row.shape[-1]))


def exact_joint_t2_t3(model, params):
    v = model.cfg.vocab_size
    p1 = next_probs(model, [PROMPT], params)[0]
    p2 = next_probs(model, [PROMPT + [a] for a in range(v)], params)  # [v, v]
    p3 = next_probs(model, [PROMPT + [a, b] for a, b in itertools.product(range(v), range(v))], params).view(v, v, v)
    return torch.einsum("a,ab,abc->bc", p1.double(), p2.double(), p3.double())


class AcceptEverythingSampler(Sampler):
    """Broken on purpose: accepts the first-child path without looking at the target."""

    def verify(self, r, tree, logits, shape):
        nodes = [0]
        while int(tree.retrieve_next_token[nodes[-1]]) != -1:
            nodes.append(int(tree.retrieve_next_token[nodes[-1]]))
        probs = logits_to_probs(logits[nodes[-1]], r.params)
        bonus = int(torch.multinomial(probs, 1, generator=r.generator))
        return VerifyResult(nodes, [int(tree.draft_tokens[i]) for i in nodes[1:]] + [bonus])


class CommittedOutputPenaltiesSampler(Sampler):
    """Broken on purpose: every tree node is penalised with the committed output only."""

    def verify(self, r, tree, logits, shape):
        logits = penalize(logits, r.params, output_counts(r.output_ids, logits.shape[-1]), r.prompt_ids)
        return sampling_verify(tree, lambda node: logits_to_probs(logits[node], r.params), r.generator)


class CommittedOutputGrammarSampler(Sampler):
    """Broken on purpose: every tree node is masked with the committed output's grammar state."""

    def verify(self, r, tree, logits, shape):
        logits = apply_bitmask(
            logits, tree_bitmask(r.matcher, chain_tree(0, [], 0), logits.shape[-1]).expand(tree.num_nodes, -1)
        )
        return sampling_verify(tree, lambda node: logits_to_probs(logits[node], r.params), r.generator)

    def append(self, r, tokens):
        matcher, r.matcher = r.matcher, None  # the wrong mask lets tokens through that the matcher refuses
        out = super().append(r, tokens)
        r.matcher = matcher
        for t in out:
            matcher.accept_token(t)
        return out


class RootOnlyMinTokensSampler(Sampler):
    """Broken on purpose: only the root's row is kept from stopping (by the committed output's length);
    deeper rows, whose tokens are also among the first min_tokens, are not."""

    def verify(self, r, tree, logits, shape):
        if len(r.output_ids) < r.params.min_tokens:
            logits = logits.clone()
            logits[0, list(r.params.stop_token_ids)] = float("-inf")
        return sampling_verify(tree, lambda node: logits_to_probs(logits[node], r.params), r.generator)


class AcceptEverything(Engine):
    sampler_class = AcceptEverythingSampler


class CommittedOutputPenalties(Engine):
    sampler_class = CommittedOutputPenaltiesSampler


class CommittedOutputGrammar(Engine):
    sampler_class = CommittedOutputGrammarSampler


class RootOnlyMinTokens(Engine):
    sampler_class = RootOnlyMinTokensSampler


def sample_t2_t3(engine_cls, target, shape, params, seeded=True):
    """seeded: request i has seed i (coupled verification); else no seed (speculative sampling on the
    device), its generator seeded with i on the target's device so that the test is reproducible."""
    drafter = DraftModelDrafter.self_draft(target.model, layers=[0], num_slots=SAMPLES * 16)
    fallbacks = []
    eng = engine_cls(
        target,
        drafter,
        EngineConfig(tree=shape, kv_slots=SAMPLES * 16),
        on_fallback=lambda r, why: fallbacks.append(why),
    )
    eng.grammars = GRAMMARS
    if seeded:
        reqs = eng.generate([PROMPT] * SAMPLES, [replace(params, max_new_tokens=3, seed=i) for i in range(SAMPLES)])
    else:
        reqs = [eng.add_request(PROMPT, replace(params, max_new_tokens=3)) for _ in range(SAMPLES)]
        for i, r in enumerate(reqs):
            r.generator = torch.Generator(target.model.device).manual_seed(i)
        while eng.has_work:
            eng.step()
    v = target.cfg.vocab_size
    counts = torch.zeros(v, v, dtype=torch.float64)
    for r in reqs:
        counts[r.output_ids[1], r.output_ids[2]] += 1
    accepted = sum(r.stats.accepted_tokens for r in reqs)
    assert not fallbacks, f"drafter failed: {set(fallbacks)}"
    return counts, accepted


def chi2_pvalue(counts, expected_probs):
    exp = (expected_probs * counts.sum()).flatten()
    obs = counts.flatten()
    if obs[exp == 0].sum() > 0:
        return 0.0  # a token sequence the target cannot produce
    big = exp >= 5
    o, e = obs[big], exp[big]
    if exp[~big].sum() > 0:  # pool the rare cells into one
        o = torch.cat([o, obs[~big].sum(0, keepdim=True)])
        e = torch.cat([e, exp[~big].sum(0, keepdim=True)])
    return chisquare(o.numpy(), e.numpy() * o.sum().item() / e.sum().item()).pvalue


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=3)


SHAPES = {"chain": TreeShape.chain(3), "tree": TreeShape(2, 2, 5)}
PARAMS = {
    "T0.7": SamplingParams(temperature=0.7),
    "T1.0-top_p0.9": SamplingParams(temperature=1.0, top_p=0.9),
    # strong enough that a repeat within a drafted path changes the law visibly
    "T1.0-penalties": SamplingParams(
        temperature=1.0, presence_penalty=1.5, frequency_penalty=1.0, repetition_penalty=1.5, logit_bias=((2, 1.0),)
    ),
    # tokens alternate between 0-3 and 4-7: a drafted node's mask depends on its depth
    "T1.0-grammar": SamplingParams(temperature=1.0, grammar=GrammarSpec("regex", "([0-3][4-7])*")),
    # token 5 (likely as the 3rd token) stops, but not among the first 3 output tokens: every row that
    # chooses one of them is masked, the drafted ones too
    "T1.0-min_tokens": SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=(5,)),
}


@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
@pytest.mark.parametrize("pname", PARAMS, ids=list(PARAMS))
def test_speculative_sampling_matches_target(target, shape, pname):
    params = PARAMS[pname]
    expected = exact_joint_t2_t3(target.model, params)
    counts, accepted = sample_t2_t3(Engine, target, SHAPES[shape], params)
    assert accepted > SAMPLES * 0.3, "the drafter must get drafts accepted or the test proves nothing"
    assert chi2_pvalue(counts, expected) > 1e-3


@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
def test_unseeded_speculative_sampling_matches_target(target, shape):
    """Requests without a seed: speculative sampling on the device (sampling_path; sampled chains for
    the chain shape, point-mass top-k trees for the tree shape)."""
    params = PARAMS["T1.0-top_p0.9"]
    counts, accepted = sample_t2_t3(Engine, target, SHAPES[shape], params, seeded=False)
    assert accepted > SAMPLES * 0.3, "the drafter must get drafts accepted or the test proves nothing"
    assert chi2_pvalue(counts, exact_joint_t2_t3(target.model, params)) > 1e-3


BROKEN = {  # each wrong in its own way; the same test must catch each
    "accept-everything": (AcceptEverything, "T0.7"),
    "committed-output-penalties": (CommittedOutputPenalties, "T1.0-penalties"),
    "committed-output-grammar": (CommittedOutputGrammar, "T1.0-grammar"),
    "root-only-min-tokens": (RootOnlyMinTokens, "T1.0-min_tokens"),
}


@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
@pytest.mark.parametrize("broken", BROKEN, ids=list(BROKEN))
def test_broken_verifiers_fail_the_same_test(target, shape, broken):
    engine_cls, pname = BROKEN[broken]
    expected = exact_joint_t2_t3(target.model, PARAMS[pname])
    counts, _ = sample_t2_t3(engine_cls, target, SHAPES[shape], PARAMS[pname])
    assert chi2_pvalue(counts, expected) < 1e-6


# --- chained steps (the overlapped loop, serving/spec_step.py): coupled verification in the verify's graph -------


def _unseeded_groups(eng, target, params) -> list:
    """SAMPLES unseeded requests of 3 tokens through eng, 64 at a time, request i's generator seeded with i."""
    reqs = []
    for start in range(0, SAMPLES, 64):
        group = [eng.add_request(PROMPT, replace(params, max_new_tokens=3)) for _ in range(64)]
        for i, r in enumerate(group):
            r.generator = torch.Generator(target.model.device).manual_seed(start + i)
        while eng.has_work:
            eng.step()
        reqs += group
    return reqs


def sample_chained_t2_t3(target, shape, params, broken: bool = False):
    """sample_t2_t3 for unseeded requests in the overlapped loop's chained steps (a random EAGLE-3 head, the graph
    runner's static path on the stand-in stream, groups of 64 requests, each request's generator seeded with its
    index: its coupling seed made from that). broken: a drafted child passes when it holds the target's argmax (the
    noise ignored), the bonus still the coupled sample. -> (counts, accepted, per chained step launched: whether it
    continued a chain)."""
    from helpers import QueuedStream

    import sglang_ext.models.spec_graphs as spec_graphs
    from serving import spec_step
    from sglang_ext.drafters.eagle3 import Eagle3Drafter
    from sglang_ext.models.eagle3 import Eagle3Config, Eagle3Draft
    from sglang_ext.models.graph_runner import GraphRunner
    from sglang_ext.sampling import coupled_tokens, greedy_tokens

    stream, v = QueuedStream(), target.cfg.vocab_size
    real_tokens, real_rows, real_launch, argmax, launches = (
        spec_graphs.coupled_tokens,
        spec_graphs.greedy_rows,
        spec_step.launch,
        [],
        [],
    )

    def noted(logits, *args):  # (the argmax of the rows that broken_rows reads)
        argmax[:] = [greedy_tokens(logits)]
        return coupled_tokens(logits, *args)

    def broken_rows(tokens, parents, positions, nxt, sib, target_tokens):
        nodes, _ = real_rows(tokens, parents, positions, nxt, sib, argmax[0].view_as(target_tokens))
        after = torch.cat([nodes[:, 1:], nodes.new_full((nodes.shape[0], 1), -1)], 1)
        bonus = target_tokens.gather(1, nodes.clamp(min=0))
        return nodes, torch.where(nodes >= 0, torch.where(after >= 0, tokens.gather(1, after.clamp(min=0)), bonus), -1)

    def launch(engine, reqs, prev=None):
        launches.append(prev is not None)
        return real_launch(engine, reqs, prev)

    if broken:
        spec_graphs.coupled_tokens, spec_graphs.greedy_rows = noted, broken_rows
    spec_step.launch = launch
    try:
        with torch.random.fork_rng():  # (a random head, the same every run: its drafts are often accepted)
            torch.manual_seed(0)
            head = Eagle3Draft(Eagle3Config.for_target(target.cfg, v, aux_layers=(0, 1, 2)))
        drafter = Eagle3Drafter(target.model, head, num_slots=4096)
        config = EngineConfig(tree=shape, kv_slots=4096, prefill="separate", adaptive=False)
        eng = Engine(target, drafter, config)
        if eng.runner.graph_runner is None:  # (the CPU: the static path run eagerly on the stand-in stream)
            eng.runner.graph_runner = GraphRunner(eng.model, eng.capture_layers, stream=stream)
            drafter.step_graphs = True
        reqs = _unseeded_groups(eng, target, params)
    finally:
        spec_graphs.coupled_tokens, spec_graphs.greedy_rows, spec_step.launch = real_tokens, real_rows, real_launch
        stream.close()
    counts = torch.zeros(v, v, dtype=torch.float64)
    for r in reqs:
        counts[r.output_ids[1], r.output_ids[2]] += 1
    assert all(r.drafting for r in reqs) and stream.copies == eng.runner.graph_runner.runs  # (every verify chained)
    return counts, sum(r.stats.accepted_tokens for r in reqs), launches


CHAINED = {  # wide trees: a drafted child often holds the argmax where the sample is another token
    "T2.0": (SamplingParams(temperature=2.0), TreeShape(2, 4, 9)),
    "T1.5-top_p0.95": (SamplingParams(temperature=1.5, top_p=0.95), TreeShape(2, 3, 7)),  # (the sorting graph)
}


@pytest.mark.parametrize("pname", CHAINED, ids=list(CHAINED))
def test_chained_unseeded_sampling_matches_target(target, pname):
    """Unseeded requests decoded by chained steps alone, each verified coupled with a seed made from its generator's:
    the target's law; accepting a drafted child that holds the argmax instead (the noise ignored) fails the same
    test."""
    params, shape = CHAINED[pname]
    expected = exact_joint_t2_t3(target.model, params)
    counts, accepted, launches = sample_chained_t2_t3(target, shape, params)
    assert accepted > SAMPLES * 0.3, "the drafter must get drafts accepted or the test proves nothing"
    assert sum(launches) >= SAMPLES // 64  # (chains: a step launched while the one before it was in flight)
    assert chi2_pvalue(counts, expected) > 1e-3
    broken, *_ = sample_chained_t2_t3(target, shape, params, broken=True)
    assert chi2_pvalue(broken, expected) < 1e-6


def sample_chained_plain_t2_t3(target, params, broken: bool = False):
    """sample_t2_t3 for unseeded requests in the overlapped loop's chained plain decode steps (no drafter: each
    row's token drawn in the decode graph, models/decode_graphs.py; the graph runner's static path on the stand-in
    stream, groups of 64 requests, each request's generator seeded with its index: its coupling seed made from that).
    broken: every request's coupling seed the same (the noise not made from its generator's). -> (counts, per plain
    decode step launched: whether it continued a chain)."""
    from helpers import QueuedStream

    from serving import decode_step
    from sglang_ext.models.graph_runner import GraphRunner

    stream, launches, real_launch = QueuedStream(), [], decode_step.PLAIN.launch
    real_seed = vars(Sampler)["coupling_seed"]  # (the staticmethod itself, to put back)

    def launch(engine, reqs, prev=None):
        launches.append(prev is not None)
        return real_launch(engine, reqs, prev)

    decode_step.PLAIN.launch = staticmethod(launch)
    if broken:
        Sampler.coupling_seed = staticmethod(lambda r: 1)
    try:
        eng = Engine(target, None, EngineConfig(kv_slots=4096, prefill="separate"))
        eng.runner.graph_runner = GraphRunner(eng.model, eng.capture_layers, stream=stream)
        reqs = _unseeded_groups(eng, target, params)
    finally:
        decode_step.PLAIN.launch, Sampler.coupling_seed = staticmethod(real_launch), real_seed
        stream.close()
    counts = torch.zeros(target.cfg.vocab_size, target.cfg.vocab_size, dtype=torch.float64)
    for r in reqs:
        counts[r.output_ids[1], r.output_ids[2]] += 1
    assert stream.copies == eng.runner.graph_runner.runs  # (every decode step the graph's)
    return counts, launches


@pytest.mark.parametrize("pname", ["T0.7", "T1.0-top_p0.9"])
def test_chained_unseeded_plain_decode_matches_target(target, pname):
    """Unseeded requests decoded by chained plain decode steps (no drafter), each row's token its coupled sample with
    a seed made from its generator's: the target's law; every request with the same seed fails the same test."""
    params = PARAMS[pname]
    expected = exact_joint_t2_t3(target.model, params)
    counts, launches = sample_chained_plain_t2_t3(target, params)
    assert sum(launches) >= 2 * (SAMPLES // 64)  # (t3's step and a surplus one, each issued with one in flight)
    assert chi2_pvalue(counts, expected) > 1e-3
    broken, _ = sample_chained_plain_t2_t3(target, params, broken=True)
    assert chi2_pvalue(broken, expected) < 1e-6


# --- the same on a real GPU (skipped without CUDA) --------------------------------------------------


@pytest.fixture(scope="module")
def cuda_target():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    cfg = tiny_config()
    # (the torch reference attention: this checks the sampling, not the kernel, on a head_dim of 8)
    model = LlamaModel(cfg, tiny_state(cfg, 3), device="cuda", attention=tree_attention_torch)
    return Target(model=model, tokenizer=None, path=None)


@pytest.mark.gpu
@pytest.mark.parametrize("seeded", [True, False], ids=["seeded", "unseeded"])
@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
@pytest.mark.parametrize("pname", ["T0.7", "T1.0-penalties"])
def test_gpu_speculative_sampling_matches_target(cuda_target, shape, pname, seeded):
    """The engine on CUDA (the target, drafter, verification and sampling there): the same law, and a
    broken verifier still fails it."""
    params = PARAMS[pname]
    expected = exact_joint_t2_t3(cuda_target.model, params).cpu()
    counts, accepted = sample_t2_t3(Engine, cuda_target, SHAPES[shape], params, seeded)
    assert accepted > SAMPLES * 0.3
    assert chi2_pvalue(counts, expected) > 1e-3
    if seeded and pname == "T0.7":
        broken, _ = sample_t2_t3(AcceptEverything, cuda_target, SHAPES[shape], params)
        assert chi2_pvalue(broken, expected) < 1e-6
