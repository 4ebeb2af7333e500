"""The chained graphs' penalties (models/penalty_graphs.py) against the host path's (penalties.penalize_tree, then
ban_early_stops, as Sampler.constrained applies them): bit for bit on every node of every request's tree, each node
after its own path, for a batch of requests with their own rules (each penalty kind, a logit bias, min_tokens with
its stop ids, none) at rows of the slot table in any order, padding rows beside them; on a chain's first step (the
state written from the host) and on the step after it (the state brought up to the root on the device from the tokens
of the step before, which the host has not read)."""

from types import SimpleNamespace

import torch

from sglang_ext.device import Stream
from sglang_ext.models.penalty_graphs import PenaltyRow, penalized_logits, penalty_inputs, penalty_state
from sglang_ext.penalties import ban_early_stops, penalize_tree
from sglang_ext.sampling import SamplingParams
from sglang_ext.tree import tree_from_parents

VOCAB, WIDTH = 12, 4
PARENTS = torch.tensor([-1, 0, 0, 1, 3, 2])  # root ─┬─ 1 ── 3 ── 4
#                                                     └─ 2 ── 5
REQUESTS = [  # (table row, rules: params, prompt, output, stop ids) or None: raw logits
    (5, (SamplingParams(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.3), [3, 4], [9, 3, 9], {2})),
    (2, None),
    (7, (SamplingParams(logit_bias=((5, 2.0), (1, -1.5)), min_tokens=6), [1], [4, 4], {0, 2})),
    (3, (SamplingParams(frequency_penalty=1.1, min_tokens=4), [7, 8], [8, 1, 1], {11})),
]


def _runner():
    table = SimpleNamespace(table=torch.zeros(9, 32, dtype=torch.long))
    return SimpleNamespace(_table=table, model=SimpleNamespace(cfg=SimpleNamespace(vocab_size=VOCAB), device="cpu"),
                           stream=Stream())  # fmt: skip


def _host(logits: torch.Tensor, rules, output: list[int], tree) -> torch.Tensor:
    """Sampler.constrained's values: penalties, then min_tokens (the raw rows, upcast, without rules)."""
    if rules is None:
        return logits.float()
    params, prompt, _, stops = rules
    if params.penalized:
        logits = penalize_tree(logits, params, prompt, output, tree)
    return ban_early_stops(logits, tree, len(output), params.min_tokens, stops).float()


def _step(g, outputs: list[list[int]], path: torch.Tensor | None, lens: list[int], seed: int):
    """One graph call for REQUESTS (padded to 6) with trees of random tokens -> (the graph's rows, the host's)."""
    gen = torch.Generator().manual_seed(seed)
    b, n, bb = len(REQUESTS), len(PARENTS), 6
    trees = [tree_from_parents(torch.randint(0, VOCAB, (n,), generator=gen), PARENTS, seq_len=20) for _ in REQUESTS]
    for t, out in zip(trees, outputs):
        t.draft_tokens[0] = out[-1]  # (a root is the output's last token)
    logits = torch.randn(bb * n, VOCAB, generator=gen)
    chained = path is not None
    rows = [PenaltyRow(r[0], r[1], out, r[3]) if r else None for (_, r), out in zip(REQUESTS, outputs)]
    inputs = penalty_inputs(g, list(range(b)), [t for t, _ in REQUESTS], [chained] * b, rows, bb)
    tokens = torch.stack([t.draft_tokens for t in trees] + [torch.zeros(n, dtype=torch.long)] * (bb - b))
    masks = torch.stack([t.tree_mask for t in trees] + [torch.eye(n, dtype=torch.bool)] * (bb - b))
    depth = torch.stack([t.positions - t.positions[0] for t in trees] + [torch.zeros(n, dtype=torch.long)] * (bb - b))
    table_rows = torch.tensor([t for t, _ in REQUESTS] + [0] * (bb - b))
    last = path if chained else torch.zeros(bb, WIDTH, dtype=torch.long)
    got = penalized_logits(
        penalty_state(g), inputs, table_rows, torch.full((bb,), chained), torch.tensor(lens + [0] * (bb - b)), last,
        tokens, masks, depth, logits,
    )  # fmt: skip
    want = []
    for i, ((_, rules), t) in enumerate(zip(REQUESTS, trees)):
        full = outputs[i] + ([] if not chained else path[i, : lens[i]].tolist())
        want.append(_host(logits[i * n : (i + 1) * n], rules, full, t))
    return got[: b * n], torch.cat(want)


def test_a_chains_first_step_equals_the_host_path():
    g = _runner()
    got, want = _step(g, [r[2] if r else [6] for _, r in REQUESTS], None, [0] * len(REQUESTS), seed=0)
    assert torch.equal(got, want)
    assert torch.isinf(got).any()  # (min_tokens banned stop ids somewhere)


def test_a_chained_step_counts_the_step_before_on_the_device():
    """Step 1 written from the host; step 2's roots follow step 1's paths (host lists as they were: unread), whose
    tokens only the device adds; its rows equal the host path's with those tokens in the output."""
    g = _runner()
    outputs = [r[2] if r else [6] for _, r in REQUESTS]
    _step(g, outputs, None, [0] * len(REQUESTS), seed=1)
    path = torch.tensor([[2, 9, 9, 0], [5, 0, 0, 0], [0, 4, 0, 0], [1, 8, 11, 1], [0] * 4, [0] * 4])
    lens = [3, 1, 2, 4]  # (request 2's path holds a stop id: banned where early, not here: the host's tokens)
    got, want = _step(g, outputs, path, lens, seed=2)
    assert torch.equal(got, want)
    assert g._penalty_state.lens[[5, 7, 3]].tolist() == [
        len(o) + k for o, k in zip([outputs[0], *outputs[2:]], [3, 2, 4])
    ]
