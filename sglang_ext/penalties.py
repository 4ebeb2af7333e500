"""Logit bias and presence / frequency / repetition penalties on the target's logits, row by row.

Each logits row gets the penalties of its own context. In a token tree, the row of node i chooses
the token after node i, so its context is the committed output plus the draft tokens on the path
from the root to i (the root itself is already in the output):

    output: ... g5 g6        tree:  g6 ─┬─ a ── b        row of b:  output + [a, b]
                                        └─ c             row of c:  output + [c]
                                                         row of g6: output

So every row is exactly the distribution vanilla decoding would sample from after that path, and
verification (greedy or rejection sampling) stays lossless. NOTE: SGLang's EAGLE verify applies the
committed output's penalties to every node alike, which is right at depth 1 only.

Semantics (vLLM's and SGLang's): presence and frequency count the output's tokens only; the
repetition penalty applies to tokens of the prompt or the output; order: logit bias, repetition,
frequency and presence. `min_tokens` bans the stop tokens from the rows that would choose one of the
output's first min_tokens tokens: row i chooses output token number len(output) + depth(i).
Drafters draft without penalties: losslessness holds for any draft, and a
penalty only changes which drafts are accepted.
"""

from __future__ import annotations

import torch

from .sampling import SamplingParams
from .tree import TokenTree


def output_counts(output_ids: list[int], vocab: int) -> torch.Tensor:
    """[V] float32: occurrences of each token in the output."""
    return torch.bincount(torch.tensor(output_ids, dtype=torch.long), minlength=vocab)[:vocab].float()


def tree_output_counts(counts: torch.Tensor, tree: TokenTree) -> torch.Tensor:
    """[N, V]: the output's counts plus, in row i, the draft tokens on the path root -> node i."""
    rows = counts.expand(tree.num_nodes, -1).clone()
    node, ancestor = tree.tree_mask[:, 1:].nonzero(as_tuple=True)  # ancestor-or-self pairs below the root
    rows.index_put_((node, tree.draft_tokens[ancestor + 1].long()), torch.ones(len(node)), accumulate=True)
    return rows


def penalize(logits: torch.Tensor, params: SamplingParams, counts: torch.Tensor, prompt_ids: list[int]) -> torch.Tensor:
    """[n, V] logits and [n, V] (or [V]) output counts of each row's context -> [n, V] float32 logits."""
    x = logits.float().clone()
    if params.logit_bias:
        ids, bias = zip(*params.logit_bias)
        x[:, list(ids)] += torch.tensor(bias, dtype=x.dtype)
    counts = counts.expand_as(x)
    if params.repetition_penalty != 1.0:
        seen = counts > 0
        seen[:, torch.tensor(prompt_ids, dtype=torch.long)] = True
        penalized = torch.where(x > 0, x / params.repetition_penalty, x * params.repetition_penalty)
        x = torch.where(seen, penalized, x)
    if params.frequency_penalty:
        x -= params.frequency_penalty * counts
    if params.presence_penalty:
        x -= params.presence_penalty * (counts > 0).float()
    return x


def penalize_tree(
    logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int], tree: TokenTree
) -> torch.Tensor:
    """[N, V] logits of a request's tree rows -> the same rows under its penalties, each with its path."""
    counts = output_counts(output_ids, logits.shape[-1])
    return penalize(logits, params, tree_output_counts(counts, tree), prompt_ids)


def ban_early_stops(
    logits: torch.Tensor, tree: TokenTree, output_len: int, min_tokens: int, stop_ids: set[int]
) -> torch.Tensor:
    """[N, V] tree rows -> the same with `stop_ids` at -inf in rows that choose an output token
    before number `min_tokens` (0-based: output_len + the node's depth)."""
    depth = tree.positions - tree.positions[0]
    early = ((output_len + depth) < min_tokens).nonzero()[:, 0]
    if not len(early) or not stop_ids:
        return logits
    out = logits.clone()
    out[early[:, None], torch.tensor(sorted(stop_ids))[None, :]] = float("-inf")
    return out
