"""Tree search shared by all neural drafters (draft model, EAGLE-3, MoA).

A drafter supplies the root logits and a step function; this module turns them into TokenTrees:
- EAGLE-2 dynamic tree (top-k per frontier node, global rerank) — deterministic proposals, which
  the verifier treats as point masses, so it is lossless under sampling too; with shape.min_prob,
  nodes of lower path probability are left out and the search stops once the whole frontier is below;
- chains (topk = 1): argmax for greedy requests; for sampling requests each token is drawn from
  the drafter's processed distribution q and q is recorded (Leviathan-style verification).
The EAGLE-2 loop alone (top_k_search -> TreeSearch) also drives the SGLang plugin's MoA draft,
which hands SGLang the organized search instead of TokenTrees.

step_fn(tokens [b, k], parent_beam [b, k] | None) -> logits [b, k, V]
    tokens are the current frontier; parent_beam[i, j] is the index (in the previous frontier) of the
    parent of frontier node j, or None on the first call (the frontier are the root's children).
"""

from __future__ import annotations

from typing import Callable

import torch

from ..sampling import greedy_tokens, logits_to_probs
from ..tree import TokenTree, TreeSearch, TreeShape, build_trees, chain_tree
from .base import DrafterError, DraftInput

StepFn = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]


# logit of target ids outside a drafter's reduced vocab: never drawn (exp underflows to 0)
_NEG = -1e9  # finite: the search checks that logits are finite


def scatter_to_vocab(draft_logits: torch.Tensor, hot_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Draft-vocab logits [n, v] -> target-vocab logits [n, V]; ids outside the draft vocab get _NEG.
    Sampled chains need q over the target vocab for verification."""
    full = draft_logits.new_full((draft_logits.shape[0], vocab_size), _NEG)
    full[:, hot_ids] = draft_logits
    return full


def _check_finite(logits: torch.Tensor, where: str) -> None:
    if not torch.isfinite(logits).all():
        raise DrafterError(f"drafter produced non-finite logits ({where})")


def search_tree(
    root_logits: torch.Tensor, step_fn: StepFn, shape: TreeShape, batch: list[DraftInput]
) -> list[TokenTree]:
    """root_logits [b, V]: the drafter's prediction after each request's root token."""
    _check_finite(root_logits, "root")
    if shape.topk == 1 and any(not d.params.greedy for d in batch):
        return _sample_chains(root_logits, step_fn, shape, batch)
    search = top_k_search(root_logits, step_fn, shape.topk, shape.depth, shape.min_prob)
    roots = torch.tensor([d.token_ids[-1] for d in batch])
    return build_trees(roots, search, [d.seq_len for d in batch], shape.num_draft_tokens, shape.min_prob)


def top_k_search(
    root_logits: torch.Tensor, step_fn: StepFn, topk: int, depth: int, min_prob: float = 0.0, check: bool = True
) -> TreeSearch:
    """The EAGLE-2 loop: root_logits [b, V] -> the root's top-k, then per step each frontier node's
    top-k children, globally reranked by path probability. min_prob > 0 stops once the whole frontier
    is below it; check=False skips the finiteness checks (each one a device sync)."""
    if check:
        _check_finite(root_logits, "root")
    probs = torch.softmax(root_logits.float(), dim=-1)
    topk_p, topk_index = probs.topk(topk, dim=-1)
    search = TreeSearch.start(topk)
    tokens, scores = search.first(topk_p, topk_index)
    parent_beam = None
    for step in range(1, depth):
        if min_prob and bool((scores < min_prob).all()):
            break  # no frontier node of any request would be verified: its children even less (scores only fall)
        logits = step_fn(tokens, parent_beam)  # [b, k, V]
        if check:
            _check_finite(logits, f"step {step}")
        child_p, child_index = torch.softmax(logits.float(), dim=-1).topk(topk, dim=-1)
        tokens, scores, parent_beam = search.expand(step, scores, child_p.flatten(0, 1), child_index.flatten(0, 1))
    return search


def _sample_chains(
    root_logits: torch.Tensor, step_fn: StepFn, shape: TreeShape, batch: list[DraftInput]
) -> list[TokenTree]:
    b = len(batch)
    drafts: list[list[int]] = [[] for _ in range(b)]
    qs: list[list[torch.Tensor]] = [[] for _ in range(b)]
    logits = root_logits
    for step in range(shape.depth):
        nxt = []
        for i, d in enumerate(batch):
            q = logits_to_probs(logits[i], d.params)
            x = (
                int(greedy_tokens(logits[i]))
                if d.params.greedy
                else int(torch.multinomial(q, 1, generator=d.generator))
            )
            drafts[i].append(x)
            qs[i].append(q)
            nxt.append(x)
        if step + 1 < shape.depth:  # the next step's logits, from the tokens just drafted
            tokens = torch.tensor(nxt)[:, None]
            logits = step_fn(tokens, None if step == 0 else torch.zeros(b, 1, dtype=torch.long))[:, 0]
            _check_finite(logits, f"step {step + 1}")
    trees = []
    for i, d in enumerate(batch):
        q = None
        if not d.params.greedy:
            q = torch.stack([torch.zeros_like(qs[i][0])] + qs[i])  # row 0 (root) unused
        tree = chain_tree(d.token_ids[-1], drafts[i], d.seq_len, draft_probs=q, device=root_logits.device)
        # the merged drafter's ranking reads scores on the host (merges are built there)
        tree.scores = torch.tensor([1.0] + [float(qs[i][k][x]) for k, x in enumerate(drafts[i])]).cumprod(0)
        trees.append(tree)
    return trees
