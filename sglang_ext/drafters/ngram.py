"""Prompt-lookup / n-gram drafter: no model, no training.

The longest suffix of the sequence (max_ngram down to min_ngram tokens) is looked up in the
earlier context; the tokens that followed each match (most recent first) become candidate
continuations. Candidates are merged into a trie and the most frequently proposed nodes form the
tree (topk = 1: the best chain). Proposals are deterministic (point masses), so verification
stays lossless under sampling. With a tree min_prob, a node's estimated probability is its share of
the candidates times the confidence of the match (`match_confidence`).
"""

from __future__ import annotations

import math

import torch

from ..tree import TokenTree, TreeShape, tree_from_parents
from .base import Drafter, DraftInput, TargetCapture

# NOTE: a lookup's candidates are only as good as the match behind them: teacher-forced on greedy
# SmolLM2 outputs, suffix-drafter nodes after a 0-1 token match in the request itself were accepted
# ~20 % of the time, after 2 tokens ~40 %, after 3-4 tokens 50-75 % (scripts/lookup-acceptance.py)
FULL_CONFIDENCE_MATCH = 3


def match_confidence(match_len: int) -> float:
    """How far a lookup's candidate shares are trusted as probabilities: 0 for no match, 1 from
    FULL_CONFIDENCE_MATCH matched tokens on."""
    return min(1.0, match_len / FULL_CONFIDENCE_MATCH)


class NgramDrafter(Drafter):
    name = "ngram"
    needs_commit = False  # reads token ids only (DraftInput); commit() is a no-op
    reads_reference = True  # searches DraftInput.reference (a predicted output) itself

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, max_matches: int = 8):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("ngram sizes must satisfy 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram, self.max_matches = max_ngram, min_ngram, max_matches

    def add_request(self, rid: int, capture: TargetCapture) -> None:
        pass

    def commit(self, rid: int, capture: TargetCapture) -> None:
        pass

    def remove_request(self, rid: int) -> None:
        pass

    def longest_match(
        self, tokens: list[int], length: int, reference: list[int] = (), own: bool = True
    ) -> tuple[int, list[list[int]]]:
        """(n, continuations): the longest n-gram tail of `tokens` found earlier in them (unless
        own=False) or in `reference` (a predicted output: its matches come first), and what followed
        it, most recent match first."""
        n_tok = len(tokens)
        for n in range(min(self.max_ngram, n_tok - 1), self.min_ngram - 1, -1):
            tail = tokens[n_tok - n :]
            found = _matches(reference, tail, length, len(reference) - n - 1, self.max_matches)
            if own:
                found += _matches(tokens, tail, length, n_tok - n - 1, self.max_matches - len(found))
            if found:
                return n, found
        return 0, []

    def propose(self, batch: list[DraftInput], shape: TreeShape) -> list[TokenTree]:
        return [self._tree(d, shape) for d in batch]

    def _tree(self, d: DraftInput, shape: TreeShape) -> TokenTree:
        n, conts = self.longest_match(d.token_ids, shape.depth, d.reference)
        return trie_tree(d.token_ids[-1], d.seq_len, by_recency(conts), shape, confidence=match_confidence(n))


def by_recency(conts: list[list[int]]) -> list[tuple[list[int], float]]:
    """Equal weights, ties broken by recency (conts come most recent first)."""
    return [(c, 1.0 + 1e-3 / (rank + 1)) for rank, c in enumerate(conts)]


def _matches(seq: list[int], tail: list[int], length: int, last_start: int, limit: int) -> list[list[int]]:
    """Up to `limit` continuations (<= `length` tokens, non-empty) of `tail` in seq, from start
    `last_start` down to 0."""
    found: list[list[int]] = []
    n, first = len(tail), tail[0]
    for i in range(last_start, -1, -1):
        if len(found) >= limit:
            break
        if seq[i] == first and seq[i : i + n] == tail:
            found.append(list(seq[i + n : i + n + length]))
    return found


def trie_tree(
    root: int,
    seq_len: int,
    weighted: list[tuple[list[int], float]],
    shape: TreeShape,
    min_share: float = 0.0,
    confidence: float = 1.0,
) -> TokenTree:
    """The TokenTree of the heaviest nodes of a trie of weighted continuations (at most topk children
    each); nodes carrying less than `min_share` of the total weight are left out (not worth a verify
    slot), and with shape.min_prob > 0 so are nodes whose estimated probability (share x `confidence`)
    is below it."""
    # trie: node key = (parent node, token); weight = sum of the weights of continuations through it
    children: dict[tuple[int, int], int] = {}
    weight: list[float] = [0.0]
    parent: list[int] = [-1]
    token: list[int] = [root]
    for cont, w in weighted:
        node = 0
        for tok in cont:
            key = (node, tok)
            if key not in children:
                children[key] = len(token)
                token.append(tok)
                parent.append(node)
                weight.append(0.0)
            node = children[key]
            weight[node] += w
    # keep the heaviest nodes (a node's weight never exceeds its parent's, so ancestors come along),
    # at most topk children per node, then renumber parents-first
    order = sorted(range(1, len(token)), key=lambda i: (-weight[i], i))
    kept, n_children = [0], {}
    keep_set = {0}
    share = min_share
    if shape.min_prob > 0:
        share = max(share, shape.min_prob / confidence if confidence > 0 else math.inf)
    floor = share * sum(w for _, w in weighted)
    for i in order:
        if len(kept) >= shape.num_draft_tokens or weight[i] < floor:
            break
        p = parent[i]
        if p in keep_set and n_children.get(p, 0) < shape.topk:
            kept.append(i)
            keep_set.add(i)
            n_children[p] = n_children.get(p, 0) + 1
    kept.sort()  # trie ids were assigned parents-first
    new_id = {old: new for new, old in enumerate(kept)}
    tokens = torch.tensor([token[i] for i in kept])
    parents = torch.tensor([-1] + [new_id[parent[i]] for i in kept[1:]])
    total = sum(w for _, w in weighted) or 1.0
    scores = torch.tensor([1.0] + [min(1.0, weight[i] / total * confidence) for i in kept[1:]])  # share x confidence
    return tree_from_parents(tokens, parents, seq_len, scores=scores)
