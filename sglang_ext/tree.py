"""Token trees: EAGLE-2 dynamic tree search and SGLang 0.5.23's tree layout.

Terminology. A request's tree has N = num_draft_tokens nodes. Node 0 (the root) is the last
verified token (whose K/V the target has not computed yet); nodes 1..N-1 are draft tokens,
parents before children. Depth of the root is 0; a node's position is seq_len + depth.

Search (mirrors SGLang's select_top_k_tokens / organize_draft_results so layouts match):

    step 0: frontier = top-k of the root distribution;          scores (b, 1, k)
    step i: each of the k frontier nodes expands its top-k;      scores (b, k, k) = parent * child prob
            the global top-k of those k*k becomes the frontier
    finally: the (N-1) best scores over all steps are kept, sorted by flat index
             (which orders parents before children).

    flat score index s:   [ step0: 0..k-1 | step1: k..k+k^2-1 | step2: ... ]
    parent of s:          parent_list[s // k]  (-1 for step-0 nodes = the root)

Layout (per request, what SGLang's build_tree_kernel_efficient produces, QLEN_ONLY mask):

    draft_tokens          [N]     node tokens, root first
    positions             [N]     seq_len + depth
    tree_mask             [N, N]  bool, row i = ancestors of i and i itself
    retrieve_index        [N]     b*N + i (flat node id in the batch)
    retrieve_next_token   [N]     first child (lowest index), -1 if leaf
    retrieve_next_sibling [N]     next sibling (next higher index), -1 if last
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np
import torch

from .device import to_device, upload


@dataclass(frozen=True)
class TreeShape:
    depth: int  # draft steps (SGLang speculative_num_steps)
    topk: int  # children per expanded node (1 = chain)
    num_draft_tokens: int  # nodes verified per request, root included (at most)
    # neural drafters' searched trees (top-k trees, greedy chains; not sampled chains): a node whose
    # path probability under the drafter (the product of its path's draft probabilities, the search's
    # score) is below this is not verified, and no step is drafted once every frontier node is below
    # it. A verify row costs a fraction of a decode on a CPU and a node of low draft probability is rarely
    # accepted (docs/BENCHMARKS.md, "Tree shapes"). Lookup drafters (ngram, suffix) estimate a node's
    # probability as its share of their candidates x the confidence of the match behind them
    # (drafters/ngram.py: match_confidence). 0 = keep all.
    min_prob: float = 0.0

    def __post_init__(self):
        if self.depth < 1 or self.topk < 1:
            raise ValueError(f"tree depth and topk must be >= 1, got depth={self.depth} topk={self.topk}")
        if not 0.0 <= self.min_prob < 1.0:
            raise ValueError(f"tree min_prob must be in [0, 1), got {self.min_prob}")
        most = self.depth + 1 if self.topk == 1 else 1 + self.topk + (self.depth - 1) * self.topk**2
        if not 2 <= self.num_draft_tokens <= most:
            raise ValueError(
                f"num_draft_tokens must be in [2, {most}] for depth={self.depth} topk={self.topk}, got "
                f"{self.num_draft_tokens}"
            )

    @classmethod
    def chain(cls, depth: int) -> "TreeShape":
        return cls(depth, 1, depth + 1)

    @classmethod
    def parse(cls, text: str) -> "TreeShape":
        """'depth,topk,num_draft_tokens[,min_prob]' (e.g. '6,8,48' or '1,2,3,0.2'), or 'depth' for a chain."""
        usage = f"tree must be 'depth,topk,num_draft_tokens[,min_prob]' or 'depth', got {text!r}"
        parts = text.split(",")
        try:
            ints = [int(p) for p in parts[:3]]
            min_prob = float(parts[3]) if len(parts) == 4 else 0.0
        except ValueError as e:
            raise ValueError(usage) from e
        if len(parts) == 1:
            return cls.chain(ints[0])
        if len(parts) not in (3, 4):
            raise ValueError(usage)
        return cls(*ints, min_prob=min_prob)

    @property
    def label(self) -> str:
        """'d,k,n' (and ',p' with a min_prob), as parse() reads it."""
        base = f"{self.depth},{self.topk},{self.num_draft_tokens}"
        return f"{base},{self.min_prob:g}" if self.min_prob else base


@dataclass
class TokenTree:
    """One request's tree in SGLang's layout (see module docstring), plus our parents array."""

    draft_tokens: torch.Tensor  # [N] int64
    parents: torch.Tensor  # [N] int64, -1 for the root
    positions: torch.Tensor  # [N] int64
    tree_mask: torch.Tensor  # [N, N] bool
    retrieve_index: torch.Tensor  # [N] int64
    retrieve_next_token: torch.Tensor  # [N] int64
    retrieve_next_sibling: torch.Tensor  # [N] int64
    # Proposal distribution each node's token was drawn from (chain sampling); None = deterministic
    # proposals (top-k), which verification treats as point masses.
    draft_probs: torch.Tensor | None = None  # [N, V] float, row 0 unused
    # each node's estimated probability of acceptance under its drafter (root 1): a neural search's path
    # probability, a lookup's candidate share x match confidence (TreeShape.min_prob); None = not estimated.
    # A merged multi-drafter tree (drafters/merged.py) ranks the nodes of several drafters by it.
    scores: torch.Tensor | None = None  # [N] float
    # [] bool on the tree's device: whether the drafter's logits behind the tree were all finite. A
    # faulty drafter's tree still holds valid ids and is verified losslessly; the engine reads the flag
    # in its one copy per step and drops the drafter for the request. None: nothing to check.
    finite: torch.Tensor | None = None
    # the packed batch whose rows these fields are views of (unpack_trees), for a verify that takes the batch whole;
    # None for a tree built alone (never uploaded or compared: not a tensor field)
    batch: "TreeBatch | None" = field(default=None, repr=False, compare=False)

    @property
    def num_nodes(self) -> int:
        return self.draft_tokens.numel()

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root to `node` inclusive."""
        path = []
        while node != -1:
            path.append(node)
            node = int(self.parents[node])
        return path[::-1]


def tree_from_parents(
    tokens: torch.Tensor,  # [N] node tokens, root first
    parents: torch.Tensor,  # [N] parent index of each node, -1 for the root
    seq_len: int,
    batch_index: int = 0,
    draft_probs=None,
    unlinked=(),
    scores=None,
) -> TokenTree:
    """Build the layout from node tokens and parent indices (parents[i] < i, parents[0] == -1).

    Nodes in `unlinked` (node indices, or an [N] bool tensor) keep their mask row and position but
    are left out of the retrieve lists, so verification never reaches them (SGLang's treatment of a
    node whose parent was not kept).

    Everything is built where `parents` lives, with fixed-shape tensor ops: no value is read back
    to the host. Parents on the host are checked; a device's are trusted (checking them would read
    them back). A host tree of up to HOST_TREE_NODES nodes is laid out in Python instead (_host_tree: the same
    values, a few times faster at these sizes).
    """
    n = tokens.numel()
    parents = parents.long()
    dev = parents.device
    if dev.type == "cpu":
        par = parents.tolist()
        if par[0] != -1 or any(not 0 <= p < i for i, p in enumerate(par[1:], 1)):
            raise ValueError("tree parents must precede children and node 0 must be the root")
    if n == 1:  # the root alone (a plain decode step): nothing to derive
        none = torch.full((1,), -1, dtype=torch.long, device=dev)
        mask = torch.ones(1, 1, dtype=torch.bool, device=dev)
        return TokenTree(
            tokens.long(),
            parents,
            none + 1 + seq_len,
            mask,
            none + 1 + batch_index,
            none,
            none.clone(),
            draft_probs,
            scores,
        )
    if dev.type == "cpu" and n <= HOST_TREE_NODES:
        return _host_tree(tokens.long(), parents, par, seq_len, batch_index, draft_probs, unlinked, scores)
    if isinstance(unlinked, torch.Tensor):
        linked = ~to_device(unlinked.bool(), dev)
    else:
        linked = torch.ones(n, dtype=torch.bool, device=dev)
        if unlinked:
            linked[to_device(torch.tensor(sorted(unlinked), dtype=torch.long), dev)] = False
    mask = ancestor_masks(parents[None])[0]
    next_token, next_sibling = (x[0] for x in child_lists(parents[None], linked[None]))
    return TokenTree(
        draft_tokens=tokens.long(),
        parents=parents,
        positions=mask.sum(1) - 1 + seq_len,  # seq_len + depth (a node's ancestors, itself excluded)
        tree_mask=mask,
        retrieve_index=torch.arange(n, dtype=torch.long, device=dev) + batch_index * n,
        retrieve_next_token=next_token,
        retrieve_next_sibling=next_sibling,
        draft_probs=draft_probs,
        scores=scores,
    )


# a host tree of up to this many nodes (a lookup drafter's, every step) is laid out in Python from its parents list
# (each node's ancestors a 64-bit set): ~20 small tensor ops cost 2-5x that at these sizes
HOST_TREE_NODES = 64


def _host_tree(tokens, parents, par: list[int], seq_len: int, batch_index: int, draft_probs, unlinked, scores):
    """tree_from_parents's layout for a host tree (par: its parents as a list), with the same values: each node's
    ancestors as a bit set, its first linked child and next linked sibling in index order."""
    n = len(par)
    if isinstance(unlinked, torch.Tensor):
        linked = [not u for u in unlinked.bool().tolist()]
    else:
        linked = [True] * n
        for u in unlinked:
            linked[u] = False
    bits, depth = [1] + [0] * (n - 1), [0] * n
    first, sibling, last = [-1] * n, [-1] * n, [-1] * n
    for i in range(1, n):
        p = par[i]
        bits[i], depth[i] = bits[p] | (1 << i), depth[p] + 1
        if linked[i]:
            if first[p] < 0:
                first[p] = i
            if last[p] >= 0:
                sibling[last[p]] = i
            last[p] = i
    rows = np.array(bits, dtype="<u8").view(np.uint8).reshape(n, 8)  # (each row's bit set, 64 columns)
    mask = torch.from_numpy(np.unpackbits(rows, axis=1, bitorder="little")[:, :n].astype(bool))
    return TokenTree(
        draft_tokens=tokens,
        parents=parents,
        positions=torch.tensor(depth) + seq_len,
        tree_mask=mask,
        retrieve_index=torch.arange(n, dtype=torch.long) + batch_index * n,
        retrieve_next_token=torch.tensor(first),
        retrieve_next_sibling=torch.tensor(sibling),
        draft_probs=draft_probs,
        scores=scores,
    )


def root_tree(token: int, seq_len: int, device: torch.device | str = "cpu") -> TokenTree:
    """A root-only tree (a plain decode step) from a host int, on `device`: the layout is fixed, so
    it is written out (no parents to check, nothing read)."""
    tokens = to_device(torch.tensor([token], dtype=torch.long), device)
    none = torch.full((1,), -1, dtype=torch.long, device=tokens.device)
    mask = torch.ones(1, 1, dtype=torch.bool, device=tokens.device)
    return TokenTree(tokens, none, none + 1 + seq_len, mask, none + 1, none.clone(), none.clone())


def root_trees(tokens: list[int], seq_lens: list[int], device: torch.device | str = "cpu") -> list[TokenTree]:
    """root_tree for a batch (every non-drafting request of a step) in a fixed number of ops: the tokens,
    positions and the constants -1 and 0 go up in one copy and every tree's fields are views of it. The
    fields every root-only tree shares (parents, retrieve lists: -1; retrieve_index: 0; the mask: the node
    sees itself) are one tensor each for the batch (trees are never written in place)."""
    b = len(tokens)
    if not b:
        return []
    vals = to_device(torch.tensor([*tokens, *seq_lens, -1, 0], dtype=torch.long), device)
    toks, pos, none, zero = vals.split([b, b, 1, 1])
    mask = torch.ones(1, 1, dtype=torch.bool, device=vals.device)
    return [TokenTree(t, none, p, mask, zero, none, none) for t, p in zip(toks.split(1), pos.split(1))]


# TokenTree's tensor fields (all but `batch`), in order
TREE_FIELDS = tuple(f.name for f in fields(TokenTree) if f.name != "batch")


def trees_on(trees: list[TokenTree], device: torch.device | str) -> list[TokenTree]:
    """The trees with every tensor on `device`: a tree already there is returned as is; the others'
    tensors (host-built lookup trees, root-only trees) go up in one copy per dtype for all of them."""
    device = torch.device(device)
    names = TREE_FIELDS
    flat = [getattr(t, name) for t in trees for name in names]
    placed = upload(flat, device)
    k, out = len(names), []
    for i, t in enumerate(trees):
        mine = placed[i * k : (i + 1) * k]
        out.append(t if all(a is b for a, b in zip(flat[i * k : (i + 1) * k], mine)) else TokenTree(*mine))
    return out


def chain_tree(
    root_token: int, draft: list[int] | torch.Tensor, seq_len: int, draft_probs=None, device=None
) -> TokenTree:
    """A chain from host ints, or from a [d] tensor of draft tokens (a search's, left unread), built on
    `device` (default: draft_probs' device, else the CPU)."""
    if device is None:
        device = draft_probs.device if draft_probs is not None else "cpu"
    if isinstance(draft, torch.Tensor):
        root = to_device(torch.tensor([root_token], dtype=torch.long), device)
        tokens = torch.cat([root, to_device(draft.long(), device)])
    else:
        tokens = to_device(torch.tensor([root_token] + list(draft), dtype=torch.long), device)
    parents = torch.arange(-1, len(draft), dtype=torch.long, device=device)
    return tree_from_parents(tokens, parents, seq_len, draft_probs=draft_probs)


# --- EAGLE-2 dynamic tree search (SGLang semantics) ------------------------------------------


@dataclass
class TreeSearch:
    """Accumulates the per-step scores/tokens/parents of a dynamic tree search for a batch."""

    topk: int
    score_list: list[torch.Tensor]  # per step: (b, 1, k) then (b, k, k)
    token_list: list[torch.Tensor]  # per step: (b, k) then (b, k*k)
    parents_list: list[torch.Tensor]  # per step: (b, k+1) then (b, k)

    @classmethod
    def start(cls, topk: int) -> "TreeSearch":
        return cls(topk, [], [], [])

    def first(self, topk_p: torch.Tensor, topk_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 0 from the root's top-k (b, k). Returns (frontier tokens (b,k), frontier scores (b,k))."""
        b, k = topk_p.shape
        self.score_list.append(topk_p.unsqueeze(1))
        self.token_list.append(topk_index)
        self.parents_list.append(torch.arange(-1, k, dtype=torch.long, device=topk_index.device).expand(b, -1))
        return topk_index, topk_p

    def expand(self, step: int, scores: torch.Tensor, topk_p: torch.Tensor, topk_index: torch.Tensor):
        """Step >= 1. scores (b,k) of the frontier; topk_p/topk_index (b*k, k) of each frontier node's children.

        Returns (new frontier tokens (b,k), new frontier scores (b,k), parent beam of each new frontier node (b,k)).
        """
        k = self.topk
        expand_scores = scores.unsqueeze(2) * topk_p.view(-1, k, k)  # (b, k, k)
        cs_p, cs_index = torch.topk(expand_scores.flatten(1), k, dim=-1)  # (b, k)
        flat_tokens = topk_index.view(-1, k * k)
        self.score_list.append(expand_scores)
        self.token_list.append(flat_tokens)
        self.parents_list.append(cs_index + (k * k * (step - 1) + k))
        return torch.gather(flat_tokens, 1, cs_index), cs_p, cs_index // k

    def flat_scores(self) -> torch.Tensor:
        """(b, S) every candidate's score (path probability), by flat score index."""
        return torch.cat(self.score_list, dim=1).flatten(1)

    def organize(self, num_draft_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(parent_list (b, P), top_scores_index (b, N-1) sorted, draft_tokens (b, N-1)); fewer than
        N-1 when the search stopped early (fewer candidates than that)."""
        scores = self.flat_scores()
        tokens = torch.cat(self.token_list, dim=1)
        top = torch.topk(scores, min(num_draft_tokens - 1, scores.shape[1]), dim=-1).indices.sort(dim=-1).values
        draft_tokens = torch.gather(tokens, 1, top)
        if len(self.parents_list) > 1:
            parent_list = torch.cat(self.parents_list[:-1], dim=1)
        else:
            parent_list = torch.empty(scores.shape[0], 0, dtype=torch.long, device=scores.device)
        return parent_list, top, draft_tokens


def node_parents(
    parent_list: torch.Tensor, top_scores_index: torch.Tensor, topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Parent node index (in 0..N-1, root = 0) of each selected node, for one request.

    parent_list [P], top_scores_index [N-1] sorted. Returns (parents [N] with -1 for the root,
    unlinked [N] bool). A node whose parent was not selected (only possible with exact score ties)
    hangs off the root, as SGLang's kernel does for retrieval, and is unlinked (never verified).
    """
    return link_selected(top_scores_index, _flat_parents(parent_list, top_scores_index, topk))


def _flat_parents(parent_list: torch.Tensor, top_scores_index: torch.Tensor, topk: int) -> torch.Tensor:
    """Each selected candidate's parent's flat score index (-1: the root), from TreeSearch's parent_list."""
    pt = top_scores_index // topk
    # parent_list[0] is -1 (the root), so step-0 nodes (pt == 0) map to the root directly
    return parent_list[pt] if parent_list.numel() else torch.full_like(pt, -1)


def link_selected(selected: torch.Tensor, parent_flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates selected from a search's flat list as tree nodes, on their device: selected [M] their
    flat indices, sorted (a parent's flat index is below its children's); parent_flat [M] each one's
    parent's flat index (-1: the root). Returns (parents [M+1] node indices, root first with -1;
    unlinked [M+1] bool: a node whose parent was not selected hangs off the root, never verified)."""
    pos = torch.searchsorted(selected, parent_flat)
    found = (parent_flat >= 0) & (pos < selected.numel())
    found &= selected[pos.clamp(max=max(selected.numel() - 1, 0))] == parent_flat
    parents = torch.where(found, pos + 1, 0)
    orphan = (~found) & (parent_flat >= 0)
    root = parents.new_full((1,), -1)
    return torch.cat([root, parents]), torch.cat([orphan.new_zeros(1), orphan])


def trees_from_candidates(
    roots: torch.Tensor,  # [b] each request's root token
    selected: torch.Tensor,  # [b, M] the selected candidates' flat indices, sorted (parents first)
    tokens: torch.Tensor,  # [b, M] their tokens
    scores: torch.Tensor,  # [b, M] their scores (path probabilities)
    parent_flat: torch.Tensor,  # [b, M] their parents' flat indices (-1: the root)
    seq_lens: list[int],
    keep: torch.Tensor | None = None,  # [b, M] bool: the nodes to verify (None: all)
    drop: bool | None = None,
) -> list[TokenTree]:
    """A search's selected candidates as one TokenTree per request (batch_index for retrieve_index).
    Nodes outside `keep` are left out when `drop` (default: on the CPU: fewer verify rows), else kept
    unlinked, never verified (on a device, leaving them out would make the tree's size data-dependent:
    a host read per request; the extra rows cost a GPU nothing). Without dropping, every tree has M + 1
    nodes and the batch's trees are built at once (tree_batch: a few ops for the batch, not per request)."""
    drop = selected.device.type == "cpu" if drop is None else drop
    if keep is None or not drop:
        lens = to_device(torch.tensor(seq_lens, dtype=torch.long), selected.device)
        return unpack_trees(*tree_batch(roots, selected, tokens, scores, parent_flat, lens, keep))
    trees = []
    for b in range(roots.numel()):
        sel, tok, sc, pf = selected[b], tokens[b], scores[b], parent_flat[b]
        sel, tok, sc, pf = sel[keep[b]], tok[keep[b]], sc[keep[b]], pf[keep[b]]
        parents, unlinked = link_selected(sel, pf)
        node_tokens = torch.cat([to_device(roots[b : b + 1].long(), tok.device), tok.long()])
        node_scores = torch.cat([sc.new_ones(1), sc.float()])
        trees.append(
            tree_from_parents(node_tokens, parents, seq_lens[b], batch_index=b, unlinked=unlinked, scores=node_scores)
        )
    return trees


# rows of tree_batch's packed int64 output, per request: TokenTree's [N] int64 fields
TREE_LONGS = ("draft_tokens", "parents", "positions", "retrieve_index", "retrieve_next_token", "retrieve_next_sibling")


def tree_batch(
    roots: torch.Tensor,  # [b] each request's root token
    selected: torch.Tensor,  # [b, M] the selected candidates' flat indices, sorted (parents first)
    tokens: torch.Tensor,  # [b, M] their tokens
    scores: torch.Tensor,  # [b, M] their scores
    parent_flat: torch.Tensor,  # [b, M] their parents' flat indices (-1: the root)
    seq_lens: torch.Tensor,  # [b] int64, on selected's device
    keep: torch.Tensor | None = None,  # [b, M] bool: the nodes to verify; the others stay unlinked
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batch's trees of N = M + 1 nodes (root first) packed: longs [b, 6, N] (TREE_LONGS, in that
    order), tree_mask [b, N, N] bool, scores [b, N] float. Device ops over the whole batch at fixed
    shapes, nothing read: the same values as link_selected + tree_from_parents per request (which a
    captured draft search needs: its graph has the batch's shape, not a request's)."""
    b, m = selected.shape
    n, dev = m + 1, selected.device
    pos = torch.searchsorted(selected, parent_flat)
    found = (parent_flat >= 0) & (pos < m)
    found &= selected.gather(1, pos.clamp(max=max(m - 1, 0))) == parent_flat
    orphan = (~found) & (parent_flat >= 0)
    if keep is not None:
        orphan = orphan | ~keep
    parents = torch.cat([parent_flat.new_full((b, 1), -1), torch.where(found, pos + 1, 0)], 1)  # [b, N]
    linked = torch.cat([orphan.new_ones(b, 1), ~orphan], 1)
    mask = ancestor_masks(parents)
    first, sibling = child_lists(parents, linked)
    ar = torch.arange(n, dtype=torch.long, device=dev)
    longs = torch.stack(
        [
            torch.cat([roots.long().view(b, 1), tokens.long()], 1),
            parents,
            mask.sum(2) - 1 + seq_lens[:, None],  # seq_len + depth
            ar[None, :] + n * torch.arange(b, dtype=torch.long, device=dev)[:, None],
            first,
            sibling,
        ],
        1,
    )
    return longs, mask, torch.cat([scores.new_ones(b, 1), scores], 1).float()


@dataclass(eq=False)
class TreeBatch:
    """tree_batch's output for a padded batch of B requests, the real ones first, and the trees unpack_trees made of
    its first b rows (each field of tree i a view of row i): a verify reads the batch whole (a few copies into its
    graph's buffers) when its trees are these, in this order."""

    longs: torch.Tensor  # [B, 6, N] int64: TREE_LONGS
    mask: torch.Tensor  # [B, N, N] bool
    trees: list["TokenTree"]  # [b]

    def holds(self, trees: list["TokenTree"]) -> bool:
        """Whether `trees` are this batch's, in order and unchanged (no field of theirs assigned since)."""
        mine = self.trees
        return len(trees) == len(mine) and all(
            a is b and a.draft_tokens is c for a, b, c in zip(trees, mine, self._tokens)
        )

    def __post_init__(self):
        self._tokens = [t.draft_tokens for t in self.trees]


def unpack_trees(
    longs: torch.Tensor,
    mask: torch.Tensor,
    scores: torch.Tensor,
    finite: torch.Tensor | None = None,
    b: int | None = None,
) -> list[TokenTree]:
    """tree_batch's output (longs [B, 6, N], tree_mask [B, N, N], scores [B, N]) as one TokenTree per
    request of the first b (default: all B), each a view of its rows, linked to the batch (TokenTree.batch)."""
    b = longs.shape[0] if b is None else b
    if not b:
        return []
    # one unbind per field over the batch (not one per request): field f of request i is cols[f][i]
    cols = [f.unbind(0) for f in longs.unbind(1)]
    masks, rows = mask.unbind(0), scores.unbind(0)
    trees = [
        TokenTree(tree_mask=masks[i], scores=rows[i], finite=finite, **{n: c[i] for n, c in zip(TREE_LONGS, cols)})
        for i in range(b)
    ]
    packed = TreeBatch(longs, mask, trees)
    for t in trees:
        t.batch = packed
    return trees


def ancestor_masks(parents: torch.Tensor) -> torch.Tensor:
    """[b, N] parents (-1 for the root, parents[i] < i) -> [b, N, N] bool, row i = i and its ancestors.

    Pointer doubling: row i starts as {i, parent(i)} and jump(i) = its grandparent; each round adds
    the row of jump(i) and squares the jump, so after r rounds row i holds the ancestors up to
    distance 2^(r+1) - 1: log2(N) rounds, no host read."""
    b, n = parents.shape
    dev = parents.device
    ar = torch.arange(n, device=dev)
    up = torch.where(parents >= 0, parents, ar)  # the root is its own parent
    # (eye + scatter of a scalar: `mask[ar, up] = True` copies the Python scalar up and waits on a GPU)
    mask = torch.eye(n, dtype=torch.bool, device=dev).expand(b, n, n).scatter(2, up[..., None], True)
    jump = up.gather(1, up)
    rows = torch.arange(b, device=dev)[:, None]
    for _ in range(max(n - 1, 1).bit_length()):
        mask = mask | mask[rows, jump]
        jump = jump.gather(1, jump)
    return mask


def child_lists(parents: torch.Tensor, linked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's retrieve lists from parents [b, N] and linked [b, N] bool (the nodes verification may reach):
    (first child [b, N], next sibling [b, N]), children in index order, -1 where there is none."""
    n = parents.shape[1]
    ar = torch.arange(n, device=parents.device)
    child = (parents[:, None, :] == ar[None, :, None]) & linked[:, None, :]  # [b, parent, child]
    first = torch.where(child, ar, n).amin(2)
    later = (parents[:, None, :] == parents[:, :, None]) & (ar[None, :] > ar[:, None]) & linked[:, None, :]
    sibling = torch.where(later, ar, n).amin(2)
    return torch.where(first < n, first, -1), torch.where((sibling < n) & linked, sibling, -1)


def build_trees(
    root_tokens: torch.Tensor,
    search: TreeSearch,
    seq_lens: list[int],
    num_draft_tokens: int,
    min_prob: float = 0.0,
    drop: bool | None = None,
) -> list[TokenTree]:
    """Turn a finished search into one TokenTree per request. min_prob > 0: only a request's nodes whose
    score (path probability) reaches it are verified (a node's score never exceeds its parent's, so they
    form a tree); the others are dropped or unlinked as trees_from_candidates says."""
    top, draft, scores, parent_flat = search_candidates(search, num_draft_tokens)
    keep = scores >= min_prob if min_prob > 0 else None
    return trees_from_candidates(root_tokens, top, draft, scores, parent_flat, seq_lens, keep, drop)


def search_candidates(
    search: TreeSearch, num_draft_tokens: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A finished search's selected candidates, each [b, M]: flat indices (sorted), tokens, scores and
    their parents' flat indices (-1: the root)."""
    parent_list, top, draft = search.organize(num_draft_tokens)
    scores = torch.gather(search.flat_scores(), 1, top)
    pt = top // search.topk  # parent_list[:, 0] is -1 (the root): step-0 nodes map to it directly
    parent_flat = parent_list.gather(1, pt) if parent_list.numel() else torch.full_like(pt, -1)
    return top, draft, scores, parent_flat


def full_mask(trees: list[TokenTree], seq_lens: list[int]) -> torch.Tensor:
    """SGLang's FULL_MASK: flat bool, per request N rows x (seq_len + N) columns, prefix all True."""
    return torch.cat(
        [torch.cat([t.tree_mask.new_ones(t.num_nodes, s), t.tree_mask], 1).flatten() for t, s in zip(trees, seq_lens)]
    )
