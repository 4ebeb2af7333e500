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
    root -> node i (each ancestor-or-self below the root adds one at its token). A faulty drafter's token outside
    the vocabulary counts as the nearest id in it: its node is never accepted, nor are the rows below it (their
    request falls back to vanilla decoding as without penalties, not failed by an index out of range)."""
    n, vocab = tree.num_nodes, counts.shape[-1]
    rows = counts.expand(n, -1).clone()
    tokens = to_device(tree.draft_tokens[1:].long(), rows.device).clamp(0, vocab - 1).expand(n, -1)  # [N, N-1]
    return rows.scatter_add_(1, tokens, to_device(tree.tree_mask[:, 1:], rows.device).to(rows.dtype))


def penalize(logits: torch.Tensor, params: SamplingParams, counts: torch.Tensor, prompt_ids: list[int]) -> torch.Tensor:
    """[n, V] logits and [n, V] (or [V]) output counts of each row's context -> [n, V] float32 logits: penalize_rows'
    ops for the rules the request sets, in its order. The others are skipped: where off each is exact (x + 0, x / 1,
    x * 1, x - 0 * c), so the values are penalize_rows' (a graph's, which runs them all for a batch; a -0.0 its + 0
    makes +0.0), at a fraction of a CPU step's cost (each rule is a few [n, V] passes)."""
    vocab, dev = logits.shape[-1], logits.device
    values = penalty_values(params)
    rep, freq, pres = to_device(torch.tensor([values], dtype=torch.float32), dev).unbind(1)
    x = logits.float()
    if params.logit_bias:
        x = x + bias_row(params.logit_bias, vocab, dev)
    counts = counts.expand(x.shape)
    present = counts > 0 if values[0] != 1.0 or values[2] else None
    if values[0] != 1.0:
        seen = present | prompt_mask(prompt_ids, vocab, dev)
        x = torch.where(seen, torch.where(x > 0, x / rep[:, None], x * rep[:, None]), x)
    if values[1]:
        x = x - freq[:, None] * counts
    if values[2]:
        x = x - pres[:, None] * present.float()
    return x if x is not logits else x.clone()


def penalty_values(params: SamplingParams) -> tuple[float, float, float]:
    """(repetition, frequency, presence): 1, 0, 0 where off (penalize_rows then leaves the logits as they are)."""
    return params.repetition_penalty, params.frequency_penalty or 0.0, params.presence_penalty or 0.0


def prompt_mask(prompt_ids: list[int], vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[V] bool on `device`: the prompt's tokens (those the repetition penalty applies to beside the output's), made
    there from the ids (index_fill_, not `mask[ids] = True`: that copies the Python scalar up and waits on a GPU)."""
    ids = to_device(torch.tensor(prompt_ids, dtype=torch.long), device)
    return torch.zeros(vocab, dtype=torch.bool, device=device).index_fill_(0, ids, True)


def bias_row(logit_bias, vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[V] float32 on `device`: each biased token's bias, 0 elsewhere (made there from the pairs)."""
    row = torch.zeros(vocab, device=device)
    if logit_bias:
        ids, bias = zip(*logit_bias)
        at = to_device(torch.tensor(ids, dtype=torch.long), device)
        row.index_put_((at,), to_device(torch.tensor(bias, dtype=torch.float32), device))
    return row


def penalize_rows(
    logits: torch.Tensor,  # [..., V] any float dtype
    counts: torch.Tensor,  # [..., V] float32: the output counts of each row's context
    prompt: torch.Tensor,  # [..., V] bool (broadcast): the row's prompt tokens
    bias: torch.Tensor,  # [..., V] float32 (broadcast): the logit bias (0: none)
    rep: torch.Tensor,  # [...] float32: the repetition penalty (1: off)
    freq: torch.Tensor,  # [...] float32: the frequency penalty (0: off)
    pres: torch.Tensor,  # [...] float32: the presence penalty (0: off)
) -> torch.Tensor:  # [..., V] float32
    """Every row under its own parameters, in elementwise ops of fixed shapes (a graph runs them for a batch; the
    host path for one request: the same ops, so the same bits on a device). A parameter that is off leaves the
    values as they are (x + 0, x / 1, x * 1, x - 0 * c are exact). Order: logit bias, repetition, frequency,
    presence. NOTE: the parameters are tensors, not Python scalars: CUDA divides by a host scalar as a multiply by
    its reciprocal, whose bits differ from a division."""
    rep, freq, pres = rep[..., None], freq[..., None], pres[..., None]
    x = logits.float() + bias
    present = counts > 0
    x = torch.where(present | prompt, torch.where(x > 0, x / rep, x * rep), x)
    return x - freq * counts - pres * present.float()


def ban_rows(logits: torch.Tensor, early: torch.Tensor, stops: torch.Tensor) -> torch.Tensor:
    """[..., V] logits with the stop tokens (stops [..., V] bool, broadcast) at -inf in the early rows ([...] bool)."""
    return logits.masked_fill(early[..., None] & stops, float("-inf"))


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
    return ban_rows(logits, early, to_device(stop_mask(stop_ids, logits.shape[-1]), logits.device))


def stop_mask(stop_ids, vocab: int) -> torch.Tensor:
    """[V] bool on the host: the tokens min_tokens bans while the output is short."""
    stops = torch.zeros(vocab, dtype=torch.bool)
    stops[sorted(stop_ids)] = True
    return stops
