"""Merged multi-drafter token trees (SpecInfer, Miao et al. 2024, §3): several drafters draft the same
request at once and their trees become ONE TokenTree, verified in one forward.

    --drafter suffix+eagle3          (any '+' combination of registered drafters; registry: merge_members)

Merge (per request, host lists: trees are small; a model member's trees come down from its device in one
copy per dtype for the step, the merge's one read, and the merged tree goes back up with the engine's trees):
- a trie over token paths from the root: a path proposed by several drafters is one node, so common
  prefixes are shared; each node keeps a bitmask of the drafters that proposed it (`provenance`, bit i =
  member i), which the per-drafter statistics read (MergeStats: proposed / accepted tokens per member);
- one node budget, TreeShape.num_draft_tokens: every member drafts with the step's shape (so a member alone
  is exactly what it drafts at that shape, and the merge is compared at the same budget), and the trie is
  cut back to the budget by score: the node's acceptance estimate under each drafter that proposed it
  (TokenTree.scores: a neural search's path probability, a lookup's share x match confidence), combined as
  a noisy-or, 1 - prod(1 - s_d): the chance that at least one proposer is right if they err independently,
  so a node proposed by several drafters ranks above the same node proposed by one. Every proposer of a
  node also proposed its parent with a score at least as high, so the combined score never rises from
  parent to child; nodes are taken best first (ties: more proposers, then trie order) and only under a
  kept parent, so the kept nodes are closed under parents.
- greedy verification needs nothing more (verify.py: the child equal to the target's argmax); siblings
  hold distinct tokens (a trie), so the accepted path is unique.

Sampling (SpecInfer's multi-step speculative sampling; verify.sampling_path tries a node's children in
index order, each with its draft_probs row). Facts the rule rests on (r: the parent's residual when the
child is tried, u: the verifier's uniform for that trial, drawn after drafting):
  (a) a point-mass trial (accept x with r(x), else zero r(x) and renormalise) leaves the emitted token
      distributed as r for ANY x, however x came about, as long as x is independent of u;
  (b) a q-trial (accept with min(1, r(x)/q(x)), else normalise(max(0, r - q))) does so only if, given
      everything that decided the trials before it (their tokens, rows and outcomes) and that this trial
      takes place, x is distributed as q;
  (c) a one-hot row is the point-mass trial.
Rule (merge_trees):
  1. sampled nodes (a member's node that carries a q row: a token drawn from q given its path) are
     inserted first, members in order, each member's nodes in index order. A sampled token equal to a
     child already in the trie at that place joins that node (provenance only; the node keeps its row).
     Otherwise it becomes a new node, last among its siblings so far, if the budget still has room (and
     the member's share of it, ceil((N - 1) / members): a sampled chain would otherwise fill a chain-shaped
     budget alone, and sampled nodes are never cut), with
     row q restricted to the tokens NOT held by its earlier siblings and renormalised. Its existence
     depends only on earlier draws (budget used, earlier siblings' tokens) and on "x is not one of those
     tokens", so given everything before it x is distributed exactly as that restricted row: (b) holds.
     Sampled nodes are never cut afterwards (a cut by score would depend on x's own value).
  2. point-mass nodes (lookup drafters, top-k trees, greedy chains) are inserted after, merged into
     any equal node (a sampled node keeps its q row: the point mass adds no trial of its own), and the
     budget left is filled with them by score. Their presence, order and tokens may depend on the sampled
     values (e.g. a point mass deduplicated into a sampled node): by (a) that is harmless, since nothing
     in the merge reads the verifier's uniforms.
  3. node indices follow insertion order, so among siblings the trial order is the insertion order the
     rows were computed for (a sampled node's row names the earlier siblings it excludes); rows: the
     restricted q of sampled nodes, one-hot for point masses ((c)); draft_probs None when no node is sampled.
What breaks it (tests/sglang_ext/test_merged.py: the chi-square tests fail for both): inserting point
masses first and letting a sampled token equal to one take the shared node with its q row (the sampled
token's own node then exists only when it differs from the point mass, so neither node's token is
distributed as its row); or keeping a sampled node's whole q row when its earlier siblings' tokens were
excluded from it (its token is then a draw from the restricted law, not from q).
Shape: every member drafts within depth and topk, but a merged node may have up to topk children per
member; depth never exceeds the shape's.

Lifecycle: add_request / commit / remove_request go to every member (commit: the same TargetCapture, its
tree_argmax re-indexed to each member's own tree for members that want it); capture_layers = union;
wants_tree_argmax / reads_reference / reads_prefix_hidden = any member's; release_request / drop_prefix (the
prefix cache, drafters/base.py) go to the members that keep state beside it, the others are removed.
needs_commit is True even for lookup-only merges: the merge reads the accepted path at commit for its
per-drafter statistics (a few host ops per step).

Adaptive speculation: a MemberShape (a TreeShape naming some members) makes only those members draft the
step; serving/adaptive.py offers each member alone beside the merge and measures which pays.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..tree import TokenTree, TreeShape, tree_from_parents, trees_on
from .base import Drafter, DraftInput, TargetCapture

SEPARATOR = "+"
MAX_MEMBERS = 8  # provenance bits per node


@dataclass(frozen=True)
class MemberShape(TreeShape):
    """A tree shape for some members of a merged drafter only (their indices); the others skip the step."""

    members: tuple[int, ...] = ()

    def plain(self) -> TreeShape:
        return TreeShape(self.depth, self.topk, self.num_draft_tokens, self.min_prob)

    @property
    def label(self) -> str:
        return f"{super().label}@{'+'.join(map(str, self.members))}"


def merged_default_tree(shapes: list[TreeShape]) -> TreeShape:
    """The default tree of a merge from its members' registry trees: depth and topk the largest (each
    member can still draft its own tree), nodes the sum of the members' draft nodes (the merge holds
    every member's default tree whole when they do not overlap: it never verifies less than either
    member would), min_prob the largest (a node below the stricter member's cut was rarely accepted:
    the measurement behind that cut, drafters/__init__.py)."""
    depth, topk = max(s.depth for s in shapes), max(s.topk for s in shapes)
    most = depth + 1 if topk == 1 else 1 + topk + (depth - 1) * topk**2
    nodes = min(most, 1 + sum(s.num_draft_tokens - 1 for s in shapes))
    return TreeShape(depth, topk, nodes, max(s.min_prob for s in shapes))


# --- the merge -------------------------------------------------------------------------------------


def _linked(tree: TokenTree) -> list[bool]:
    """Nodes verification can reach (tree_from_parents' `unlinked` ones cannot)."""
    n = tree.num_nodes
    listed = [False] * n
    listed[0] = True
    for v in tree.retrieve_next_token.tolist() + tree.retrieve_next_sibling.tolist():
        if v >= 0:
            listed[v] = True
    return listed


def _scores(tree: TokenTree) -> list[float]:
    """Each node's acceptance estimate; a tree without one: 1/2 per level (never rising down a path)."""
    if tree.scores is not None:
        return tree.scores.tolist()
    depth = (tree.positions - tree.positions[0]).tolist()
    return [0.5**d for d in depth]


@dataclass
class Trie:
    """The merged tree under construction: node 0 is the root; node ids are insertion order."""

    token: list[int]
    parent: list[int] = field(default_factory=lambda: [-1])
    bits: list[int] = field(default_factory=lambda: [0])
    miss: list[float] = field(default_factory=lambda: [0.0])  # prod over proposers of (1 - score)
    row: list = field(default_factory=lambda: [None])  # [V] q row of a sampled node, None = point mass
    fixed: list[bool] = field(default_factory=lambda: [True])  # root and sampled nodes: never cut
    kids: dict = field(default_factory=dict)  # (parent, token) -> node

    def _node(self, parent: int, token: int, bit: int, score: float, row, fixed: bool) -> int:
        self.kids[(parent, token)] = len(self.token)
        self.token.append(token)
        self.parent.append(parent)
        self.bits.append(bit)
        self.miss.append(1.0 - score)
        self.row.append(row)
        self.fixed.append(fixed)
        return len(self.token) - 1

    def _join(self, node: int, bit: int, score: float) -> int:
        if not self.bits[node] & bit:
            self.bits[node] |= bit
            self.miss[node] *= 1.0 - score
        return node

    def add_sampled(self, tree: TokenTree, bit: int, budget: int, share: int) -> list[int]:
        """Rule 1 (module docstring): at most `share` new nodes of this tree, the trie at most `budget`.
        Returns each node's place in the trie (-1: dropped for the budget)."""
        toks, pars, scores, linked = tree.draft_tokens.tolist(), tree.parents.tolist(), _scores(tree), _linked(tree)
        where = [0] + [-1] * (len(toks) - 1)
        added = 0
        for i in range(1, len(toks)):
            p = where[pars[i]]
            if p < 0 or not linked[i]:
                continue
            hit = self.kids.get((p, toks[i]))
            if hit is not None:
                where[i] = self._join(hit, bit, scores[i])
            elif added < share and sum(self.fixed) < budget:
                added += 1
                q = tree.draft_probs[i].double().clone()
                q[[self.token[c] for (pp, _), c in self.kids.items() if pp == p]] = 0.0  # earlier siblings
                total = q.sum()
                # q(x) > 0 for a token drawn from q; a drafter reporting 0 gets a point mass, lossless by (a)
                row = q / total if total > 0 and q[toks[i]] > 0 else None
                where[i] = self._node(p, toks[i], bit, scores[i], row, fixed=True)
        return where

    def add_points(self, tree: TokenTree, bit: int) -> list[int]:
        """Rule 2: every reachable node of a point-mass tree, merged into equal paths (cut later by select)."""
        toks, pars, scores, linked = tree.draft_tokens.tolist(), tree.parents.tolist(), _scores(tree), _linked(tree)
        where = [0] + [-1] * (len(toks) - 1)
        for i in range(1, len(toks)):
            p = where[pars[i]]
            if p < 0 or not linked[i]:
                continue
            hit = self.kids.get((p, toks[i]))
            where[i] = (
                self._join(hit, bit, scores[i])
                if hit is not None
                else self._node(p, toks[i], bit, scores[i], None, False)
            )
        return where

    def select(self, budget: int) -> list[int]:
        """The kept nodes, in trie order: the fixed ones, then the best others under kept parents."""
        kept = [i for i, f in enumerate(self.fixed) if f]
        keep = set(kept)
        others = sorted(
            (i for i, f in enumerate(self.fixed) if not f),
            key=lambda i: (self.miss[i], -bin(self.bits[i]).count("1"), i),
        )
        for i in others:
            if len(keep) >= budget:
                break
            if self.parent[i] in keep:
                keep.add(i)
        return sorted(keep)

    def build(self, kept: list[int], seq_len: int, batch_index: int = 0) -> tuple[TokenTree, torch.Tensor]:
        """(the TokenTree of the kept nodes, provenance [N] int64 bitmask)."""
        new = {old: k for k, old in enumerate(kept)}
        tokens = torch.tensor([self.token[i] for i in kept])
        parents = torch.tensor([-1] + [new[self.parent[i]] for i in kept[1:]])
        scores = torch.tensor([1.0 - self.miss[i] for i in kept])
        probs = None
        sampled = [i for i in kept if self.row[i] is not None]
        if sampled:
            vocab = self.row[sampled[0]].numel()
            probs = torch.zeros(len(kept), vocab, dtype=self.row[sampled[0]].dtype)
            for k, i in enumerate(kept[1:], 1):
                if self.row[i] is None:
                    probs[k, self.token[i]] = 1.0  # a point mass (c)
                else:
                    probs[k] = self.row[i]
        tree = tree_from_parents(tokens, parents, seq_len, batch_index=batch_index, draft_probs=probs, scores=scores)
        return tree, torch.tensor([self.bits[i] for i in kept], dtype=torch.long)


def merge_trees(
    trees: list[TokenTree], bits: list[int], budget: int, seq_len: int, batch_index: int = 0
) -> tuple[TokenTree, torch.Tensor, list[list[int]]]:
    """One request's member trees (same root) -> (the merged tree of at most `budget` nodes, its
    provenance [N] int64, each member tree's node -> merged node index or -1 when cut). Sampled trees
    (draft_probs set) first, then point-mass trees, each group in member order (module docstring)."""
    roots = {int(t.draft_tokens[0]) for t in trees}
    if len(roots) != 1:
        raise ValueError(f"member trees must share the root token, got {sorted(roots)}")
    trie = Trie([roots.pop()])
    where: list[list[int] | None] = [None] * len(trees)
    share = -(-(budget - 1) // len(trees))  # sampled nodes per member: they are never cut, so none takes it all
    for k, t in enumerate(trees):
        if t.draft_probs is not None:
            where[k] = trie.add_sampled(t, bits[k], budget, share)
    for k, t in enumerate(trees):
        if t.draft_probs is None:
            where[k] = trie.add_points(t, bits[k])
    kept = trie.select(budget)
    tree, provenance = trie.build(kept, seq_len, batch_index)
    new = {old: k for k, old in enumerate(kept)}
    return tree, provenance, [[new.get(w, -1) if w >= 0 else -1 for w in wk] for wk in where]


# --- the drafter -------------------------------------------------------------------------------------


@dataclass
class MergeStats:
    """Per member: draft nodes it proposed that were verified, and those accepted (a node proposed by
    several members counts for each); steps: merged trees verified."""

    proposed: list[int]
    accepted: list[int]
    steps: int = 0

    def as_dict(self, names: tuple[str, ...]) -> dict:
        return {
            n: {"proposed": p, "accepted": a, "accept_rate": round(a / p, 4) if p else 0.0}
            for n, p, a in zip(names, self.proposed, self.accepted)
        }


@dataclass
class _Proposal:
    """A request's last merged tree, until its verification is committed."""

    tokens: list[int]
    parents: list[int]
    provenance: list[int]
    where: dict[int, list[int]]  # member index -> its tree's node -> merged node (-1: cut)


class MergedDrafter(Drafter):
    """Members' trees merged into one per request (module docstring)."""

    needs_commit = True  # the accepted path feeds MergeStats (and members that need it)
    merge = staticmethod(merge_trees)

    def __init__(self, members: list[Drafter], names: list[str] | None = None):
        names = list(names or [m.name for m in members])
        if not 2 <= len(members) <= MAX_MEMBERS or len(names) != len(members):
            raise ValueError(f"a merged drafter needs 2 to {MAX_MEMBERS} members, got {len(members)}")
        if len(set(names)) != len(names):
            raise ValueError(f"a merged drafter's members must differ, got {SEPARATOR.join(names)}")
        self.members, self.member_names = list(members), tuple(names)
        self.name = SEPARATOR.join(names)
        self.capture_layers = tuple(sorted({layer for m in members for layer in m.capture_layers}))
        self.wants_tree_argmax = any(m.wants_tree_argmax for m in members)
        self.reads_reference = any(m.reads_reference for m in members)
        self.reads_prefix_hidden = any(m.reads_prefix_hidden for m in members if m.capture_layers)
        self.keeps_prefix_state = any(m.keeps_prefix_state for m in members)
        self.stats = MergeStats([0] * len(members), [0] * len(members))
        self._pending: dict[int, _Proposal] = {}

    def add_request(self, rid: int, capture: TargetCapture) -> None:
        for m in self.members:
            m.add_request(rid, capture)

    def remove_request(self, rid: int) -> None:
        self._pending.pop(rid, None)
        for m in self.members:
            m.remove_request(rid)

    def release_request(self, rid: int, taken: torch.Tensor) -> None:
        self._pending.pop(rid, None)
        for m in self.members:
            m.release_request(rid, taken)

    def drop_prefix(self, slots: torch.Tensor) -> None:
        for m in self.members:
            m.drop_prefix(slots)

    def stop_learning(self) -> None:
        for m in self.members:
            m.stop_learning()

    def member_stats(self) -> dict:
        """{member: {proposed, accepted, accept_rate}}: draft nodes verified and accepted, per member."""
        return self.stats.as_dict(self.member_names)

    def active(self, shape: TreeShape) -> list[int]:
        """The members drafting with `shape`: a MemberShape's, else all."""
        members = getattr(shape, "members", ())
        if any(not 0 <= i < len(self.members) for i in members):
            raise ValueError(f"{self.name}: no member {members} (it has {len(self.members)})")
        return sorted(set(members)) if members else list(range(len(self.members)))

    def propose(self, batch: list[DraftInput], shape: TreeShape) -> list[TokenTree]:
        active = self.active(shape)
        plain = shape.plain() if isinstance(shape, MemberShape) else shape
        drafted = {i: self.members[i].propose(batch, plain) for i in active}
        # the merge is host work: every member tree of the step comes down at once (one copy per dtype,
        # not a read per tree and field; a model member's trees are on its device)
        flat = trees_on([t for i in active for t in drafted[i]], "cpu")
        drafted = {i: flat[k * len(batch) : (k + 1) * len(batch)] for k, i in enumerate(active)}
        trees = []
        for b, d in enumerate(batch):
            if len(active) == 1:  # a member alone drafts exactly its own tree
                i = active[0]
                tree = drafted[i][b]
                provenance = torch.full((tree.num_nodes,), 1 << i, dtype=torch.long)
                provenance[0] = 0
                where = {i: list(range(tree.num_nodes))}
            else:
                tree, provenance, maps = self.merge(
                    [drafted[i][b] for i in active], [1 << i for i in active], plain.num_draft_tokens, d.seq_len, b
                )
                where = dict(zip(active, maps))
                flags = [drafted[i][b].finite for i in active if drafted[i][b].finite is not None]
                if flags:  # the members' finiteness flags, unread: the engine reads them in its copy
                    tree.finite = flags[0] if len(flags) == 1 else torch.stack(flags).all()
            self._pending[d.rid] = _Proposal(
                tree.draft_tokens.tolist(), tree.parents.tolist(), provenance.tolist(), where
            )
            trees.append(tree)
        return trees

    def commit(self, rid: int, capture: TargetCapture) -> None:
        prop = self._pending.pop(rid, None)
        argmax = capture.tree_argmax
        # a tree the merge did not propose (a predicted output's, a step without speculation) is not its own
        if prop is not None and capture.token_ids[:1] != prop.tokens[:1]:
            prop = None
        if prop is not None:
            self._count(prop, capture.token_ids)
        if argmax is not None and (prop is None or argmax.numel() != len(prop.tokens)):
            argmax = None
        for i, m in enumerate(self.members):
            if not m.needs_commit:
                continue
            own = None
            if argmax is not None and m.wants_tree_argmax and i in prop.where:
                nodes = prop.where[i]
                if min(nodes) >= 0:  # every node of the member's tree was kept: its argmaxes are known
                    own = argmax[torch.tensor(nodes)]
            m.commit(
                rid, TargetCapture(capture.token_ids, capture.positions, capture.slots, capture.hidden, capture.kv, own)
            )

    def _count(self, prop: _Proposal, accepted_tokens: list[int]) -> None:
        """MergeStats from the accepted path (accepted_tokens: root, then the accepted draft tokens)."""
        st = self.stats
        st.steps += 1
        for bits in prop.provenance[1:]:
            for i in range(len(self.members)):
                st.proposed[i] += (bits >> i) & 1
        node = 0
        for tok in accepted_tokens[1:]:
            node = next(
                (c for c in range(node + 1, len(prop.tokens)) if prop.parents[c] == node and prop.tokens[c] == tok), -1
            )
            if node < 0:
                return
            for i in range(len(self.members)):
                st.accepted[i] += (prop.provenance[node] >> i) & 1
