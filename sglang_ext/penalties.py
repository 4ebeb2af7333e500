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

Everything runs on the logits' device without host reads: the per-request inputs (token ids,
biases, stop ids) are host values uploaded once.
"""

from __future__ import annotations

import torch

from .device import to_device
from .sampling import SamplingParams
from .tree import TokenTree


def output_counts(output_ids: list[int], vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[V] float32 on `device`: occurrences of each token in the output.
    NOTE: index_add, not bincount: bincount sizes its output from the ids' maximum (a device read)."""
    ids = to_device(torch.tensor(output_ids, dtype=torch.long), device)
    return torch.zeros(vocab, device=device).index_add_(0, ids, torch.ones(len(output_ids), device=device))


def tree_output_counts(counts: torch.Tensor, tree: TokenTree) -> torch.Tensor:
    """[V] output counts -> [N, V]: the output's counts plus, in row i, the draft tokens on the path
    root -> node i (each ancestor-or-self below the root adds one at its token)."""
    n = tree.num_nodes
    rows = counts.expand(n, -1).clone()
    tokens = to_device(tree.draft_tokens[1:].long(), rows.device).expand(n, -1)  # [N, N-1]
    return rows.scatter_add_(1, tokens, to_device(tree.tree_mask[:, 1:], rows.device).to(rows.dtype))


def penalize(logits: torch.Tensor, params: SamplingParams, counts: torch.Tensor, prompt_ids: list[int]) -> torch.Tensor:
    """[n, V] logits and [n, V] (or [V]) output counts of each row's context -> [n, V] float32 logits."""
    x = logits.float().clone()
    if params.logit_bias:
        ids, bias = zip(*params.logit_bias)
        x[:, to_device(torch.tensor(ids), x.device)] += to_device(torch.tensor(bias, dtype=x.dtype), x.device)
    counts = counts.expand_as(x)
    if params.repetition_penalty != 1.0:
        seen = counts > 0
        # (index_fill_, not `seen[:, ids] = True`: that copies the Python scalar up and waits on a GPU)
        seen.index_fill_(1, to_device(torch.tensor(prompt_ids, dtype=torch.long), x.device), True)
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
    counts = output_counts(output_ids, logits.shape[-1], logits.device)
    return penalize(logits, params, tree_output_counts(counts, tree), prompt_ids)


def ban_early_stops(
    logits: torch.Tensor, tree: TokenTree, output_len: int, min_tokens: int, stop_ids: set[int]
) -> torch.Tensor:
    """[N, V] tree rows -> the same with `stop_ids` at -inf in rows that choose an output token
    before number `min_tokens` (0-based: output_len + the node's depth). Depths are >= 0, so
    output_len >= min_tokens (host ints) means no row is early."""
    if output_len >= min_tokens or not stop_ids:
        return logits
    depth = to_device(tree.positions - tree.positions[0], logits.device)
    early = (output_len + depth) < min_tokens  # [N]
    stops = torch.zeros(logits.shape[-1], dtype=torch.bool)
    stops[sorted(stop_ids)] = True
    return logits.masked_fill(early[:, None] & to_device(stops, logits.device)[None, :], float("-inf"))
