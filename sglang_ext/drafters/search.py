"""Tree search shared by all neural drafters (draft model, EAGLE-3, MoA).

A drafter supplies the root logits and a step function; this module turns them into TokenTrees:
- EAGLE-2 dynamic tree (top-k per frontier node, global rerank) — deterministic proposals, which
  the verifier treats as point masses, so it is lossless under sampling too; with shape.min_prob,
  nodes of lower path probability are not verified (on the CPU they are left out and the search stops
  once the whole frontier is below; on a device that would read the scores back);
- chains (topk = 1): argmax for greedy requests; for sampling requests each token is drawn from
  the drafter's processed distribution q and q is recorded (Leviathan-style verification).
The EAGLE-2 loop alone (top_k_search -> TreeSearch) also drives the SGLang plugin's MoA draft,
which hands SGLang the organized search instead of TokenTrees.
Nothing here reads the device: a search on a GPU queues its work and returns (the engine's one copy
per step reads the accepted tokens, and with them whether the drafter's logits were finite).

step_fn(tokens [b, k], parent_beam [b, k] | None) -> logits [b, k, V]
    tokens are the current frontier; parent_beam[i, j] is the index (in the previous frontier) of the
    parent of frontier node j, or None on the first call (the frontier are the root's children).
"""

from __future__ import annotations

from typing import Callable

import torch

from .. import kernels
from ..device import to_device
from ..sampling import draw, greedy_tokens, logits_to_probs
from ..tree import TokenTree, TreeSearch, TreeShape, build_trees, chain_tree
from .base import DraftInput

StepFn = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]


# logit of target ids outside a drafter's reduced vocab: never drawn (exp underflows to 0)
_NEG = -1e9  # finite: the search checks that logits are finite (Finite)


def scatter_to_vocab(draft_logits: torch.Tensor, hot_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Draft-vocab logits [n, v] -> target-vocab logits [n, V]; ids outside the draft vocab get _NEG.
    Sampled chains need q over the target vocab for verification."""
    full = draft_logits.new_full((draft_logits.shape[0], vocab_size), _NEG)
    full[:, hot_ids] = draft_logits
    return full


class Finite:
    """Whether every logit a search produced was finite, as a [] bool on the logits' device: each step
    ANDs its own check in, and nothing is read. A faulty drafter's non-finite logits still give valid
    token ids (top-k and argmax over NaN pick some index), so its tree is verified losslessly like any
    other; the flag rides on the trees (TokenTree.finite) into the engine's one copy per step, which
    then drops the drafter for those requests."""

    def __init__(self, per_request: bool = False):
        """per_request: the flag is [b] bool, request i's logits (rows [b, ...]) all finite (a search
        over a padded batch keeps its padding out of the real requests' flag)."""
        self.flag: torch.Tensor | None = None
        self.per_request = per_request

    def check(self, logits: torch.Tensor) -> None:
        self.rows(torch.isfinite(logits).flatten(1).all(1))

    def rows(self, ok: torch.Tensor) -> None:
        """ok [b] bool: whether each request's logits were all finite."""
        ok = ok if self.per_request else ok.all()
        self.flag = ok if self.flag is None else self.flag & ok


def search_tree(
    root_logits: torch.Tensor, step_fn: StepFn, shape: TreeShape, batch: list[DraftInput]
) -> list[TokenTree]:
    """root_logits [b, V]: the drafter's prediction after each request's root token."""
    finite = Finite()
    if shape.topk == 1 and any(not d.params.greedy for d in batch):
        trees = _sample_chains(root_logits, step_fn, shape, batch, finite)
    elif one_level(shape, root_logits.device):
        trees = root_children(*softmax_top_k(root_logits, shape.topk, finite), shape, batch)
    else:
        search = top_k_search(root_logits, step_fn, shape.topk, shape.depth, shape.min_prob, finite)
        roots = to_device(torch.tensor([d.token_ids[-1] for d in batch]), root_logits.device)
        trees = build_trees(roots, search, [d.seq_len for d in batch], shape.num_draft_tokens, shape.min_prob)
    for t in trees:
        t.finite = finite.flag
    return trees


def one_level(shape: TreeShape, device: torch.device) -> bool:
    """Whether a search of `shape` is the root's top-k alone, written out on the host (root_children): one level,
    every candidate selected, on the CPU."""
    return shape.depth == 1 and shape.num_draft_tokens > shape.topk and device.type == "cpu"


def softmax_top_k(logits: torch.Tensor, k: int, finite: Finite) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest softmax probabilities of logits [b, V] on the CPU and their ids ([b, k] each, descending, as
    top_k_search takes them), checked into `finite`: one call of the layer ops where they run (a drafted step's
    caches are cold after the target's weights streamed through, and each small op pays for it: the ids of
    softmax + topk, the probabilities within their last bit), else those ops."""
    op = kernels.softmax_topk
    if op is not None and logits.dtype == torch.float32 and logits.dim() == 2 and logits.stride(1) == 1:
        top_p, top_ids, ok = op(logits, k)
        finite.rows(ok)
        return top_p, top_ids
    finite.check(logits)
    return torch.softmax(logits.float(), dim=-1).topk(k, dim=-1)


def root_children(
    top_p: torch.Tensor, top_ids: torch.Tensor, shape: TreeShape, batch: list[DraftInput], finite=None
) -> list[TokenTree]:
    """A one-level search on the CPU (the neural drafters' CPU default) from each root's top-k, top_p / top_ids
    [b, k] (probabilities descending, the children's token ids): the children whose probability reaches
    min_prob, in order of probability, written out from host lists. The same trees as top_k_search +
    build_trees give when every candidate is selected (one_level), in a few ops instead of the search's ~100
    (a CPU step's ~0.6 ms). finite: the trees' flag (Finite's)."""
    probs, ids = top_p.tolist(), top_ids.tolist()
    trees = []
    for b, d in enumerate(batch):
        kept = [j for j, p in enumerate(probs[b]) if p >= shape.min_prob] if shape.min_prob > 0 else range(shape.topk)
        m = len(kept)
        n = m + 1
        mask = torch.tensor([[True] + [i == j for j in range(1, n)] for i in range(n)])  # the root and itself
        longs = torch.tensor(
            [
                [d.token_ids[-1], *(ids[b][j] for j in kept)],  # draft tokens (draft ids below the root)
                [-1] + [0] * m,  # parents
                [d.seq_len] + [d.seq_len + 1] * m,  # positions
                [b * n + i for i in range(n)],  # retrieve_index
                [1 if m else -1] + [-1] * m,  # retrieve_next_token
                [-1] + [i + 1 if i < m else -1 for i in range(1, n)],  # retrieve_next_sibling
            ],
            dtype=torch.long,
        )
        tokens, parents, positions, index, next_token, next_sibling = longs.unbind()
        scores = torch.tensor([1.0, *(probs[b][j] for j in kept)], dtype=top_p.dtype)  # (top_p's values, exactly)
        trees.append(
            TokenTree(tokens, parents, positions, mask, index, next_token, next_sibling, scores=scores, finite=finite)
        )
    return trees


def top_k_search(
    root_logits: torch.Tensor,
    step_fn: StepFn,
    topk: int,
    depth: int,
    min_prob: float = 0.0,
    finite: Finite | None = None,
) -> TreeSearch:
    """The EAGLE-2 loop: root_logits [b, V] -> the root's top-k, then per step each frontier node's
    top-k children, globally reranked by path probability. `finite` (if given) collects whether every
    logit was finite. min_prob > 0 on the CPU stops once the whole frontier is below it; on a device
    the search runs every step (stopping would read the scores back; the nodes below min_prob are
    left unverified by build_trees)."""
    if finite is not None:
        finite.check(root_logits)
    probs = torch.softmax(root_logits.float(), dim=-1)
    topk_p, topk_index = probs.topk(topk, dim=-1)
    search = TreeSearch.start(topk)
    tokens, scores = search.first(topk_p, topk_index)
    parent_beam = None
    for step in range(1, depth):
        if min_prob and scores.device.type == "cpu" and bool((scores < min_prob).all()):
            break  # no frontier node of any request would be verified: its children even less (scores only fall)
        logits = step_fn(tokens, parent_beam)  # [b, k, V]
        if finite is not None:
            finite.check(logits)
        child_p, child_index = torch.softmax(logits.float(), dim=-1).topk(topk, dim=-1)
        tokens, scores, parent_beam = search.expand(step, scores, child_p.flatten(0, 1), child_index.flatten(0, 1))
    return search


def _draw(logits: torch.Tensor, d: DraftInput) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's next chain token from logits [V], on their device: (token [1], q [V]: the
    distribution it was drawn from). Non-finite logits (a faulty drafter) draw from the uniform
    distribution instead, which is then the q verification divides by: still lossless."""
    q = logits_to_probs(logits, d.params)
    if d.params.greedy:
        return greedy_tokens(logits).reshape(1), q
    q = torch.where(torch.isfinite(q).all(), q, torch.full_like(q, 1.0 / q.shape[-1]))
    return draw(q, d.generator).reshape(1), q  # (torch.multinomial's draw without its reads)


def _sample_chains(
    root_logits: torch.Tensor, step_fn: StepFn, shape: TreeShape, batch: list[DraftInput], finite: Finite
) -> list[TokenTree]:
    """Chains drawn token by token from the drafter's processed distribution q (argmax for greedy
    requests), on the logits' device: nothing is read back."""
    b, dev = len(batch), root_logits.device
    drafts: list[list[torch.Tensor]] = [[] for _ in range(b)]  # per request, per step: token [1]
    qs: list[list[torch.Tensor]] = [[] for _ in range(b)]  # per request, per step: q [V]
    logits = root_logits
    finite.check(root_logits)
    for step in range(shape.depth):
        for i, d in enumerate(batch):
            x, q = _draw(logits[i], d)
            drafts[i].append(x)
            qs[i].append(q)
        if step + 1 < shape.depth:  # the next step's logits, from the tokens just drafted
            tokens = torch.cat([x[-1] for x in drafts])[:, None]  # [b, 1]
            parent = None if step == 0 else torch.zeros(b, 1, dtype=torch.long, device=dev)
            logits = step_fn(tokens, parent)[:, 0]
            finite.check(logits)
    trees = []
    for i, d in enumerate(batch):
        tokens = torch.cat(drafts[i])  # [depth]
        q = torch.stack(qs[i])  # [depth, V]
        rows = None if d.params.greedy else torch.cat([torch.zeros_like(q[:1]), q])  # row 0 (root) unused
        tree = chain_tree(d.token_ids[-1], tokens, d.seq_len, draft_probs=rows, device=dev)
        # each node's chance of acceptance as the merged drafter ranks it: the running product of q
        tree.scores = torch.cat([q.new_ones(1), q.gather(1, tokens[:, None])[:, 0]]).cumprod(0)
        trees.append(tree)
    return trees
